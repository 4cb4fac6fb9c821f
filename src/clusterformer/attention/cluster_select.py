"""``"cluster-select"``: each query reads the keys of the clusters *it selects*, beside a local window
(beyond the papers).

Neural clustering, routing, lsh and kmeans confine a query to its own cluster: query and key must land in one
group. Under a strict causal mask that costs recall (docs/recall-and-aggregation.md): nothing makes the query and the
distant key it needs share a cluster, and a sparse forward gives no gradient to pairs it keeps apart. Decoder-side
cluster retrieval (ClusterKV, and Quest's pages) turns it around: the *keys* are clustered, and a query scores the
clusters and reads the best ones. With a trained full MQAR model that selection (16 clusters, 32 selected keys + a
32-key window) kept 0.995 of the answers where a 64-key window keeps none. This mechanism
trains with it from the start, strictly causal:

1. q, k, v = x W^Q, x W^K, x W^V per head (separate projections: the selection is asymmetric).
2. Per head, ``num_clusters`` unit centroids mu (a buffer): key j's cluster is argmax_c k_j/|k_j| . mu_c (+ b_c,
   a load-balancing bias, with the experimental option ``balance``) -- it depends on key j alone, so later tokens
   cannot change it (strict causality, prefix invariance).
3. Query t selects the ``select`` clusters with the largest q_t . mu_c.
4. It reads, in one softmax (:func:`clusterformer.ops.selected_cluster_attention`), its window of ``window``
   positions (causal: (t - window, t]) and from each selected cluster the ``cluster_keys`` members nearest to it
   outside the window (causal: the most recent ones at positions <= t - window; with option ``members="score"`` the
   ones of largest q . k). Every key counts once.
5. The centroids follow the unit keys by an exponential moving average (mini-batch spherical k-means, as routing's
   do; applied at the next training forward or by :func:`clusterformer.attention.apply_pending_updates`, summed
   over DDP ranks); a commitment loss, published as ``"commitment"``, pulls the keys towards their centroids.

Option ``summaries`` (on by default; NSA's compressed branch, Yuan et al. 2025, with key clusters for blocks): the
query also reads, in the same softmax, one summary per cluster of the members outside its window that it does not
read alone -- mean key, mean value, logit q . mean / sqrt(D) + log n -- so every cluster gets the task's gradient,
selected or not, and ``selection="summaries"`` (the rule of version 1 of the defaults) ranks the clusters by those
logits (the clusters that would draw most weight). Every key outside the window then counts
once, alone or inside its summary; num_clusters more keys per query.

Option ``selection="bound"`` ranks the groups instead by Quest's upper bound of
q . k over their members (Tang et al. 2024: per-channel max and min, here per group and over whole blocks outside
the window), so that one key scoring high raises its group where the summaries' mean dilutes it.

The defaults (``DEFAULTS_VERSION`` 2): ``selection="bound"``, ``own_group`` (the query's own key's cluster is one of
the ``select``, read first) and ``sink=1`` (position 0 read by every query), with the summaries: level with version 1
of the defaults (the summaries' ranking, no own group, no sink) on 20NEWS-1500, IMDB-4K and ListOps, far above on the
histogram (ClusterSelectOptions). Runs recorded with version 1 are rebuilt with it (:meth:`earlier_defaults`).

Options whose ablations lost -- ``balance``, ``position_splits`` (with ``split_size`` and ``split_selection``) and
``page_size`` -- are kept apart in :class:`ExperimentalClusterSelectOptions`, which options naming them build, so
that the runs recorded with them can be rerun.

The selection is an argmax: its gradient reaches the selected keys only, as top-k attention's does. It differs from
the own-cluster rule in that a query meets the keys that *score* highest against it at the cluster level, which is
what a trained attention wants to read.

Keys per query: window + sink + select * cluster_keys (+ num_clusters summaries) at any length. Cost, with the banded
kernel (``kernel="auto"`` beyond N = 256): O(N C D) for the assignment, the selection and the summaries (per-chunk
prefix sums), O(N (2 window + select * cluster_keys) D) for the attention (the window by chunk-band matmuls, the
cluster keys as sparse key lists, ops/key_lists.py), plus one sort of the keys per head and one of the listed keys;
to N = 256 the dense-mask kernel's O(N^2 D) matmuls are faster on a CPU. The fused kernel (the default where it
runs) reads every key a query reads (window, sink, clusters) and its summaries in one C++ pass: O(N (window + select
* cluster_keys + C) D), faster than both at every length measured on the CPU
(docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step). Groups published: the key
clusters, (B, H, N). Cached decoding (``layer.prefill`` / ``layer.step``): the last ``window`` keys, each cluster's last
``cluster_keys`` members outside the window and the sums of all its members there (with selection="bound" their
running channel max and min), per head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from .._checks import check_choice, check_float, check_int
from ..masks import NO_MASK, AttentionMask, masked_sdpa
from ..ops.decode import MemberScoreCache, SelectionCache
from ..ops.selected import KERNELS, resolve_kernel, selected_cluster_attention
from ..ops.selected_band import ChunkBand, chunk_band
from ..ops.selected_layout import ClusterLayout, cluster_layout
from ..ops.selected_ranking import bound_selection, scored_members, summary_selection, with_own_group
from ..ops.spherical import spherical_assignment
from .aux import publish_groups, publish_losses
from .base import InnerAttention, SeededOptions
from .registry import register
from .routing import follow_tokens


@dataclass(frozen=True)
class ClusterSelectOptions(SeededOptions):
    """Options of ``"cluster-select"`` (besides ``dropout``, ``bias``, ``seed`` -- which seeds the centroids).

    Attributes:
        num_clusters: key clusters per head (centroids).
        select: clusters each query reads (at most ``num_clusters``).
        cluster_keys: keys each query reads from each selected cluster.
        window: local keys each query reads (even: non-causal queries see window / 2 positions on each side).
        decay: EMA decay of the centroids (0 = replace by the batch means; closer to 1 = slower).
        selection: "auto" (default): "bound" (resolved at construction, so that records name the rule that ran).
            In version 1 of the defaults "auto" means "summaries" with ``summaries``, else "scores"; runs recorded
            with version 1 are rebuilt with that rule (:meth:`earlier_defaults`).
            "scores": a query reads the clusters of largest q . mu; "random": the ablation with the
            same sizes -- ``select`` distinct clusters drawn per query from a hash of its position, head and one
            number drawn per forward from the layer's generator (so they do not depend on the batch or on later
            tokens; evaluation, re-seeded, is deterministic).
            "summaries": the clusters whose summary (below) of every member outside the window has the largest
            logit q . mean / sqrt(D) + log n -- the clusters that would draw most weight; needs ``summaries``.
            "bound": the groups of largest upper bound on q . k / sqrt(D) over their members outside the window,
            Quest's page score on groups (Tang et al. 2024): sum_d max(q_d hi_d, q_d lo_d) with hi, lo the
            channel-wise max and min of the members' keys in the whole blocks of ``bound_block`` positions outside
            the window (:func:`clusterformer.ops.selected_ranking.bound_logits`). One key that scores high raises
            its group, where the summaries' mean dilutes it among the group's other members.
            With or without ``summaries``; any grouping. The 2 G bound vectors are read to rank, not attended: they
            are not keys of the softmax (as the centroids of "scores" are not).
        kernel: "auto" (default), "gather", "dense-mask", "banded" or "fused": how the same keys are attended
            (:func:`clusterformer.ops.selected_cluster_attention`); "auto" takes the fused C++ kernel
            (:mod:`clusterformer.ops.listed_attention`) where it runs -- CPU float32/float64, no attention dropout,
            built -- else the dense mask while N <= 256 and the banded kernel (linear in N) beyond
            (:func:`clusterformer.ops.selected.resolve_kernel`). The same function by each: they differ in rounding
            and speed.
        grouping: "kmeans" (default): a key's cluster is its nearest centroid; "position": the ablation with
            contiguous groups -- position j is in group (j // page) mod num_clusters, pages of ``cluster_keys``
            positions (Quest's pages). "random": the ablation with random groups of the same expected size --
            position j is in group floor(C h(j) / 2^32), h Knuth's multiplicative hash of j + 1 (fixed by the
            position alone: the same in training and decoding, for any batch or prefix). Neither trains centroids
            (no commitment loss); both select by "summaries", "bound" or "random".
        summaries: also read one summary per cluster (its members outside the window that are not read alone: mean
            key, mean value, logit + log n) in the same softmax -- NSA's compressed branch with clusters for blocks:
            every cluster gets the task's gradient, not only the selected ones. Adds num_groups keys per query.
            On by default: on causal MQAR at 64 keys per query, without them no seed of two learned recall in 2,000
            steps; with them two of three from scratch by 4,000 steps, and both seeds tried (0.998, 0.997) after a
            dense warm-up (docs/recall-and-aggregation.md#mqar-from-scratch-at-256-and-512-tokens). Some records
            without the option ran with ``summaries=False``.
        bound_block: selection="bound": positions per block of the bounds; 0 (default) = 64. Members in the block
            that the window cuts are left out of the bound (they lie within window + bound_block positions), so
            that a cached decoder keeps one running max and min per group (O(G D) per head, any length).
        members: which of a selected group's members outside the window a query reads alone: "recent" (default): the
            ``cluster_keys`` nearest to its window (causal: the most recent); "score": the ``cluster_keys`` of
            largest q . k among all of them (ClusterKV's and cluster retrieval's re-ranking inside the selected groups;
            :func:`clusterformer.ops.selected_ranking.scored_members`), so a group larger than ``cluster_keys`` gives up
            its best-matching member wherever it lies. The keys per query do not change; the scores of the selected
            groups' members cost O(N select n D) for groups of n members, and cached decoding keeps every key
            (:class:`clusterformer.ops.decode.MemberScoreCache`: a step scores them all, O(t D) per head). An argmax,
            like the selection: the gradient reaches the keys read. Needs ``summaries=False`` (the summaries leave out
            the nearest members). On the trained MQAR models at N = 4,096 (docs/recall-and-aggregation.md) the needed
            key's group is selected for up to 0.92 of the queries but its key read alone for 0.61 (the group larger than
            ``cluster_keys``); trained with "score", balanced content clusters split by position
            (:class:`ExperimentalClusterSelectOptions`) keep 98% of full attention's accuracy there (86% with "recent"),
            at 0.70x its training step.
        own_group: True by default (None resolves to True): each query reads the group of its *own* key first,
            then the ``select`` - 1 best others by the selection
            (:func:`clusterformer.ops.selected_ranking.with_own_group`). Key t's group is known at t, so strict
            causality and prefix invariance hold. This is routing's and neural-clustering's own-cluster rule on key
            clusters, as one of the selected groups: a query whose needed keys share its own token's content (the
            histogram's count of its type; an earlier occurrence of its token) reads them without having to rank
            their group first. The keys per query do not change. On the trained histogram models
            (docs/recall-and-aggregation.md#histogram-aggregation-over-scattered-positions), layer 1's key clusters
            hold 0.99 of a query's needed keys in its own key's group, which the bound selected for 0.53 of them.
        sink: 1 by default (None resolves to min(1, cluster_keys // 2)):
            the first ``sink`` positions are read by every query (StreamingLLM's attention sinks, Xiao et al.
            2024; the BOS anchor of a count, Weiss et al. 2021): they form one more group, outside every cluster,
            that every query selects beside its ``select`` others (so ``sink`` more keys per query). At most
            cluster_keys // 2, so that a query reads the whole group on either side of its window. 0: none.

    The defaults (version 2): ``selection="bound"``, ``own_group=True``, ``sink=1`` with the summaries. Measured
    against version 1 (the summaries' mean, no own group, no sink) at 128 keys per
    query on three seeds each, they are level on 20NEWS-1500 (21.46 against 21.07), IMDB-4K (58.67 against 58.65)
    and ListOps (32.50 against 32.60), and far above on the histogram at 64 keys (0.798 against 0.44), where the
    answer is spread over positions chosen by content. Beside the bound on single-key recall, the own group and the
    sink cost 1.4 points on MQAR at equal keys read (64 clusters: 0.951 against 0.965, lower on each of three
    seeds); on the passkey, level (split clusters at 255 against 256 keys read: 0.886 against 0.888, higher on one
    of three seeds) (docs/long-documents.md, docs/recall-and-aggregation.md).
    """

    # 2: selection "bound", own_group and a sink of 1 by default; 1: "auto" selection is "summaries" (or "scores"
    # without summaries), no own group, no sink
    DEFAULTS_VERSION: ClassVar[int] = 2
    # the options whose ablations lost, kept apart so that the runs recorded with them can be rerun: the registry
    # builds this class for options that name any of them (registry.make_options)
    EXPERIMENTAL: ClassVar[type[ClusterSelectOptions]]

    num_clusters: int = 16
    select: int = 2
    cluster_keys: int = 32
    window: int = 64
    decay: float = 0.99
    selection: str = "auto"
    kernel: str = "auto"
    summaries: bool = True
    grouping: str = "kmeans"
    bound_block: int = 0
    own_group: bool | None = None
    sink: int | None = None
    members: str = "recent"

    @classmethod
    def earlier_defaults(cls, version: int, options: dict[str, Any]) -> dict[str, Any]:
        """Version 1: "auto" selection meant "summaries" (with summaries, the default) or "scores"; no own group;
        no sink."""
        if version >= 2:
            return {}
        pinned: dict[str, Any] = {name: value for name, value in (("own_group", False), ("sink", 0))
                                  if name not in options}
        if options.get("selection", "auto") == "auto":
            pinned["selection"] = "summaries" if options.get("summaries", True) else "scores"
        return pinned

    @property
    def num_groups(self) -> int:
        """The groups the keys fall into, each with one summary: the clusters (split by position with
        :class:`ExperimentalClusterSelectOptions`)."""
        return self.num_clusters

    @property
    def by_cluster(self) -> int:
        """:func:`clusterformer.ops.selected_ranking.top_groups`'s ``by_cluster``: 0, groups ranked alone."""
        return 0

    @property
    def page(self) -> int:
        """grouping="position": positions per page, ``cluster_keys`` (a selected page's most recent members are
        then mostly the whole page)."""
        return self.cluster_keys

    @property
    def balance_rate(self) -> float:
        """The step of the clusters' load-balancing bias: 0, none (the nearest centroid)."""
        return 0.0

    @property
    def experiments(self) -> dict[str, Any]:
        """The experimental options set away from their defaults (:class:`ExperimentalClusterSelectOptions`): none."""
        return {}

    def groups_of(self, clusters: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Key clusters (B, H, ...) at ``positions`` -> their groups: the clusters themselves."""
        return clusters

    def _groups_named(self) -> str:
        return f"num_clusters={self.num_clusters}"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, minimum in (("num_clusters", 1), ("select", 1), ("cluster_keys", 1), ("window", 2),
                              ("bound_block", 0)):
            check_int(name, getattr(self, name), minimum=minimum)
        if self.select > self.num_groups:
            raise ValueError(f"select must be at most {self._groups_named()}; got {self.select}")
        if self.window % 2:
            raise ValueError(f"window must be even (window / 2 positions on each side without a causal mask); "
                             f"got {self.window}")
        check_float("decay", self.decay, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_choice("selection", self.selection, ("auto", "scores", "random", "summaries", "bound"))
        check_choice("kernel", self.kernel, KERNELS)
        check_choice("grouping", self.grouping, ("kmeans", "position", "random"))
        check_choice("members", self.members, ("recent", "score"))
        if not isinstance(self.summaries, bool):
            raise ValueError(f"summaries must be a bool; got {self.summaries!r}")
        if not isinstance(self.own_group, bool | None):
            raise ValueError(f"own_group must be a bool; got {self.own_group!r}")
        # resolved here, so that records and checkpoints name what ran
        if self.selection == "auto":
            object.__setattr__(self, "selection", "bound")
        if self.own_group is None:
            object.__setattr__(self, "own_group", True)
        if self.sink is None:
            object.__setattr__(self, "sink", min(1, self.cluster_keys // 2))
        if self.grouping != "kmeans" and self.selection == "scores":
            raise ValueError(f"grouping={self.grouping!r} has no trained centroids to score: use "
                             "selection='summaries' (with summaries=True), 'bound' or 'random'")
        if self.selection == "summaries" and not self.summaries:
            raise ValueError("selection='summaries' ranks clusters by the summaries' logits: set summaries=True")
        check_int("sink", self.sink, minimum=0)
        if self.sink > self.cluster_keys // 2:
            raise ValueError(f"sink={self.sink} positions form a group every query reads whole: it must be at most "
                             f"cluster_keys // 2 = {self.cluster_keys // 2}")
        if self.members == "score" and self.summaries:
            raise ValueError("members='score' reads each selected group's best-scoring members, but the summaries "
                             "leave out its members nearest to the window: set summaries=False")
        if self.bound_block and self.selection != "bound":
            raise ValueError(f"bound_block={self.bound_block} sets the blocks of selection='bound' (got "
                             f"selection={self.selection!r})")

    @property
    def block(self) -> int:
        """The blocks of selection="bound", in positions (``bound_block``, 0 = 64); 0 for the other selections."""
        return (self.bound_block or 64) if self.selection == "bound" else 0

    @property
    def attended_groups(self) -> int:
        """The groups the attention reads from: num_groups, and with ``sink`` the sink group (id num_groups)."""
        return self.num_groups + (1 if self.sink else 0)

    def keys_read(self, length: int, causal: bool = False) -> int:
        """The window, the sink and ``select`` x ``cluster_keys`` members read alone; with ``summaries`` one logit
        per summary that holds a key (at most num_groups); with ``selection="bound"`` one per group bound ranked
        (num_groups, each group with a member outside the window); with ``selection="summaries"`` the
        ``select`` selected groups' summaries of all their members, which rank them, beside the summaries of their
        members not read alone, which are attended. ``members="score"`` scores every member of the selected groups
        outside the window: at most every key, and then only the selected groups hold members, so that of the
        bounds only their ``select`` count (N + select). The centroids of ``"scores"`` are trained state, not keys:
        not counted."""
        check_int("length", length, minimum=1)
        alone = min(length, self.window + self.sink + self.select * self.cluster_keys)
        if self.members == "score":  # needs summaries=False
            return length + (min(self.select, self.num_groups) if self.selection == "bound" else 0)
        summaries = min(self.num_groups, length - alone) if self.summaries else 0
        bounds = min(self.num_groups, max(0, length - self.window - self.sink)) if self.selection == "bound" else 0
        ranked = min(self.select, summaries) if self.selection == "summaries" else 0
        return alone + summaries + bounds + ranked

    def keys_mixed(self, length: int, causal: bool = False) -> int:
        """With ``summaries``, every key (the summaries mix all the members not read alone: a late query's whole
        past); without, the window, the sink and the members read alone."""
        check_int("length", length, minimum=1)
        if self.summaries:
            return length
        return min(length, self.window + self.sink + self.select * self.cluster_keys)

    def for_budget(self, keys: int, length: int, causal: bool = False) -> dict[str, Any]:
        """Keys read (:meth:`keys_read`): the summaries' and the bounds' num_groups logits each (with selection
        "summaries" the ``select`` ranking summaries too) and the ``sink`` first; of the rest,
        half (rounded down to even) to the window and the others shared by the ``select`` clusters. A budget whose
        clusters get fewer than 2 ``sink`` keys each (the sink must fit half of them) goes without the sink:
        ``{"sink": 0, ...}``."""
        check_int("keys", keys, minimum=1)
        split = self._split_budget(keys, self.sink)
        if split["cluster_keys"] < 2 * self.sink:
            return {**self._split_budget(keys, 0), "sink": 0}
        return split

    def _split_budget(self, keys: int, sink: int) -> dict[str, int]:
        rest = (keys - sink - (self.num_groups if self.summaries else 0)
                - (self.num_groups if self.selection == "bound" else 0)
                - (self.select if self.selection == "summaries" else 0))
        window = max(2, rest // 4 * 2)
        cluster_keys = (rest - window) // self.select
        if cluster_keys < 1:
            raise ValueError(f"keys={keys} leaves no key for each of the select={self.select} clusters beside a "
                             f"window of {window}" + (f" and {self.num_groups} summaries" if self.summaries else "")
                             + (f" and {self.num_groups} group bounds" if self.selection == "bound" else "")
                             + (f" and a sink of {sink}" if sink else ""))
        return {"window": window, "cluster_keys": cluster_keys}


def balance_step(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """One step of auxiliary-loss-free load balancing (Wang et al. 2024): the bias (H, C) of each cluster moves by
    ``rate`` towards the mean load -- up for a cluster with fewer keys than the mean, down for one with more, not at
    all at the mean. loads (H, C): each cluster's number of real keys, summed over DDP ranks (the counts of the
    centroids' update), so every rank takes the same step. Returns the new bias."""
    loads = loads.to(bias.dtype)
    return bias + rate * torch.sign(loads.mean(-1, keepdim=True) - loads)


@dataclass(frozen=True)
class ExperimentalClusterSelectOptions(ClusterSelectOptions):
    """``"cluster-select"``'s options whose ablations did not win (docs/recall-and-aggregation.md: Passkey,
    MQAR at 4,096 tokens), beside
    :class:`ClusterSelectOptions`'. Not defaults and not in ``describe``'s list; options that name any of them
    (``--attention "cluster-select:position_splits=8,split_size=128"``, a recorded run) build this class, so the
    runs recorded with them can be rerun. At their defaults they change nothing.

    Attributes:
        page_size: grouping="position": positions per page; 0 (default) = cluster_keys, so that a selected group's
            most recent members are mostly one whole page. Pages wrap around after num_clusters of them: with
            num_clusters * page_size >= N every group is one page.
        balance: grouping="kmeans": the step of a per-cluster bias added to the key-centroid cosines before the
            argmax (auxiliary-loss-free load balancing, Wang et al. 2024, as DeepSeek-V3 routes to experts): after
            each training forward, b_c += balance * sign(mean load - load_c), the loads counted over the real keys
            of the batch (summed over DDP ranks). Overfull clusters lose keys to empty ones, so a selected cluster's
            ``cluster_keys`` most recent members reach further back. 0 (default) = off: the nearest centroid. The
            bias is a buffer (``balance_bias``, (H, C)), fixed in evaluation and decoding, so a key's cluster still
            depends on the key alone. On the passkey at N = 1,024 (three seeds) it
            spread the clusters but left the accuracy level with the plain nearest centroid.
        position_splits: grouping="kmeans" (or "random", its control): split every key cluster by position into
            this many groups (1, the default: no split). Key j's group is c * position_splits + (j // split_size)
            mod position_splits, c its cluster: the members of one cluster in one span of ``split_size`` positions
            (the spans wrap around after position_splits of them). There are then num_clusters * position_splits
            groups, each with its summary, and a query selects groups: a large cluster becomes several small
            groups, so a selected group's ``cluster_keys`` most recent members reach back to a distant key of that
            cluster, which the whole cluster's most recent members do not (the passkey's misses). The group depends
            on the key and its position alone (strict causality and prefix invariance hold). Needs
            selection="summaries" or "bound" (the centroids cannot score a group's span). On the passkey the split
            clusters stayed below contiguous pages and random groups ranked the same way; on MQAR at N = 4,096,
            balanced and read by score, they kept 97-98% of full attention's accuracy, level with the random
            groups of the same shape.
        split_size: positions per span of ``position_splits`` (required with position_splits > 1).
        split_selection: with position_splits, how a query selects: "groups" (default): the ``select`` groups of
            largest logits; "clusters": the ``select`` clusters of largest log-sum-exp of their groups' logits (the
            weight a whole cluster's summaries would draw), then each selected cluster's one group of largest logit
            (:func:`clusterformer.ops.selected_ranking.top_groups`). ``select`` <= num_clusters then, and neither
            ``own_group`` nor ``sink`` (None resolves to False and 0). Below "groups" on the passkey.
    """

    page_size: int = 0
    balance: float = 0.0
    position_splits: int = 1
    split_size: int = 0
    split_selection: str = "groups"

    @property
    def num_groups(self) -> int:
        """num_clusters * position_splits groups, each with one summary."""
        return self.num_clusters * self.position_splits

    @property
    def by_cluster(self) -> int:
        """position_splits with split_selection='clusters', else 0."""
        return self.position_splits if self.split_selection == "clusters" else 0

    @property
    def page(self) -> int:
        return self.page_size or self.cluster_keys

    @property
    def balance_rate(self) -> float:
        return self.balance

    @property
    def experiments(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("page_size", "balance", "position_splits", "split_size",
                                                       "split_selection")
                if getattr(self, name) != type(self).__dataclass_fields__[name].default}

    def groups_of(self, clusters: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Key clusters (B, H, ...) at ``positions`` -> their groups c R + (j // split_size) mod R, R =
        position_splits (the clusters themselves when R = 1)."""
        if self.position_splits == 1:
            return clusters
        spans = torch.div(positions, self.split_size, rounding_mode="floor") % self.position_splits
        return clusters * self.position_splits + spans

    def _groups_named(self) -> str:
        splits = f" x position_splits={self.position_splits}" if self.position_splits > 1 else ""
        return f"num_clusters={self.num_clusters}{splits}"

    def __post_init__(self) -> None:
        check_int("position_splits", self.position_splits, minimum=1)  # before num_groups is read
        check_int("split_size", self.split_size, minimum=0)
        check_int("page_size", self.page_size, minimum=0)
        check_float("balance", self.balance, minimum=0.0)
        check_choice("split_selection", self.split_selection, ("groups", "clusters"))
        by_cluster = self.split_selection == "clusters"
        if by_cluster:  # one group per selected cluster: neither the own group nor the sink by default
            for name, off in (("own_group", False), ("sink", 0)):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, off)
        super().__post_init__()
        if self.page_size and self.grouping != "position":
            raise ValueError(f"page_size={self.page_size} needs grouping='position'")
        if self.balance and self.grouping != "kmeans":
            raise ValueError(f"balance={self.balance} balances the centroids' clusters: it needs grouping='kmeans' "
                             f"(got {self.grouping!r})")
        if self.position_splits > 1:
            if self.grouping == "position":
                raise ValueError(f"position_splits={self.position_splits} splits content clusters by position: it "
                                 f"needs grouping='kmeans' or its control 'random' (got {self.grouping!r})")
            if self.selection not in ("summaries", "bound"):
                raise ValueError(f"position_splits={self.position_splits} needs selection='summaries' (with "
                                 f"summaries=True) or 'bound': the centroids cannot score a group's span of positions")
            if not self.split_size:
                raise ValueError(f"position_splits={self.position_splits} needs split_size, the positions per span")
        elif self.split_size:
            raise ValueError(f"split_size={self.split_size} needs position_splits > 1")
        if by_cluster:
            if self.position_splits == 1:
                raise ValueError("split_selection='clusters' selects clusters, then a span of each: it needs "
                                 "position_splits > 1")
            if self.select > self.num_clusters:
                raise ValueError(f"split_selection='clusters' reads one group of each of select={self.select} "
                                 f"clusters: select must be at most num_clusters={self.num_clusters}")
            for name in ("own_group", "sink"):
                if getattr(self, name):
                    raise ValueError(f"{name} reads a group beside the selected ones: it needs "
                                     "split_selection='groups' (with 'clusters' a cluster could be read twice)")


ClusterSelectOptions.EXPERIMENTAL = ExperimentalClusterSelectOptions


@register("cluster-select", ClusterSelectOptions,
          "keys clustered (EMA k-means); each query reads its own key's cluster and its best-ranked others' nearest "
          "keys, a window, the first token and one summary per cluster; O(N C D + N (window + select * cluster_keys) "
          "D)")
class ClusterSelectAttention(InnerAttention):
    aux_losses = ("commitment",)
    decodes = True
    dense_warmup = True  # dense_training: every key in training forwards, the centroids following the keys as usual

    def __init__(self, dim: int, heads: int, options: ClusterSelectOptions) -> None:
        super().__init__(dim, heads, options)
        init = torch.randn(heads, options.num_clusters, self.head_dim, generator=self.generator)
        self.register_buffer("centroids", F.normalize(init, dim=-1))  # (H, C, D) unit vectors
        if options.balance_rate:  # only then: checkpoints of runs without it keep their keys
            self.register_buffer("balance_bias", torch.zeros(heads, options.num_clusters))  # (H, C)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = NO_MASK
                ) -> torch.Tensor:
        causal = mask.causal  # the layout's and the selection bound's order; the other ops take the mask itself
        if self.updates_state():
            self.apply_pending_updates()
        o = self.options
        B, _, N, _ = q.shape
        # the layer's q, k, v are strided views of its fused projection, which the fused kernels (the assignment,
        # the selection, the members' scores, the attention) read in place and whose gradients they write back in
        # its layout (ops/heads.py)
        real = mask.real(B, N, q.device)  # (B, N)
        positions = torch.arange(N, device=q.device)
        if o.grouping != "kmeans":  # the ablations: groups fixed by the position
            ids = self._assign(k, positions)
            publish_losses({"commitment": q.new_zeros(())})
        else:
            assignment = spherical_assignment(k, self.centroids, bias=self._balance_bias(), real=real)
            # the commitment loss and the EMA centroids, as routing's; the loads (summed over ranks) for balance
            loads = follow_tokens(self, assignment, real, o.decay)
            if o.balance_rate and loads is not None:
                self.pending["balance_bias"] = balance_step(self.balance_bias, loads, o.balance_rate)
            ids = o.groups_of(assignment.ids, positions)
        ids = self._sunk(ids, positions)
        publish_groups(self, ids)
        if self.dense_training and self.training:  # train --dense-warmup-steps
            allowed = mask.allowed(N, N, q.device)
            return masked_sdpa(q, k, v, allowed, dropout_p=self.dropout_p)
        G = o.attended_groups
        key_ids = ids.masked_fill(~real[:, None, :], G)
        layout = cluster_layout(key_ids, num_clusters=G, window=o.window, causal=causal)
        # one choice for the selection and the attention
        kernel = resolve_kernel(o.kernel, N, q=q, dropout_p=self.dropout_p)
        band = None  # the banded kernel's chunk bands, built once for the summaries' selection and the attention
        if kernel == "banded":
            band = chunk_band(q * q.shape[-1] ** -0.5, k, v, key_ids, mask, num_clusters=G, window=o.window,
                              summaries=o.summaries)
        selected = self._forced(self._choose(q, k, key_ids, layout, mask, kernel, band), ids)
        members = (scored_members(q, k, layout, selected, cluster_keys=o.cluster_keys, causal=causal)
                   if o.members == "score" else None)
        return selected_cluster_attention(q, k, v, key_ids, selected, num_clusters=G,
                                          cluster_keys=o.cluster_keys, window=o.window, mask=mask,
                                          dropout_p=self.dropout_p,
                                          kernel=kernel, summaries=o.summaries, layout=layout, band=band,
                                          members=members)

    def _nearest(self, k: torch.Tensor) -> torch.Tensor:
        """Keys (B, H, ..., D) -> their clusters (B, H, ...): the nearest unit centroid to the unit key (with
        ``balance``: the largest cosine plus the cluster's bias), as the training forward finds it."""
        B, H, *rest, D = k.shape
        with torch.no_grad():
            ids = spherical_assignment(k.reshape(B, H, -1, D), self.centroids, bias=self._balance_bias()).ids
        return ids.view(B, H, *rest)

    def _balance_bias(self) -> torch.Tensor | None:
        """The clusters' load-balancing bias (H, C) with the experimental ``balance``, else None."""
        return self.balance_bias if self.options.balance_rate else None

    def _sunk(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Option ``sink``: the groups (B, H, ...) at ``positions`` with the first ``sink`` positions in the sink
        group (id num_groups)."""
        if not self.options.sink:
            return ids
        return torch.where(positions < self.options.sink, self.options.num_groups, ids)

    def _forced(self, ranked: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """The groups a query reads, (..., select), and the sink group before them with ``sink``, from ``ranked``
        (..., select; best first, the real groups alone) and the group of the query's own key ``own`` (...): with
        ``own_group`` its own group first, in place of the worst (unless it is the sink group, which the query
        reads anyway)."""
        o = self.options
        if not o.sink:
            return with_own_group(ranked, own) if o.own_group else ranked
        sink = torch.full_like(own, o.num_groups)
        if o.own_group:
            ranked = torch.where((own == sink).unsqueeze(-1), ranked, with_own_group(ranked, own))
        return torch.cat([sink.unsqueeze(-1), ranked], -1)

    def _choose(self, q: torch.Tensor, k: torch.Tensor, key_ids: torch.Tensor, layout: ClusterLayout,
                mask: AttentionMask, kernel: str, band: ChunkBand | None) -> torch.Tensor:
        """The ``select`` clusters each query ranks best, (B, H, N, S), by the option ``selection``, among the real
        groups alone (with ``sink``, not the sink group, which :meth:`_forced` adds; the bound leaves its members
        out, as groups without members in whole blocks tie and may still be read). ``kernel``: the resolved kernel,
        whose way the summaries' logits are computed; ``band``: the banded kernel's chunk bands, which hold them;
        ``mask``: the call's mask."""
        o = self.options
        B, H, N, _ = q.shape
        if o.selection == "scores":
            return self._select(q, o.select)
        if o.selection == "summaries":
            return summary_selection(q, k, key_ids, layout, select=o.select, window=o.window, mask=mask,
                                     kernel=kernel, band=band,
                                     by_cluster=o.by_cluster, groups=o.num_groups)
        if o.selection == "bound":
            return bound_selection(q, k, key_ids.clamp(max=o.num_groups), num_groups=o.num_groups, select=o.select,
                                   window=o.window, causal=mask.causal, block=o.block, by_cluster=o.by_cluster,
                                   kernel=kernel)
        return self._random_selection(B, H, N, q.device)

    def _pages(self, positions: torch.Tensor) -> torch.Tensor:
        """grouping="position": the group of each position, (position // page) mod num_clusters."""
        o = self.options
        return torch.div(positions, o.page, rounding_mode="floor") % o.num_clusters

    def _hashed_groups(self, positions: torch.Tensor) -> torch.Tensor:
        """grouping="random": floor(C h(j) / 2^32) with h(j) = (j + 1) 2654435761 mod 2^32 (Knuth's multiplicative
        hash, whose high bits are the well-mixed ones)."""
        hashed = ((positions + 1) * 2654435761) % (1 << 32)
        return (hashed * self.options.num_clusters) >> 32

    def _assign(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys (B, H, ..., D) at ``positions`` (broadcasting to (B, H, ...)) -> their groups (B, H, ...): the page of
        the position (grouping="position"), its hashed group ("random") or the nearest centroid of the key (split
        by position with the experimental ``position_splits``)."""
        if self.options.grouping == "position":
            return self._pages(positions).expand(k.shape[:-1])
        if self.options.grouping == "random":
            return self.options.groups_of(self._hashed_groups(positions), positions).expand(k.shape[:-1])
        return self.options.groups_of(self._nearest(k), positions)

    def _select(self, q: torch.Tensor, select: int) -> torch.Tensor:
        """Queries (B, H, ..., D) -> the ``select`` clusters of largest q . mu, (B, H, ..., select)."""
        scores = torch.einsum("bh...d,hcd->bh...c", q.detach(), self.centroids.to(q.dtype))
        return scores.topk(select, dim=-1).indices

    def _random_selection(self, B: int, H: int, N: int, device: torch.device, start: int = 0) -> torch.Tensor:
        """``select`` distinct clusters per (position, head): the top of hashed scores (Knuth's multiplicative hash of
        position, head, cluster and one draw), (B, H, N, S) for positions start..start + N - 1."""
        C = self.options.num_groups
        draw = int(torch.randint(0, 2**30, (1,), generator=self.draw_generator()))
        position = torch.arange(start, start + N, device=device)[:, None, None]
        head = torch.arange(H, device=device)[None, :, None]
        cluster = torch.arange(C, device=device)[None, None, :]
        hashed = (((position * H + head) * C + cluster + draw) * 2654435761) % (1 << 32)  # (N, H, C)
        return hashed.topk(self.options.select, dim=-1).indices.permute(1, 0, 2).unsqueeze(0).expand(B, H, N, -1)

    # cached decoding: the last `window` keys and, per cluster, its last `cluster_keys` members outside the window
    # (clusterformer.ops.decode.SelectionCache); a step costs O((window + select * cluster_keys) D + C D) per head.
    # With members="score" every key besides (MemberScoreCache): a step scores them all, O(t D) per head.
    def cache_from(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: AttentionMask) -> SelectionCache | MemberScoreCache:
        o = self.options
        positions = torch.arange(k.shape[2], device=k.device)
        ids = self._sunk(self._assign(k, positions), positions)
        cache = MemberScoreCache if o.members == "score" else SelectionCache
        return cache.from_prompt(ids, k, v, mask, o.attended_groups, o.cluster_keys, o.window,
                                 bound_block=o.block)

    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, cache: SelectionCache | MemberScoreCache
             ) -> tuple[torch.Tensor, SelectionCache | MemberScoreCache]:
        if self.options.selection == "random":
            raise ValueError("cluster-select with selection='random' is a training ablation: it has no cached "
                             "decoding (its random clusters depend on the position); use selection='scores'")
        o = self.options
        position = cache.lengths[:, None]
        own = self._sunk(self._assign(k_t, position), position)
        cache.append(k_t, v_t, own)
        if o.selection == "scores":
            selected = self._select(q_t, o.select)
        elif o.selection == "bound":  # the real groups alone (not the sink group)
            selected = cache.bound_selection(q_t, o.select, o.by_cluster, groups=o.num_groups)
        else:
            selected = cache.summary_selection(q_t, o.select, o.by_cluster, groups=o.num_groups)
        selected = self._forced(selected, own.reshape(selected.shape[:-1]))
        return cache.attend(q_t, selected, o.summaries), cache

    def extra_repr(self) -> str:
        o = self.options
        return (f"num_clusters={o.num_clusters}, select={o.select}, cluster_keys={o.cluster_keys}, "
                f"window={o.window}" + "".join(f", {name}={value}" for name, value in o.experiments.items())
                + (f", selection=bound, bound_block={o.block}" if o.selection == "bound" else "")
                + (", own_group=True" if o.own_group else "") + (f", sink={o.sink}" if o.sink else "")
                + (", members=score" if o.members == "score" else ""))
