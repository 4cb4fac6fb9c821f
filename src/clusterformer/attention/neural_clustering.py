"""``"neural-clustering"``: Neural Clustering Attention (ClusterFormer paper, sections 3.1-3.2, app. B).

Per layer, for x (B, N, dim):

1. Clustering (eqs. 2-4, :func:`clusterformer.clustering.neural_clustering`): P = x W^C;
   U = softmax over positions of phi(C_i, P_j) * scale; C_hat = U P; I_j = argmax_i U_ij.
   Losses L1 (eq. 6) and L2 (eq. 11) are published (:mod:`clusterformer.attention.aux`) as
   ``"clustering"`` and ``"centroid_sorting"``; the assignments as the groups, (B, N).
2. Sort x by I (eq. 5) into the window buffer of :mod:`clusterformer.ops.layouts` (one ``index_select``),
   then Q^S, K^S, V^S = X^S W^Q, X^S W^K, X^S W^V (eq. 7) in sorted order, as in the paper.
3. Chunks of w = ceil(N / k); each attends to itself and ``look_back`` previous chunks (eqs. 8-9):
   one SDPA call over all windows; outputs return to token order (eq. 10). This is exactly
   :func:`clusterformer.ops.sorted_chunk_attention` with ids shared by the heads.
4. The layer's output projection.

Cost: O(N k d) for the clustering plus O(N (look_back + 1) w d) for attention; with k = sqrt(N),
O(N sqrt(N) d) (paper section 3.3) -- while sqrt(N) <= ``max_clusters`` (128 by default: N <= 16,384). Beyond, k stays
at ``max_clusters`` and the chunk grows as N / max_clusters (2,048 keys per query at 131,072 tokens with the default):
O(N^2 / max_clusters d). Raise ``max_clusters`` (to 362 for N = 131,072) to keep N sqrt(N); the layer then owns that
many centroids. ``local_window`` adds O(N local_window d).

Causal modes (``causal=True`` in the call):

* ``causal_mode="strict"`` (default): output t depends on tokens 0..t only. The assignment is each token's
  nearest parameter centroid (argmax_i phi(C_i, x_t W^C): no normalisation over positions), and each
  cluster is chunked on its own by the token's rank among *earlier* tokens of its cluster
  (:func:`clusterformer.ops.cluster_causal_attention`). The number of clusters (``causal_clusters`` with
  ``num_clusters="sqrt"``, default 16) and the block size (``causal_chunk_size``, default 16) are fixed, not
  derived from N, so the outputs at positions 0..t are the same whether the layer sees t + 1 tokens or more
  (prefix invariance, what cached generation needs). The defaults are what "sqrt" gives at N = 256
  (k = 16, w = 16); a token attends to at most (look_back + 1) * causal_chunk_size earlier tokens of its
  cluster at any length. Cost O(N (look_back + 1) causal_chunk_size d), plus the empty slots of the
  cluster-aligned layout (each cluster rounded up to whole blocks): a larger block costs more than its
  keys (64 at N = 256 doubled the training time of the character LM).
  Centroids flowing from a previous layer would carry information from the whole sequence, so strict mode
  refuses them.
* ``causal_mode="paper"``: appendix B. Same clustering and chunking as without a mask; inside chunks keys
  after the query are masked (eqs. 12-14). The assignment (U is normalised over *all* positions) and the
  chunk boundaries depend on the whole sequence, so *which* past keys a token sees can change when a
  future token changes: no future value leaks directly, but the attention pattern does. Not suitable for
  autoregressive generation; provided for faithful reproduction.

Centroids. With ``own_centroids=True`` (default) the layer owns C (k x dim parameters). The paper lets
centroids flow between layers (first layer from parameters, later layers start from the previous layer's
C_hat): the encoder does this with ``centroid_flow=True``, building later layers with
``own_centroids=False`` and handing each layer the previous one's C_hat as ``flow=`` (with
``return_flow=True`` a layer returns its own C_hat: :meth:`clusterformer.attention.AttentionLayer.forward`).

Number of clusters. ``num_clusters`` is an int, or ``"sqrt"``: k_b = round(sqrt(L_b)) for each sequence's
real length L_b (not the padded length of the batch), clamped to [1, max_clusters]; the layer then owns
``max_clusters`` centroids and sequence b uses the first k_b. k >= N is allowed (chunks of one token).

What the tokens are clustered by (``cluster_on``). The paper clusters P = x W^C, a projection that only the
clustering losses train: the argmax assignment passes no gradient from the task, so nothing moves a query and the
key it needs into one cluster (key recall 0.00 on causal MQAR:
docs/recall-and-aggregation.md#why-neural-clustering-does-not-recall). ``cluster_on="shared-qk"``
clusters P = x W^QK instead, the projection attention itself uses for both queries and keys (the Reformer's and
the Routing Transformer's choice): a large q_i . k_j is a small angle between them, so the task's gradient on the
attention logits pulls a query and its key towards one centroid. Keys are then unit vectors per head and a token
attends to itself only when it has no other key in its cluster chunks and local blocks together (the shared-QK
rule of ``"lsh"``, ``"routing"``, ``"kmeans"``). The clustering losses train the centroids only (P is detached for
them): L1 pulls every point onto its centroid, and on the attention's own keys that collapse (L1 = -0.998 after 500
steps of causal MQAR when it reached W^QK) leaves a cluster's keys indistinguishable. The centroids follow the
tokens; the tokens follow the task (the Routing Transformer's split, with its EMA in place of L1).

Padding and batch invariance. Padded tokens are excluded from U, C_hat and the losses, get cluster id
max_b k_b (sorted after every real token), take no part in the chunks and are never attended to. k_b and
the chunk size w_b = ceil(L_b / k_b) come from the sequence's own length, and the first chunk looks back to
the sequence's own last chunk, so a sequence's outputs on its real tokens do not depend on the amount of
padding or on the other sequences of its batch. (The auxiliary losses are batch means.) With a centroid
flow, the centroids in and out have max_b k_b rows; rows at or after k_b are unused (zero).

NaN input. Not checked (a check would cost a device sync per call): NaN in one sequence stays in that
sequence's outputs (attention and clustering are per sequence), but the batch-averaged losses become NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_choice, check_float, check_int
from ..clustering.kmeans import ema_centroid_update, spherical_kmeans
from ..clustering.neural import assignment_scores, nearest_centroid, neural_clustering, prefix_assignment_step
from ..distributed import all_reduce_sum
from ..masks import NO_MASK, AttentionMask, masked_sdpa, self_only_when_alone
from ..ops.cluster_runs import cluster_runs, run_attention
from ..ops.decode import GroupRingCache, JoinedCache, LocalBlockCache, attend_allowed, merge_attention
from ..ops.layouts import ChunkLayout, cluster_causal_layout, sorted_layout
from ..ops.recompute import attach_recipe, recipe_of, recompute_saved
from ..ops.windows import windowed_attention, windowed_attention_lse
from .aux import publish_groups, publish_losses
from .base import InnerAttention, QKVProjection, SeededOptions, check_prompt_mask
from .registry import register


class ClusterCount(NamedTuple):
    """How one forward groups: ``clusters`` k (the largest k_b when each sequence has its own), ``strict`` (strict
    causal mode: a fixed k and block size), and when k follows each sequence's real length (a padding mask
    without strict mode) the (B,) real ``lengths`` L_b and k_b (``per_sequence``); otherwise both None."""

    clusters: int
    strict: bool
    lengths: torch.Tensor | None = None
    per_sequence: torch.Tensor | None = None


GROUPINGS = ("learned", "contiguous", "random")
CLUSTER_INPUTS = ("hidden", "shared-qk", "query-key")
CAUSAL_ASSIGNMENTS = ("nearest", "prefix")
CENTROID_FITS = ("queries-keys", "keys")
CENTROID_UPDATES = ("losses", "ema")
HEAD_CLUSTERS = ("own", "shared")
REACH_SPLITS = ("equal", "fill")


def random_groups(length: int, num_clusters: torch.Tensor, draw: int, device: torch.device) -> torch.Tensor:
    """Pseudo-random cluster ids (B, length) in [0, num_clusters[b]) from each position and one number ``draw``:
    Knuth's multiplicative hash of (position + draw) mod 2^32, scaled to [0, k_b). A token's id depends on its
    position, its sequence's k and the draw only -- not on the batch -- and a prefix gets the same ids."""
    return _hash_groups(torch.arange(length, device=device, dtype=torch.long).unsqueeze(0), num_clusters, draw)


def _hash_groups(positions: torch.Tensor, num_clusters: torch.Tensor, draw: int) -> torch.Tensor:
    """positions (1 or B, N) long -> ids (B, N) in [0, num_clusters[b]): the hash of :func:`random_groups`."""
    hashed = ((positions + draw) * 2654435761) % (1 << 32)  # < 2^63 for positions + draw < 2^31
    return (hashed * num_clusters.unsqueeze(1)) >> 32


def _local_has_other(B: int, N: int, block: int, mask: AttentionMask, device: torch.device) -> torch.Tensor:
    """(B * N,) bool: whether query t's local blocks (positions [(t // block - 1) block, (t // block + 1) block),
    up to t under a causal ``mask``) hold a real token other than t, counted with a prefix sum of the real tokens."""
    causal = mask.causal
    real = mask.real(B, N, device).long()
    before = F.pad(real.cumsum(1), (1, 0))  # before[:, j] = real tokens at positions < j
    t = torch.arange(N, device=device)
    start = (torch.div(t, block, rounding_mode="floor") - 1).clamp(min=0) * block
    end = t + 1 if causal else ((torch.div(t, block, rounding_mode="floor") + 1) * block).clamp(max=N)
    return ((before[:, end] - before[:, start]) > 1).reshape(-1)


@dataclass(frozen=True)
class NeuralClusteringOptions(SeededOptions):
    """Options of ``"neural-clustering"`` (besides ``dropout``, ``bias``).

    Attributes:
        num_clusters: k, an int >= 1, or "sqrt" for round(sqrt(L)) from each sequence's real length L.
        max_clusters: with "sqrt", the number of centroids owned (k is clamped to it).
        look_back: previous chunks each query chunk attends to (the paper uses 1: "two blocks").
        causal_mode: "strict" (no dependence on later tokens) or "paper" (appendix B); used when the
            layer is called with causal=True.
        causal_clusters: strict causal mode with ``num_clusters="sqrt"``: the number of clusters, fixed so
            that a prefix is clustered the same whatever follows it; clamped to ``max_clusters`` (an int
            ``num_clusters`` is used as is).
        causal_chunk_size: strict causal mode: tokens per block of a cluster, fixed for the same reason
            (the non-causal layer uses ceil(N / k)).
        similarity: "cosine" (bounded, default) or "dot" (the paper's literal inner product).
        similarity_scale: multiplies phi inside the softmax over positions (eq. 2).
        own_centroids: own a centroid parameter; False means centroids flow in from the previous layer.
        grouping: "learned" (the paper), or an ablation with the same chunk size, look-back and causal
            semantics and no clustering losses: "contiguous" -- every token in one group, so the sorted chunks are
            contiguous blocks of the original order (local block attention); "random" -- each token in a random
            cluster, drawn afresh for every training forward (:func:`random_groups`: a hash of the token's position
            and one number drawn from the layer's generator, so the groups of a sequence do not depend on its batch,
            and evaluation, re-seeded, is deterministic).
        cluster_on: what the tokens are clustered by. "hidden" (the paper): P = x W^C, a projection of its own that
            only the clustering losses train (the argmax passes no gradient from the task). "shared-qk" (beyond the
            paper; the Reformer's and the Routing Transformer's choice): queries and keys are one
            projection, P = x W^QK, and the tokens are clustered by the vectors attention itself is trained to
            match, so a query and the key it needs are pulled into one cluster by the task's own gradient. As in
            the other shared-QK mechanisms, keys are unit vectors and a token attends to itself only when it has no
            other key. Needs the layer's own projections (``AttentionLayer``; not ``hf.patch``).
            "query-key" (beyond the paper): each head's queries and keys are assigned apart, each to its nearest
            of the head's shared centroids (the layer's k x dim centroids, split by heads) by its own projection, q
            = x W^Q and k = x W^K; a query reads the (look_back + 1) x chunk keys of its cluster nearest to it (the
            latest ones up to it under a causal mask: :func:`clusterformer.ops.cluster_runs.cluster_runs`; a query
            whose cluster holds no such key reads nothing and outputs 0, where the paper's form always reads the
            token itself). In the paper's form a query and its key share the token's cluster, so the key it needs
            must *be* like it; here the query needs only to score its key high, which is what attention trains (and
            what a trained full-attention model already does). The two losses train the centroids on the detached
            queries and keys (or the centroids follow their points' means: ``centroid_update``).
            ``causal_mode="strict"`` with the nearest assignment, learned grouping, no ``local_window``,
            ``explore``, centroid flow or cached decoding.
        centroid_fit: with ``cluster_on="query-key"``, the points each head's centroids are fitted to.
            "queries-keys" (default): the head's queries and keys together. "keys": its keys alone, so that a
            centroid stands for a group of keys and a query goes to the group it scores highest. Queries and keys
            lie in different regions of a head's space, so fitted to both, centroids split into ones near the
            queries and ones near the keys, and a query's nearest centroid may hold few of the keys it needs
            (measured in docs/recall-and-aggregation.md#queries-and-keys-assigned-apart).
        centroid_update: with ``cluster_on="query-key"``, how the centroids follow those points. "losses"
            (default): the paper's two losses, by gradient. "ema": online spherical k-means, the Routing
            Transformer's rule, and no losses: each training forward moves every centroid of a head towards the
            mean of the unit points nearest to it, c <- normalise(decay c + (1 - decay) mean), summed over DDP
            ranks and applied at the next training forward (or by ``apply_pending_updates``); the centroids then
            take no gradient. The losses collapse a head's centroids onto one cluster (70% of its keys, measured in
            the same section); the means of the points assigned to them cannot.
        centroid_decay: the EMA's decay with ``centroid_update="ema"``, in [0, 1) (0 replaces each centroid by
            its points' mean; a step's batch holds thousands of keys per head, so the means are steady and a
            short memory follows the keys as training moves them).
        query_clusters: with ``cluster_on="query-key"``, R >= 1: a query reads from each of its R nearest centroids'
            clusters a run of (look_back + 1) x chunk // R keys (the latest, or around its rank), so its reach is
            split over R clusters (Reformer's rounds, for the queries alone: a key stays in one cluster, so no key
            is read twice). 1 (default) is the nearest cluster alone.
        reach_split: with ``cluster_on="query-key"``, how a query's reach is shared over its R clusters. "equal"
            (default): reach // R keys from each. "fill": a cluster with fewer keys than its share (up to the
            query, under a causal mask) leaves the rest to the query's other clusters, by water-filling
            (:func:`clusterformer.ops.cluster_runs.cluster_runs`, ``split="fill"``): the query reads up to the
            whole reach over its clusters, where with equal shares a large cluster is cut at reach // R -- its
            oldest keys unread -- while a small one leaves its share unused
            (docs/recall-and-aggregation.md#queries-and-keys-assigned-apart measures both). Where the keys are
            gathered (CUDA, half precision, dropout: :func:`clusterformer.ops.cluster_runs.run_attention`) each of
            the R runs holds room for the whole reach, R times the memory of equal shares; the CPU kernel reads
            only each run's keys.
        head_clusters: with ``cluster_on="query-key"``, whose clusters a head reads. "own" (default): each head
            assigns its queries and keys to its own share of the centroids (k x head_dim), so a query's heads read
            different clusters, and one head may reach the key it needs where the other does not. "shared": one
            assignment per layer, as the paper's heads share one clustering: a token's query (key) is its heads'
            unit queries (keys) side by side, assigned to the nearest of the k x dim centroids by cosine (the sum
            of its heads' cosines to a centroid's head parts, over the centroid's norm), and every head reads the
            clusters so chosen. A head then reaches a key exactly when the others do
            (docs/recall-and-aggregation.md#queries-and-keys-assigned-apart: a key one head sees is answered
            less often than one both see). The EMA, the losses and ``train --centroid-init kmeans`` fit the k x dim
            centroids to the same side-by-side points.
        explore: beyond the paper: the probability that a training forward attends within random groups
            of the same size instead of the learned ones (drawn from the layer's generator; the clustering and its
            losses run as usual; evaluation and decoding always use the learned groups). A learned grouping that
            keeps a query apart from the key it needs gives the task no gradient to bring them together; random
            groups let them meet. 0 (default) is the paper.
        causal_assign: how strict causal mode assigns a token (beyond the paper). "nearest" (default):
            its nearest centroid, argmax_i phi(C_i, x_t W^C). "prefix": the paper's eq. 4 with eq. 2's normalisation
            over the positions so far, argmax_i (s_it - log sum_{j <= t} exp s_ij) with s = similarity_scale * phi:
            a token goes to the centroid it scores high on *relative to the earlier tokens*. In deep layers every
            token's P shares one dominant direction (its mean measured 24x longer than a token's deviation from it:
            docs/recall-and-aggregation.md#why-neural-clustering-does-not-recall), the nearest centroid is then the
            same for every token and a causal cluster's window becomes a recency window; the prefix normalisation
            removes what all tokens share, as eq. 2 does without a mask.
            Still strict causal and prefix invariant; cached decoding keeps k log-sum-exps per sequence.
        local_window: beyond the paper: 0 (off), or an even number of local keys every query also sees:
            positions are cut into blocks of ``local_window / 2`` and a query sees its block and the one before (up
            to itself under a causal mask), as well as its cluster's chunks. The two sets are joined, each key once,
            in one softmax (BigBird / NSA's window beside selected blocks; the Routing Transformer's local heads).
    """

    num_clusters: int | str = "sqrt"
    max_clusters: int = 128
    look_back: int = 1
    causal_mode: str = "strict"
    causal_clusters: int = 16
    causal_chunk_size: int = 16
    similarity: str = "cosine"
    similarity_scale: float = 10.0
    own_centroids: bool = True
    grouping: str = "learned"
    cluster_on: str = "hidden"
    causal_assign: str = "nearest"
    local_window: int = 0
    explore: float = 0.0
    centroid_fit: str = "queries-keys"
    query_clusters: int = 1
    centroid_update: str = "losses"
    centroid_decay: float = 0.95
    head_clusters: str = "own"
    reach_split: str = "equal"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_clusters != "sqrt":
            if isinstance(self.num_clusters, str):
                raise ValueError(f"num_clusters must be an int >= 1 or 'sqrt', got {self.num_clusters!r}")
            check_int("num_clusters", self.num_clusters, minimum=1)
        check_int("max_clusters", self.max_clusters, minimum=1)
        check_int("look_back", self.look_back, minimum=0)
        check_choice("causal_mode", self.causal_mode, ("strict", "paper"))
        check_int("causal_clusters", self.causal_clusters, minimum=1)
        check_int("causal_chunk_size", self.causal_chunk_size, minimum=1)
        check_choice("similarity", self.similarity, ("cosine", "dot"))
        check_float("similarity_scale", self.similarity_scale, minimum=0.0, exclusive_minimum=True)
        check_bool("own_centroids", self.own_centroids)
        check_choice("grouping", self.grouping, GROUPINGS)
        check_choice("cluster_on", self.cluster_on, CLUSTER_INPUTS)
        check_choice("causal_assign", self.causal_assign, CAUSAL_ASSIGNMENTS)
        check_float("explore", self.explore, minimum=0.0, maximum=1.0)
        if self.explore and self.grouping != "learned":
            raise ValueError(f"explore replaces learned groups by random ones in some training forwards; it needs "
                             f"grouping='learned', got grouping={self.grouping!r}")
        check_int("local_window", self.local_window, minimum=0)
        if self.local_window % 2:
            raise ValueError(f"local_window must be even (two blocks of local_window / 2), got {self.local_window}")
        check_choice("centroid_fit", self.centroid_fit, CENTROID_FITS)
        check_int("query_clusters", self.query_clusters, minimum=1)
        check_choice("centroid_update", self.centroid_update, CENTROID_UPDATES)
        check_float("centroid_decay", self.centroid_decay, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_choice("head_clusters", self.head_clusters, HEAD_CLUSTERS)
        check_choice("reach_split", self.reach_split, REACH_SPLITS)
        if self.cluster_on == "query-key":
            self._check_query_key()
        else:
            for name, value, default in (("centroid_fit", self.centroid_fit, "queries-keys"),
                                         ("query_clusters", self.query_clusters, 1),
                                         ("centroid_update", self.centroid_update, "losses"),
                                         ("head_clusters", self.head_clusters, "own"),
                                         ("reach_split", self.reach_split, "equal")):
                if value != default:
                    raise ValueError(f"{name}={value!r} needs cluster_on='query-key' (the other inputs cluster one "
                                     f"point per token, its query and key together), got cluster_on="
                                     f"{self.cluster_on!r}")

    def _check_query_key(self) -> None:
        """What cluster_on="query-key" does not combine with, each refused by name."""
        conflicts = {"grouping": (self.grouping, "learned"), "causal_mode": (self.causal_mode, "strict"),
                     "causal_assign": (self.causal_assign, "nearest"), "own_centroids": (self.own_centroids, True),
                     "local_window": (self.local_window, 0), "explore": (self.explore, 0.0)}
        for name, (value, allowed) in conflicts.items():
            if value != allowed:
                raise ValueError(f"{name}={value!r} does not combine with cluster_on='query-key' (which needs "
                                 f"{name}={allowed!r})")

    def cached_decoding(self) -> bool:
        """cluster_on="query-key" has no decoding cache (its keys are grouped apart from its queries)."""
        return self.cluster_on != "query-key"

    @property
    def n_centroids(self) -> int:
        """Centroids a layer owns: ``max_clusters`` with ``"sqrt"`` (the first k are used), else ``num_clusters``."""
        return self.max_clusters if self.num_clusters == "sqrt" else self.num_clusters

    def clusters_for(self, length: int) -> int:
        """k for a sequence of ``length`` real tokens (without a strict causal mask)."""
        if self.num_clusters == "sqrt":
            return max(1, min(self.max_clusters, round(math.sqrt(length))))
        return self.num_clusters

    def clusters_for_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """k for each sequence from its real length, (B,) long: round(sqrt(L_b)) clamped to [1, max_clusters]
        with "sqrt", else ``num_clusters``."""
        if self.num_clusters == "sqrt":
            k = torch.sqrt(lengths.to(torch.float64)).round().long()  # sqrt(L) is never exactly n + 1/2
            return k.clamp(min=1, max=self.max_clusters)
        return torch.full_like(lengths, self.num_clusters)

    def strict_causal_clusters(self) -> int:
        """k under a strict causal mask: independent of the length."""
        return min(self.causal_clusters, self.max_clusters) if self.num_clusters == "sqrt" else self.num_clusters

    def causal_semantics(self) -> str:
        return self.causal_mode

    def keys_read(self, length: int, causal: bool = False) -> int:
        """(look_back + 1) chunks of its cluster: chunks of ceil(N / k) (each chunk once, however few there are),
        or of ``causal_chunk_size`` under a strict causal mask (split into ``query_clusters`` equal runs, the
        remainder unread, one run per cluster when there are fewer clusters; with ``reach_split="fill"`` the whole
        reach over the runs); plus ``local_window``. Each mixed as read."""
        check_int("length", length, minimum=1)
        if causal and self.causal_mode == "strict":
            clusters = self.strict_causal_clusters()
            reach = (self.look_back + 1) * self.causal_chunk_size
        else:
            clusters = self.clusters_for(length)
            chunk = math.ceil(length / clusters)
            chunks = math.ceil(length / chunk)
            reach = (min(self.look_back, chunks - 1) + 1) * chunk
        # query_clusters: the reach split into a run from each of the query's clusters (as many as there are)
        runs = min(self.query_clusters, clusters)
        if self.reach_split == "equal":
            reach = runs * (reach // self.query_clusters)
        return min(length, reach + self.local_window)

    def for_budget(self, keys: int, length: int, causal: bool = False) -> dict[str, Any]:
        """The keys beyond ``local_window`` go to the clusters: strict causal, ``causal_chunk_size`` = (keys -
        local_window) // (look_back + 1); otherwise an int ``num_clusters`` = ceil(length / chunk) with chunk = (keys -
        local_window) // (look_back + 1), so that ceil(length / k) <= chunk."""
        check_int("keys", keys, minimum=1)
        check_int("length", length, minimum=1)
        chunk = (keys - self.local_window) // (self.look_back + 1)
        if chunk < 1:
            raise ValueError(f"keys={keys} leaves less than one key in each of the {self.look_back + 1} cluster chunks "
                             f"a query sees beside its local_window={self.local_window}")
        if causal and self.causal_mode == "strict":
            return {"causal_chunk_size": chunk}
        return {"num_clusters": math.ceil(length / chunk)}


@register(
    "neural-clustering",
    NeuralClusteringOptions,
    "ClusterFormer: learned centroids, sort by cluster, attention in equal chunks + look-back; O(N sqrt(N)) up to "
    "N = max_clusters^2 (16k tokens by default), O(N^2 / max_clusters) beyond",
)
class NeuralClusteringAttention(InnerAttention):
    """Clusters the hidden states (W^C x), so it implements :meth:`attend_hidden` (and, for cached decoding in
    strict causal mode, :meth:`prefill_hidden` and :meth:`step_hidden`)."""

    aux_losses = ("clustering", "centroid_sorting")
    decodes = True
    dense_warmup = True  # dense_training: every key in training forwards, the clustering and its losses as usual
    hidden_states = "neural-clustering clusters the hidden states (x W^C)"
    learned_centroids = True  # centroid_flow hands C_hat on; clustering_parameters() train at centroid_lr_scale

    def __init__(self, dim: int, heads: int, options: NeuralClusteringOptions) -> None:
        super().__init__(dim, heads, options)
        # cluster_on="shared-qk": the layer builds one projection for queries and keys, which is also what the
        # tokens are clustered by; there is no W^C
        self.shared_qk = options.cluster_on == "shared-qk"
        # cluster_on="query-key": queries and keys are clustered by their own projections, and there is no W^C
        self.query_key = options.cluster_on == "query-key"
        self.to_cluster = None if self.shared_qk or self.query_key else nn.Linear(dim, dim, bias=False)  # W^C
        if options.own_centroids:
            self.centroids = nn.Parameter(torch.randn(options.n_centroids, dim))  # C, random init as in the paper
            if options.centroid_update == "ema":  # they follow their points' means, never a gradient: no optimiser
                self.centroids.requires_grad_(False)  # step (weight decay included) and no DDP bucket may move them
        else:
            self.register_parameter("centroids", None)
        self._fit_keys: tuple[torch.Generator, Any] | None = None  # set by fitting_centroids()

    def clustering_parameters(self) -> list[nn.Parameter]:
        """The parameters that only the clustering uses: W^C and, when this layer owns them, the centroids C
        (``train --centroid-lr-scale`` gives them their own learning rate)."""
        return [*([self.to_cluster.weight] if self.to_cluster is not None else []),
                *([self.centroids] if self.centroids is not None else [])]

    def init_for_pretrained(self) -> None:
        """W^C = identity, so the clustering starts on the pretrained model's own hidden states; C ~ N(0, 1/dim)."""
        with torch.no_grad():
            if self.to_cluster is not None:
                self.to_cluster.weight.copy_(torch.eye(self.dim))
            if self.centroids is not None:
                self.centroids.normal_(0.0, self.dim ** -0.5)

    def attend_hidden(
        self, x: torch.Tensor, projection: QKVProjection, mask: AttentionMask = NO_MASK,
        flow: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, N, dim) -> (heads output (B, N, H, D), C_hat). ``flow``: optional (B, k, dim) or (k, dim)
        centroids replacing the layer's own (the paper's flow between layers); C_hat is what flows on."""
        count = self._count(x, mask)
        if self.query_key:
            if flow is not None:
                raise ValueError("cluster_on='query-key' keeps per-layer centroids: no centroids flow in")
            return self._attend_query_key(x, projection, mask, count), None
        ids, updated = self._assign(x, projection, mask, flow, count)
        publish_groups(self, ids)
        out = self._attend(x, projection, mask, ids, count, dense=self.dense_training and self.training)
        return out, updated

    def _count(self, x: torch.Tensor, mask: AttentionMask) -> ClusterCount:
        """Strict mode fixes k and the block size, so the outputs for a prefix do not change as tokens follow.
        Otherwise k and the chunk size follow each sequence's real length L_b (k_b = sqrt(L_b), w_b = ceil(L_b /
        k_b)), so padding and the other sequences of the batch cannot change them."""
        B, N, _ = x.shape
        if mask.causal and self.options.causal_mode == "strict":
            return ClusterCount(self.options.strict_causal_clusters(), True)
        if mask.padding is None:
            return ClusterCount(self.options.clusters_for(N), False)
        lengths = mask.lengths(B, N, x.device)
        per_sequence = self.options.clusters_for_lengths(lengths)
        return ClusterCount(int(per_sequence.max()) if B else 1, False, lengths, per_sequence)

    def _attend(self, x: torch.Tensor, projection: QKVProjection, mask: AttentionMask, ids: torch.Tensor,
                count: ClusterCount, *, dense: bool = False) -> torch.Tensor:
        """Chunked attention given the cluster ids (B, N): heads output (B, N, H, D). ``dense``: every key instead
        (``train --dense-warmup-steps``)."""
        B, N, _ = x.shape
        if B == 0 or N == 0:
            return projection.qkv(x)[0].transpose(1, 2)  # empty, with a graph
        if dense:
            return self._dense_attention(x, projection, mask)
        look_back = self.options.look_back
        if count.strict:
            layout = cluster_causal_layout(ids, self.options.causal_chunk_size, count.clusters + 1, look_back)
        elif count.lengths is None:
            layout = sorted_layout(ids, math.ceil(N / count.clusters), look_back)
        else:  # ceil(L_b / k_b); sorted_layout clamps it to >= 1
            chunk = (count.lengths + count.per_sequence - 1) // count.per_sequence
            layout = sorted_layout(ids, chunk, look_back, mask=mask)
        if self.options.local_window:
            out = self._with_local_window(x, projection, layout, count.strict, mask)
        else:
            out = self._chunk_attention(x, projection, layout, mask)
        heads = out.view(B, N, self.heads, self.head_dim)
        recipe = recipe_of(out)  # the output is a reorder the output projection can redo in its backward
        return heads if recipe is None else attach_recipe(heads, lambda: recipe().view(B, N, self.heads, self.head_dim))

    def _attend_query_key(self, x: torch.Tensor, projection: QKVProjection, mask: AttentionMask,
                          count: ClusterCount) -> torch.Tensor:
        """cluster_on="query-key" (the options' docstring): per head (or once for every head: ``head_clusters``),
        queries and keys to their nearest centroid apart, then each query's run of its cluster's keys in one fused
        call. (B, N, H, D)."""
        B, N, _ = x.shape
        H = self.heads
        q, k, v = projection.qkv(x)  # (B, H, N, D)
        if B == 0 or N == 0:
            return q.transpose(1, 2)
        n_clusters = count.clusters
        real = None if mask.padding is None else mask.real(B, N, x.device)
        q_points, k_points = self._assignment_points(q), self._assignment_points(k)  # (B, G, N, E)
        if self._fit_keys is not None:
            self._fit_centroids_to_keys(k_points, real, n_clusters)
        if self.updates_state():
            self.apply_pending_updates()
        centroids = self._centroid_groups(n_clusters)  # (G, k, E)
        unused = None  # (B, 1, 1, k): the centroids past each sequence's own k_b
        if count.per_sequence is not None:
            unused = (torch.arange(n_clusters, device=x.device) >= count.per_sequence.unsqueeze(1)).view(B, 1, 1, -1)
        runs = min(self.options.query_clusters, n_clusters)
        with torch.no_grad():
            query_ids = self._nearest_per_head(q_points, centroids, unused, runs)  # (B, G, N, R)
            key_ids = self._nearest_per_head(k_points, centroids, unused)
        if real is not None:  # padding keys past every cluster: never read
            key_ids = key_ids.masked_fill(~real.unsqueeze(1), n_clusters)
        publish_groups(self, key_ids[:, 0])  # head 0's key clusters (padding: id k), as the groups recorders want
        if self.options.centroid_update == "ema":
            if self.updates_state():
                self._follow_points(q_points, k_points, query_ids[..., 0], key_ids, real, n_clusters)
        else:
            self._query_key_losses(q_points, k_points, centroids, mask, count)
        query_ids, key_ids = query_ids.expand(B, H, N, runs), key_ids.expand(B, H, N)  # shared: every head's
        if self.dense_training and self.training:
            return self._dense_attention(x, projection, mask)
        if count.strict:
            width: int | torch.Tensor = (self.options.look_back + 1) * self.options.causal_chunk_size
        else:  # (look_back + 1) chunks of ceil(L / k), each chunk once however few there are, as keys_read counts
            lengths = torch.full((B,), N, device=x.device) if count.lengths is None else count.lengths
            per_sequence = (torch.full((B,), n_clusters, device=x.device) if count.per_sequence is None
                            else count.per_sequence)
            chunk = (lengths + per_sequence - 1) // per_sequence
            chunks = (lengths + chunk - 1) // chunk.clamp(min=1)
            width = ((chunks - 1).clamp(min=0, max=self.options.look_back) + 1) * chunk
        if self.options.reach_split == "equal":
            width, split = width // self.options.query_clusters, "each"  # per run, as keys_read counts
        else:
            split = "fill"  # over the query's runs together
        read = cluster_runs(query_ids, key_ids, width, causal=mask.causal, query_real=real, split=split)
        out = run_attention(q, k, v, read, dropout_p=self.dropout_p, mask=mask)
        return out.transpose(1, 2)  # (B, N, H, D)

    def _assignment_points(self, points: torch.Tensor) -> torch.Tensor:
        """What the query-key assignment compares with the centroids, (B, G, N, E): each head's queries or keys
        (B, H, N, D) as they are, or with ``head_clusters="shared"`` one point per token, its heads' unit vectors
        side by side (B, 1, N, H D)."""
        if self.options.head_clusters == "own":
            return points
        B, H, N, D = points.shape
        return F.normalize(points, dim=-1).transpose(1, 2).reshape(B, 1, N, H * D)

    def _centroid_groups(self, n_clusters: int) -> torch.Tensor:
        """The first ``n_clusters`` rows of the layer's k x dim centroids as the assignment uses them, (G, k, E): each
        head's share (H, k, D), or whole (1, k, dim) with ``head_clusters="shared"``. Rows of (G, k, E) go back
        to k x dim by ``.transpose(0, 1).reshape(k, dim)`` either way."""
        if self.options.head_clusters == "own":
            return self.centroids[:n_clusters].view(n_clusters, self.heads, self.head_dim).transpose(0, 1)
        return self.centroids[:n_clusters].unsqueeze(0)

    @torch.no_grad()
    def _fit_centroids_to_keys(self, k: torch.Tensor, real: torch.Tensor | None, n_clusters: int) -> None:
        """:func:`fitting_centroids`: the first ``n_clusters`` centroids <- each head's (or, shared, the layer's)
        spherical k-means of the real keys k (B, G, N, E) of this batch, as the assignment sees them (padding,
        ``real`` False, left out)."""
        generator, done = self._fit_keys
        E = k.shape[-1]
        keys = k.transpose(0, 1)  # (G, B, N, E)
        fitted = torch.stack([spherical_kmeans(group.reshape(-1, E) if real is None else group[real], n_clusters,
                                               generator=generator) for group in keys])  # (G, k, E), unit rows
        self.centroids[:n_clusters] = fitted.transpose(0, 1).reshape(n_clusters, -1).to(self.centroids.dtype)
        done()

    @torch.no_grad()
    def _follow_points(self, q: torch.Tensor, k: torch.Tensor, query_ids: torch.Tensor, key_ids: torch.Tensor,
                       real: torch.Tensor | None, n_clusters: int) -> None:
        """centroid_update="ema": keep pending each head's (or, shared, the layer's) online spherical k-means step
        over the unit points ``centroid_fit`` names (keys, or queries and keys: q, k (B, G, N, E) as assigned), each
        at its nearest centroid (query_ids, key_ids (B, G, N); padding left out), the per-centroid sums and counts
        summed over DDP ranks first."""
        B, G, _, E = k.shape
        sets = [(k, key_ids)] if self.options.centroid_fit == "keys" else [(q, query_ids), (k, key_ids)]
        points = torch.cat([p for p, _ in sets], dim=2).transpose(0, 1).reshape(G, -1, E)  # (G, B S N, E)
        ids = torch.cat([i.clamp(max=n_clusters - 1) for _, i in sets], dim=2)  # padding's id k, left out below
        valid = None if real is None else real.repeat(1, len(sets)).unsqueeze(0).expand(G, B, -1).reshape(G, -1)
        dtype = torch.promote_types(k.dtype, torch.float32)  # at least float32 under autocast, as the assignment
        current = F.normalize(self._centroid_groups(n_clusters).to(dtype), dim=-1)
        moved = ema_centroid_update(current, points, ids.transpose(0, 1).reshape(G, -1),
                                    decay=self.options.centroid_decay, valid=valid, reduce=all_reduce_sum)  # (G, k, E)
        updated = self.centroids.detach().clone()
        updated[:n_clusters] = moved.transpose(0, 1).reshape(n_clusters, -1).to(updated.dtype)
        self.pending["centroids"] = updated

    def _nearest_per_head(self, points: torch.Tensor, centroids: torch.Tensor, unused: torch.Tensor | None,
                          top: int | None = None) -> torch.Tensor:
        """points (B, G, N, E), centroids (G, k, E) (each head's, or the layer's: :meth:`_assignment_points`) ->
        each point's nearest centroid of its group, (B, G, N) long, or with ``top`` its ``top`` nearest, best first,
        (B, G, N, top) (cosine or dot, as ``similarity``; a centroid
        in ``unused`` is never chosen before a used one), scored as the clustering scores
        (:func:`clusterformer.clustering.neural.assignment_scores`: at least float32, outside autocast)."""
        scores = assignment_scores(points, centroids, self.options.similarity, scale=1.0)
        if unused is not None:
            scores = scores.masked_fill(unused, float("-inf"))
        return scores.argmax(-1) if top is None else scores.topk(top, dim=-1).indices

    def _query_key_losses(self, q: torch.Tensor, k: torch.Tensor, centroids: torch.Tensor, mask: AttentionMask,
                          count: ClusterCount) -> None:
        """The paper's two losses (eqs. 6, 11), each head's (or, shared, the layer's) centroids over its detached
        queries and keys together (or its keys alone: ``centroid_fit``), q, k (B, G, N, E) as assigned: they move
        the centroids to where those points are, not the projections (the task trains those)."""
        B, G, N, E = q.shape
        sets = [k] if self.options.centroid_fit == "keys" else [q, k]
        points = torch.cat(sets, dim=2).detach().reshape(B * G, len(sets) * N, E)
        per_sequence = None if count.per_sequence is None else count.per_sequence.repeat_interleave(G)
        clustering = neural_clustering(points, centroids.repeat(B, 1, 1), mask=mask.point_sets(G, len(sets)),
                                       similarity=self.options.similarity, scale=self.options.similarity_scale,
                                       assign="nearest", num_clusters=per_sequence)
        publish_losses({"clustering": clustering.clustering_loss, "centroid_sorting": clustering.sorting_loss})

    def _dense_attention(self, x: torch.Tensor, projection: QKVProjection, mask: AttentionMask) -> torch.Tensor:
        """Every real key (every earlier one under a causal ``mask``; with shared QK unit keys and the token's own
        key only when it has no other), one SDPA call with a boolean mask: (B, N, H, D). A query without keys gets 0."""
        B, N, _ = x.shape
        q, k, v = projection.qkv(x)  # (B, H, N, D)
        allowed = mask.allowed(N, N, q.device)
        if self.shared_qk:
            allowed = self_only_when_alone(allowed.expand(B, 1, N, N), torch.eye(N, dtype=torch.bool, device=x.device))
        return masked_sdpa(q, self._keys(k), v, allowed, dropout_p=self.dropout_p).transpose(1, 2)

    def _with_local_window(self, x: torch.Tensor, projection: QKVProjection, layout: ChunkLayout, strict: bool,
                           mask: AttentionMask) -> torch.Tensor:
        """The cluster chunks joined with the local blocks (``local_window``), each key once, in one softmax:
        the cluster part leaves out the keys of the query's local blocks, the local part has only them, and the
        two are merged by their log-sum-exps. (B * N, H, head_dim)."""
        block = self.options.local_window // 2
        B, N, _ = x.shape
        position = torch.zeros(B, N, dtype=torch.long, device=x.device)  # one group: blocks of the original order
        # blocks of positions; without a strict mask padding is included (and masked as keys), so that padding
        # inside a sequence does not shift them
        local = cluster_causal_layout(position, block, 1, 1) if strict else sorted_layout(position, block, 1)
        out_c, lse_c = self._chunk_attention(x, projection, layout, mask, local=(block, False))
        out_l, lse_l = self._chunk_attention(x, projection, local, mask, local=(block, True))
        if self.shared_qk:
            # The shared-QK rule over the union: the token's own key is in its local part (which keeps it only
            # where it has no other local key); drop it there too when the cluster part has keys.
            alone = ~_local_has_other(B, N, block, mask, x.device)
            lse_l = lse_l.masked_fill(alone.unsqueeze(1) & torch.isfinite(lse_c), float("-inf"))
        return merge_attention(out_c, lse_c, out_l, lse_l)

    def _assign(self, x: torch.Tensor, projection: QKVProjection, mask: AttentionMask,
                flow: torch.Tensor | None, count: ClusterCount) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cluster ids (B, N) (padding: count.clusters) and C_hat (or None); publishes the clustering losses."""
        B, N, _ = x.shape
        n_clusters, per_sequence, strict = count.clusters, count.per_sequence, count.strict
        positions = torch.arange(N, device=x.device).unsqueeze(0)
        if self.options.grouping != "learned":  # the ablations: one group (original order), or random groups
            return self._fixed_groups(self.options.grouping, positions, count, B, mask), None
        points = self._cluster_input(x, projection)
        if self.shared_qk:  # the losses move the centroids, not the attention's keys (see the module docstring)
            points = points.detach()
        clustering = neural_clustering(
            points, self._centroids(flow, n_clusters, B, strict),
            mask=mask,
            similarity=self.options.similarity, scale=self.options.similarity_scale,
            assign=self.options.causal_assign if strict else "subordinate", num_clusters=per_sequence,
        )
        publish_losses({"clustering": clustering.clustering_loss, "centroid_sorting": clustering.sorting_loss})
        if self.options.explore and self.training and bool(
                torch.rand((), generator=self.draw_generator()) < self.options.explore):
            # exploration: this forward attends within random groups of the same size (the clustering and its
            # losses as usual), so queries meet keys the learned clusters keep apart and the task trains q . k there
            return self._fixed_groups("random", positions, count, B, mask), clustering.updated_centroids
        return clustering.assignments, clustering.updated_centroids

    # cached decoding (strict causal mode): per cluster, a ring of its last (look_back + 1) * causal_chunk_size
    # keys and values (clusterformer.ops.decode.GroupRingCache); a step costs O((look_back + 1) w) per head,
    # whatever the context length, and so does the cache's memory.
    def prefill_hidden(self, x: torch.Tensor, projection: QKVProjection, mask: AttentionMask
                       ) -> tuple[torch.Tensor, GroupRingCache]:
        self.check_decoding()
        check_prompt_mask(mask)
        B, N, _ = x.shape
        count = ClusterCount(self.options.strict_causal_clusters(), True)
        n_clusters = count.clusters
        ids, _ = self._assign(x, projection, mask, None, count)
        publish_groups(self, ids)
        out = self._attend(x, projection, mask, ids, count)
        rows = x.reshape(B * N, self.dim)
        k = self._keys(projection.project_rows(rows, "k")).view(B, 1, N, self.heads, self.head_dim)
        v = projection.project_rows(rows, "v").view(B, 1, N, self.heads, self.head_dim)
        cache = GroupRingCache.from_prompt(ids.unsqueeze(1), k, v, mask, n_clusters,
                                           self.options.causal_chunk_size, self.options.look_back)
        local = assign_lse = None
        if self.options.local_window:
            local = LocalBlockCache.from_prompt(k[:, 0], v[:, 0], ids, mask, self.options.local_window // 2)
        if self._prefix_assign:  # each centroid's log-sum-exp over the prompt's real tokens, (B, k)
            scores = self._assignment_scores(x, projection)
            if mask.padding is not None:
                scores = scores.masked_fill(mask.padding.unsqueeze(-1), float("-inf"))
            assign_lse = torch.logsumexp(scores, dim=1)
        if local is None and assign_lse is None:
            return out, cache
        return out, JoinedCache(cache.lengths.clone(), cache, local, assign_lse)

    def step_hidden(self, x_t: torch.Tensor, projection: QKVProjection, cache: GroupRingCache | JoinedCache
                    ) -> tuple[torch.Tensor, GroupRingCache | JoinedCache]:
        self.check_decoding()
        B = x_t.shape[0]
        joined = cache if isinstance(cache, JoinedCache) else None
        if joined is not None:
            cache = joined.groups
        if self.options.grouping != "learned":  # as the forward groups the token at this position
            count = ClusterCount(self.options.strict_causal_clusters(), True)
            ids = self._fixed_groups(self.options.grouping, cache.lengths.unsqueeze(1), count, B)
        elif self._prefix_assign:  # ranked against the log-sum-exps of the earlier tokens, as the forward does
            ids, assign_lse = prefix_assignment_step(self._assignment_scores(x_t, projection), joined.assign_lse)
            joined.assign_lse.copy_(assign_lse)  # in place, as every cache update (CUDA graphs of the step)
            ids = ids.unsqueeze(1)
        else:  # the token's nearest centroid, as the strict forward assigns it
            centroids = self._centroids(None, self.options.strict_causal_clusters(), B, True)
            ids = nearest_centroid(self._cluster_input(x_t, projection), centroids,
                                   self.options.similarity).unsqueeze(1)
        q, k, v = projection.qkv(x_t.unsqueeze(1))  # (B, H, 1, D)
        k = self._keys(k)
        rank = cache.counts[torch.arange(B, device=ids.device), 0, ids[:, 0]]  # earlier members of its cluster
        keys, values, allowed, own = cache.append(ids, k.transpose(1, 2), v.transpose(1, 2))  # (B, 1, S, H, D)
        local = joined.local if joined is not None else None
        if local is not None:  # the local blocks, less the keys its cluster window holds (the token itself too)
            w = self.options.causal_chunk_size
            first = (torch.div(rank, w, rounding_mode="floor") - self.options.look_back) * w  # its cluster window
            out_l, lse_l = local.append_and_attend(q[:, :, 0], k[:, :, 0], v[:, :, 0], ids[:, 0], rank, first)
        if self.shared_qk:  # its own key only when it has no other, in either part
            others = allowed & (torch.arange(cache.slots, device=own.device) != own.unsqueeze(-1))
            alone = ~others.any(-1, keepdim=True)
            if local is not None:
                alone = alone & ~torch.isfinite(lse_l[:, :1]).unsqueeze(-1)
            allowed = torch.where(alone, allowed, others)
        out, lse = attend_allowed(q[:, :, 0], keys[:, 0].transpose(1, 2), values[:, 0].transpose(1, 2),
                                  allowed.expand(B, self.heads, -1), self.head_dim ** -0.5)
        if joined is None:
            return out, cache
        joined.lengths = cache.lengths
        return (out if local is None else merge_attention(out, lse, out_l, lse_l)), joined

    @property
    def _prefix_assign(self) -> bool:
        """Whether strict causal mode assigns by ``causal_assign="prefix"`` (learned groups only)."""
        return self.options.causal_assign == "prefix" and self.options.grouping == "learned"

    def _assignment_scores(self, x: torch.Tensor, projection: QKVProjection) -> torch.Tensor:
        """s = similarity_scale * phi(C_i, P): (..., k) for x (..., dim), as the strict forward scores the tokens."""
        centroids = self._centroids(None, self.options.strict_causal_clusters(), x.shape[0], True)
        return assignment_scores(self._cluster_input(x, projection), centroids, self.options.similarity,
                                 self.options.similarity_scale)

    def _keys(self, k: torch.Tensor) -> torch.Tensor:
        """Keys as attention uses them: with shared QK unit vectors per head (Reformer section 2), so that a token's
        own key does not win by its length; (..., H * D) or (..., D) as given."""
        if not self.shared_qk:
            return k
        if k.shape[-1] == self.dim:
            return F.normalize(k.unflatten(-1, (self.heads, self.head_dim)), dim=-1).flatten(-2)
        return F.normalize(k, dim=-1)

    def _cluster_input(self, x: torch.Tensor, projection: QKVProjection) -> torch.Tensor:
        """P (..., dim): x W^C, or with ``cluster_on="shared-qk"`` the layer's shared query/key projection x W^QK
        (the heads side by side: one cluster id per token, shared by the heads)."""
        if not self.shared_qk:
            return self.to_cluster(x)
        if not getattr(projection, "shared_qk", False):
            raise ValueError("neural-clustering with cluster_on='shared-qk' needs a layer whose queries and keys are "
                             "one projection (AttentionLayer); this projection has separate query and key weights "
                             "(hf.patch of a pretrained model): use cluster_on='hidden'")
        return projection.project_rows(x.reshape(-1, self.dim), "k").view(*x.shape[:-1], self.dim)

    def _fixed_groups(self, grouping: str, positions: torch.Tensor, count: ClusterCount, batch: int,
                      mask: AttentionMask = NO_MASK) -> torch.Tensor:
        """The ids of an ablation grouping (or exploration's random groups) for the tokens at ``positions``
        (1 or B, N), for the forward and the decoding step alike: k_b from ``count``, padding marked as the
        clustering marks it (id ``count.clusters``). (batch, N) long."""
        if count.per_sequence is None:
            k = torch.full((batch,), count.clusters, dtype=torch.long, device=positions.device)
        else:
            k = count.per_sequence.to(positions.device)
        ids = self._ablation_groups(positions, k, grouping)
        return ids if mask.padding is None else ids.masked_fill(mask.padding, count.clusters)

    def _ablation_groups(self, positions: torch.Tensor, num_clusters: torch.Tensor, grouping: str) -> torch.Tensor:
        """The ids of the ablation ``grouping`` for tokens at ``positions`` (1 or B, N) long, with k_b =
        ``num_clusters`` (B,): "contiguous", every token in group 0; "random", the hash of the position and one
        number drawn from the layer's generator (:func:`random_groups`). (B, N) long, on ``positions``' device."""
        B, N = num_clusters.shape[0], positions.shape[1]
        if grouping == "contiguous":
            return torch.zeros(B, N, dtype=torch.long, device=positions.device)
        draw = int(torch.randint(0, 2**30, (1,), generator=self.draw_generator()))
        return _hash_groups(positions, num_clusters.to(positions.device), draw)

    def _centroids(self, flow: torch.Tensor | None, n_clusters: int, B: int, strict: bool) -> torch.Tensor:
        if flow is None:
            if self.centroids is None:
                raise ValueError("centroids must flow in from a previous layer: this layer was built with "
                                 "own_centroids=False")
            return self.centroids[:n_clusters]
        if strict:
            raise ValueError(
                "centroids from another layer depend on the whole sequence and would leak future "
                "tokens under causal_mode='strict'; use per-layer centroids or causal_mode='paper'"
            )
        if flow.dim() not in (2, 3) or flow.shape[-1] != self.dim or flow.shape[-2] != n_clusters or (
            flow.dim() == 3 and flow.shape[0] != B
        ):
            raise ValueError(
                f"centroids must have shape (k, dim) or (B, k, dim) with k={n_clusters}, dim={self.dim}, "
                f"B={B}; got {tuple(flow.shape)}"
            )
        return flow

    def _chunk_attention(self, x: torch.Tensor, projection: QKVProjection, layout: ChunkLayout, mask: AttentionMask,
                         local: tuple[int, bool] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, N, dim) -> (B * N, H, head_dim), or with ``local`` (block, keep) also each query's log-sum-exp
        (B * N, H) over the keys allowed by :func:`clusterformer.masks.local_blocks` (``keep``) or by its
        negation. Sorting x once and projecting in sorted order moves one (N, dim) tensor instead of three
        (H, N, head_dim) ones, and the key windows are views."""
        H, D = self.heads, self.head_dim
        x_rows = x.reshape(-1, self.dim).index_select(0, layout.rows)  # (R, dim) in buffer order
        # The projections' backward needs the sorted rows: gather them again from x then instead of keeping a copy.
        # Only the projections in the block: every tensor saved inside passes through the hooks, and an op that
        # saves its own output there (a norm, a softmax) would make a reference cycle that outlives the graph.
        with recompute_saved(x_rows, lambda: x.reshape(-1, self.dim).index_select(0, layout.rows)):
            q = projection.project_rows(layout.query_rows(x_rows), "q")
            k = projection.project_rows(x_rows, "k")
            v = projection.project_rows(x_rows, "v")
        q = q.view(layout.num_windows, layout.chunk_size, H, D).transpose(1, 2)
        k = self._keys(k.view(-1, H, D))
        v = v.view(-1, H, D)
        if local is not None or self.shared_qk:  # explicit scores: the local predicate, the shared-QK self rule
            out, lse = windowed_attention_lse(q, k, v, layout, mask=mask, dropout_p=self.dropout_p, local=local,
                                              exclude_self=self.shared_qk)
            return (out, lse) if local is not None else out
        return windowed_attention(q, k, v, layout, mask=mask, dropout_p=self.dropout_p, with_recipe=True)

    def extra_repr(self) -> str:
        o = self.options
        return (f"num_clusters={o.num_clusters!r}, look_back={o.look_back}, causal_mode={o.causal_mode!r}, "
                f"similarity={o.similarity!r}")


@contextmanager
def fitting_centroids(model: nn.Module, generator: torch.Generator) -> Iterator[list[str]]:
    """Within this context, each forward of a ``cluster_on="query-key"`` layer of ``model`` first sets the centroids
    it uses to the spherical k-means of its real keys, per head (:func:`clusterformer.clustering.kmeans.
    spherical_kmeans`, k-means++ seeds drawn from ``generator``), then attends with them; so one no-grad forward of
    the model over a batch fits each layer on the keys that the layers before it, already fitted, produce. ``train
    --centroid-init kmeans`` runs it on the first step's batch. Yields the names of the fitted layers, filled in as
    they run. ``ValueError`` when the model has no such layer."""
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, NeuralClusteringAttention) and m.query_key and m.centroids is not None}
    if not layers:
        raise ValueError("centroid_init='kmeans' (fitting centroids to the keys) needs neural-clustering layers "
                         "with cluster_on='query-key' and their own centroids; this model has none")
    fitted: list[str] = []
    for name, layer in layers.items():
        layer._fit_keys = (generator, lambda name=name: fitted.append(name))
    try:
        yield fitted
    finally:
        for layer in layers.values():
            layer._fit_keys = None
