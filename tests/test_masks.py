"""The typed mask (clusterformer.masks.AttentionMask) against a reference written entry by entry from its
definition: query i of Lq sits at position n - Lq + i; it may see key j when j is a real token, j <= its position
(causal), and j is in its window ((t - w, t] causal, [t - w // 2, t + w - w // 2) otherwise). The dense tensor,
the FlexAttention ``mask_mod`` and the flat-row predicate must each agree with it, and reading a dense mask back
(``from_allowed``, the Hugging Face path's one flip) must recover the structure or refuse the pattern."""

from __future__ import annotations

import itertools

import pytest
import torch

from clusterformer.attention import build, names
from clusterformer.attention.registry import can_decode, causal_semantics
from clusterformer.masks import AttentionMask
from seeds import fixed_seed


def reference(padding: torch.Tensor | None, causal: bool, window: int | None, q_len: int, kv_len: int,
              batch: int) -> torch.Tensor:
    """(batch, q_len, kv_len) bool, one entry at a time."""
    out = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    for b, i, j in itertools.product(range(batch), range(q_len), range(kv_len)):
        t = kv_len - q_len + i
        ok = padding is None or not bool(padding[b, j])
        if causal:
            ok = ok and j <= t
        if window is not None:
            low, high = (t - window + 1, t + 1) if causal else (t - window // 2, t + window - window // 2)
            ok = ok and low <= j < high
        out[b, i, j] = ok
    return out


CASES = [(q_len, kv_len, causal, window, padded)
         for q_len, kv_len in [(1, 1), (1, 7), (5, 5), (3, 11), (13, 13)]
         for causal in (False, True) for window in (None, 1, 4, 5) for padded in (False, True)]


def _padding(batch: int, kv_len: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(fixed_seed())
    padding = torch.rand(batch, kv_len, generator=generator) < 0.3
    padding[0] = False  # a sequence without padding beside the others
    padding[-1] = True  # and one of padding only
    return padding


@pytest.mark.parametrize("q_len, kv_len, causal, window, padded", CASES)
def test_allowed_matches_the_definition(q_len, kv_len, causal, window, padded):
    batch = 3
    padding = _padding(batch, kv_len) if padded else None
    mask = AttentionMask(padding, causal, window)
    got = mask.allowed(q_len, kv_len, torch.device("cpu"))
    assert got.dim() == 4 and got.shape[1] == 1 and got.shape[-1] == kv_len
    want = reference(padding, causal, window, q_len, kv_len, batch)
    assert torch.equal(got[:, 0].expand(batch, q_len, kv_len), want)


@pytest.mark.parametrize("q_len, kv_len, causal, window, padded", CASES[::3])
def test_mask_mod_is_the_same_predicate(q_len, kv_len, causal, window, padded):
    """FlexAttention's own mask builder (pure PyTorch, vmap over the grid) reads the same mask from mask_mod."""
    create_mask = pytest.importorskip("torch.nn.attention.flex_attention").create_mask
    batch = 3
    padding = _padding(batch, kv_len) if padded else None
    mask = AttentionMask(padding, causal, window)
    got = create_mask(mask.mask_mod(q_len, kv_len), batch if padded else None, None, q_len, kv_len, device="cpu")
    want = reference(padding, causal, window, q_len, kv_len, batch)
    assert torch.equal(got[:, 0].expand(batch, q_len, kv_len), want)


@pytest.mark.parametrize("q_len, kv_len", [(1, 6), (4, 4), (3, 9), (9, 9)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_from_allowed_reads_back_padding_and_causal(q_len, kv_len, causal, padded):
    batch = 3
    padding = _padding(batch, kv_len) if padded else None
    dense = reference(padding, causal, None, q_len, kv_len, batch)
    mask = AttentionMask.from_allowed(dense)
    assert mask.window is None
    # what it read describes the same mask (a causal mask over one query is read as not causal: the same keys)
    assert torch.equal(mask.allowed(q_len, kv_len, torch.device("cpu"))[:, 0].expand_as(dense), dense)
    if q_len > 1 and not (padded and causal):  # with padding, some causal patterns are also padding-only
        assert mask.causal == causal
    if not padded:
        assert mask.padding is None


def test_from_allowed_refuses_other_patterns():
    sliding = reference(None, True, 3, 8, 8, 2)
    with pytest.raises(ValueError, match="neither key padding nor key padding \\+ causal"):
        AttentionMask.from_allowed(sliding)
    packed = torch.zeros(1, 6, 6, dtype=torch.bool)
    packed[0, :3, :3] = packed[0, 3:, 3:] = True  # two documents in one row
    with pytest.raises(ValueError, match="neither"):
        AttentionMask.from_allowed(packed)
    with pytest.raises(ValueError, match="allowed must be a \\(B, Lq, n\\) bool tensor"):
        AttentionMask.from_allowed(torch.ones(2, 3, 3))


def test_bad_fields_raise_naming_them():
    with pytest.raises(ValueError, match="padding must be a \\(B, n\\) bool tensor"):
        AttentionMask(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="padding must be"):
        AttentionMask(torch.zeros(2, 3, 4, dtype=torch.bool))
    for window in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            AttentionMask(None, True, window)
    with pytest.raises(ValueError, match="padding covers 5 keys; the mask asks for 6"):
        AttentionMask(torch.zeros(1, 5, dtype=torch.bool)).allowed(2, 6, torch.device("cpu"))
    with pytest.raises(ValueError, match="positions are needed"):
        AttentionMask(None, True).predicate(torch.ones(4, dtype=torch.bool), None)


# ------------------------------------------------------------------------ one mask from the layer to the ops
# Every registered mechanism, and variants that take other paths to the ops (local windows, shared QK, the banded
# selection kernel), at sizes where the sparse structure bites.
WALKS = {name: (name, {}) for name in names()}
WALKS.update({
    "improved-clustered+dense-topk": ("improved-clustered", {"num_clusters": 3, "topk": 8}),
    "improved-clustered+chunked-topk": ("improved-clustered", {"num_clusters": 3, "topk": 2}),
    "lsh+chunks": ("lsh", {"chunk_size": 8}),
    "kmeans+chunks": ("kmeans", {"chunk_size": 8}),
    "routing+chunks": ("routing", {"chunk_size": 8}),
    "sliding-window+small": ("sliding-window", {"window": 8, "stride": 4}),
    "cluster-former+small": ("cluster-former", {"window": 8, "stride": 4}),
    "neural-clustering+local_window": ("neural-clustering", {"num_clusters": 3, "local_window": 4}),
    "neural-clustering+shared-qk": ("neural-clustering", {"num_clusters": 3, "cluster_on": "shared-qk",
                                                          "local_window": 2}),
    "neural-clustering+query-key": ("neural-clustering", {"num_clusters": 3, "cluster_on": "query-key"}),
    "neural-clustering+query-key+2-clusters": ("neural-clustering", {"num_clusters": 3, "cluster_on": "query-key",
                                                                     "query_clusters": 2}),
    "neural-clustering+query-key+shared-heads": ("neural-clustering", {"num_clusters": 3, "cluster_on": "query-key",
                                                                       "query_clusters": 2, "head_clusters": "shared"}),
    "cluster-select+banded": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2, "window": 4,
                                                 "summaries": True, "selection": "summaries", "kernel": "banded"}),
    "cluster-select+dense-mask": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2, "window": 4,
                                                     "kernel": "dense-mask"}),
    "cluster-select+gather-members": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2,
                                                         "window": 4, "summaries": False, "members": "score",
                                                         "kernel": "gather"}),
})
MASK_READS = ("allowed", "rows", "predicate", "real", "lengths", "block_padding", "repeats", "mask_mod")
# masks derived from the layer's one mask (a block of a prompt read in blocks; per-head point sets to cluster)
MASK_VIEWS = ("packed_prefix", "point_sets")


def _walk(monkeypatch: pytest.MonkeyPatch
          ) -> tuple[list[AttentionMask], list[AttentionMask], list[tuple[AttentionMask, AttentionMask]]]:
    """Spy on the typed mask: (every AttentionMask built, the mask of every read of a form from it, every
    (mask, view) that a view method derived from a mask)."""
    built: list[AttentionMask] = []
    read: list[AttentionMask] = []
    views: list[tuple[AttentionMask, AttentionMask]] = []
    post_init = AttentionMask.__post_init__

    def counted(self: AttentionMask) -> None:
        post_init(self)
        built.append(self)

    def spied(form):
        def reading(self: AttentionMask, *args, **kwargs):
            read.append(self)
            return form(self, *args, **kwargs)

        return reading

    def viewed(view):
        def deriving(self: AttentionMask, *args, **kwargs):
            derived = view(self, *args, **kwargs)
            views.append((self, derived))
            return derived

        return deriving

    monkeypatch.setattr(AttentionMask, "__post_init__", counted)
    for method in MASK_READS:
        monkeypatch.setattr(AttentionMask, method, spied(getattr(AttentionMask, method)))
    for method in MASK_VIEWS:
        monkeypatch.setattr(AttentionMask, method, viewed(getattr(AttentionMask, method)))
    return built, read, views


def _from_the_entry(built: list[AttentionMask], read: list[AttentionMask],
                    views: list[tuple[AttentionMask, AttentionMask]]) -> bool:
    """Every mask but the first was derived by a view method from the first (or from a mask derived so), and
    every form was read from one of these."""
    reached = [built[0]]
    for source, derived in views:
        if any(source is mask for mask in reached):
            reached.append(derived)
    return (all(any(mask is m for m in reached) for mask in built)
            and all(any(mask is m for m in reached) for mask in read))


@pytest.mark.parametrize("label", sorted(WALKS))
@pytest.mark.parametrize("causal", [False, True])
def test_one_mask_per_layer_call_reaches_the_ops_never_rebuilt(label, causal, monkeypatch):
    """A walk of the mask from the layer's entry to the ops: one layer call with padding (forward and backward; a
    prefill too where the mechanism decodes) builds exactly one AttentionMask, and every form the mechanism and its
    ops read (dense, row tables, predicates, lengths, real tokens) comes from that one object, or from a view of it
    that one of its methods derives (each block of a prompt read in blocks)."""
    name, options = WALKS[label]
    if causal and causal_semantics(name, options) == "refused":
        pytest.skip("the mechanism refuses causal=True")
    g = torch.Generator().manual_seed(fixed_seed())
    layer = build(name, dim=16, heads=2, **options).double()
    x = torch.randn(3, 37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(3, 37, dtype=torch.bool)
    pad[1, 25:] = True  # right padding
    pad[2] = True  # padding only
    built, read, views = _walk(monkeypatch)
    layer(x, key_padding_mask=pad, causal=causal).sum().backward()
    assert len(built) == 1 + len(views), f"{label}: {len(built)} masks built in one layer call"
    assert read, f"{label}: no form was read from the layer's mask"
    assert _from_the_entry(built, read, views), f"{label}: a form was read from a rebuilt mask"
    if causal and can_decode(name, options):
        layer.eval()
        built.clear()
        read.clear()
        views.clear()
        with torch.no_grad():
            layer.prefill(x, pad)
        assert len(built) == 1 + len(views) and _from_the_entry(built, read, views), \
            f"{label}: the prefill rebuilt its mask"


@pytest.mark.parametrize("name, options", [
    ("sink-window", {"budget": 6, "sink": 1, "prefill_block": 8}),
    ("cluster-retrieval", {"budget": 10, "sink": 1, "window": 4, "num_clusters": 2, "prefill_block": 8}),
])
def test_a_prefill_in_blocks_derives_each_block_mask_from_the_call_mask(name, options, monkeypatch):
    """A cache read of a padded prompt in blocks (``prefill_block``) reads every form from the call's one mask or
    from its views (each block's mask: :meth:`AttentionMask.packed_prefix`), builds no other mask, and its block
    masks are the call's padding in each sequence's own token order up to the block's end."""
    g = torch.Generator().manual_seed(fixed_seed())
    inner = build(name, dim=16, heads=2, **options).inner.double()
    q, k, v = (torch.randn(3, 2, 37, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(3, 37, dtype=torch.bool)
    pad[0, :6] = True  # left padding, as generate() batches prompts
    pad[1, 25:] = True  # right padding
    pad[2] = True  # padding only
    mask = AttentionMask(pad, causal=True)
    built, read, views = _walk(monkeypatch)
    with torch.no_grad():
        inner.attend_cache(q, k, v, mask, 8 ** -0.5)
    assert views, f"{name}: no block mask was derived: the prefill was not read in blocks"
    assert len(built) == len(views) and _from_the_entry([mask, *built], read, views), \
        f"{name}: a block's mask was built from raw tensors"
    lengths = (~pad).sum(1, keepdim=True)
    for source, derived in views:
        end = derived.padding.shape[1]
        assert source is mask and derived.causal
        assert torch.equal(derived.padding, torch.arange(end) >= lengths)


@pytest.mark.parametrize("repeat", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_row_tables_of_repeated_blocks_read_each_sequence_padding(repeat, causal):
    """``rows(..., repeat)`` and ``block_padding(repeat)``: blocks b * repeat .. b * repeat + repeat - 1 (a sequence's
    heads, or heads and rounds) read sequence b's padding, as an expanded (B * repeat, n) padding would."""
    g = torch.Generator().manual_seed(fixed_seed())
    B, n = 3, 7
    padding = torch.rand(B, n, generator=g) < 0.4
    mask = AttentionMask(padding, causal)
    expanded = padding.repeat_interleave(repeat, 0)
    assert torch.equal(mask.block_padding(repeat), expanded)
    rows = torch.randint(0, B * repeat * n, (50,), generator=g)
    valid = torch.rand(50, generator=g) < 0.8
    real, positions = mask.rows(rows, n, valid, repeat)
    assert torch.equal(real, valid & ~expanded.reshape(-1)[rows])
    assert positions is None if not causal else torch.equal(positions, rows % n)
    assert mask.repeats(B * repeat) == repeat
    with pytest.raises(ValueError, match="mask's padding covers 3 sequences"):
        mask.repeats(B * repeat + 1)


def test_ops_take_the_mask_object_and_name_it_in_errors():
    from clusterformer.ops import cluster_causal_attention, sorted_chunk_attention

    q = torch.randn(2, 1, 6, 4)
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="mask must be an AttentionMask"):
        sorted_chunk_attention(q, q, q, ids, 2, mask=torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask's padding must have shape \(batch, length\) = \(2, 6\)"):
        sorted_chunk_attention(q, q, q, ids, 2, mask=AttentionMask(torch.zeros(2, 5, dtype=torch.bool)))
    with pytest.raises(ValueError, match="mask must be causal"):
        cluster_causal_attention(q, q, q, ids, 2, 1, mask=AttentionMask(torch.zeros(2, 6, dtype=torch.bool)))
    no_mask = cluster_causal_attention(q, q, q, ids, 2, 1)  # no mask: causal order alone
    assert torch.equal(no_mask, cluster_causal_attention(q, q, q, ids, 2, 1, mask=AttentionMask(causal=True)))
