"""The Neural Clustering Method (ClusterFormer paper, section 3.1, eqs. 2-6 and 11).

Functional and batched, so the same code serves the attention layer and the stand-alone clusterer of
paper appendix A (:mod:`clusterformer.apps.clustering`).

Similarity. The paper's phi is a raw inner product. Eq. 6 then rewards making vectors *longer*
(L1 = -mean <X_j, C_hat> is unbounded below), and the softmax of eq. 2 saturates as norms grow, which
makes training unstable. We default to cosine similarity scaled by a fixed ``scale`` (a temperature,
as in cosine-softmax classifiers): L1 and L2 then lie in [-1, 1], are minimised by *direction*
agreement, which is what the assignment uses, and eq. 2's softmax keeps a fixed sharpness.
``similarity="dot"`` keeps the paper's literal inner product for ablations.

Space. Eq. 6 writes phi(X_j, C_hat_{I_j}); C_hat (eq. 3) lives in the projected space X W^C, where the
assignment is made, so we measure L1 there: phi(X_j W^C, C_hat_{I_j}). With X instead, L1 would not
train the projection that decides the assignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._checks import check_choice
from ..masks import NO_MASK, AttentionMask, allow_empty_rows

__all__ = ["NeuralClusteringOutput", "assignment_scores", "nearest_centroid", "neural_clustering",
           "prefix_assignment_step"]


@dataclass
class NeuralClusteringOutput:
    """Result of one neural clustering step.

    Attributes:
        assignments: (B, N) long, I_j = argmax_i U_ij (eq. 4); padded positions get ``k`` so that a stable
            sort puts them after every real token.
        updated_centroids: (B, k, d) C_hat = U X W^C (eq. 3).
        clustering_loss: scalar L1 (eq. 6), mean over the real tokens of the batch.
        sorting_loss: scalar L2 (eq. 11), mean over the sequences of the batch with a real token.
    """

    assignments: torch.Tensor
    updated_centroids: torch.Tensor
    clustering_loss: torch.Tensor
    sorting_loss: torch.Tensor


def _unit(t: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows normalised for cosine similarity; unchanged for the dot product."""
    return F.normalize(t, dim=-1, eps=1e-8) if kind == "cosine" else t


def neural_clustering(
    points: torch.Tensor,
    centroids: torch.Tensor,
    *,
    mask: AttentionMask | None = None,
    similarity: str = "cosine",
    scale: float = 10.0,
    assign: str = "subordinate",
    num_clusters: torch.Tensor | None = None,
) -> NeuralClusteringOutput:
    """Soft-cluster ``points`` around ``centroids`` (eqs. 2-4), with the losses of eqs. 6 and 11.

    Args:
        points: (B, N, d) projected hidden states X W^C; or (N, d) points shared by the B centroid sets of a
            (B, k, d) ``centroids`` (the stand-alone clusterer's restarts): then the scores of every set are one
            (N, d) x (d, B k) product and nothing of size (B, N, d) is formed. Same results as the points
            expanded to (B, N, d); no padding in ``mask``.
        centroids: (k, d) parameter centroids C, or (B, k, d) per-sequence centroids (e.g. the previous
            layer's C_hat).
        mask: optional :class:`~clusterformer.masks.AttentionMask` (the layer's): its padding (B, N) bool, True
            marks padding, is excluded from U, C_hat and the losses (a causal order is the attention's, not the
            clustering's: eq. 2 normalises over the sequence).
        similarity: "cosine" (default, bounded) or "dot" (the paper's literal inner product).
        scale: multiplies phi inside the softmax of eq. 2.
        assign: "subordinate" -- I_j = argmax_i U_ij, the paper's eq. 4 (U normalised over positions, so the
            assignment of one token depends on the whole sequence); "nearest" -- I_j = argmax_i
            phi(C_i, X_j W^C), which depends on token j alone (the strictly causal mode's default); or "prefix" --
            eq. 4 with eq. 2's normalisation restricted to positions j' <= j: I_j = argmax_i (s_ij - log sum_{j'
            <= j} exp s_ij'), s = scale * phi, which depends on tokens 0..j only (the strictly causal mode's
            ``causal_assign="prefix"``; beyond the paper). Like eq. 4 it ranks a token against what the
            centroid has scored so far, so a direction shared by every token does not send them all to one
            centroid. (The losses and C_hat are the same for every ``assign``.)
        num_clusters: optional (B,) ints: sequence b uses only the first ``num_clusters[b]`` centroids (its own
            k, e.g. round(sqrt(L_b)) from its real length); the others get U = 0, C_hat = 0 and no tokens, and
            the ring of eq. 11 closes at its own k. Default: all k centroids.

    Returns:
        :class:`NeuralClusteringOutput`.
    """
    check_choice("assign", assign, ("subordinate", "nearest", "prefix"))
    check_choice("similarity", similarity, ("cosine", "dot"))
    mask = NO_MASK if mask is None else mask
    key_padding_mask = mask.padding
    shared = points.dim() == 2
    if shared:
        if centroids.dim() != 3:
            raise ValueError(f"shared (N, d) points need (B, k, d) centroids, got shape {tuple(centroids.shape)}")
        if key_padding_mask is not None:
            raise ValueError("mask: padding is not supported with shared (N, d) points")
        B, N = centroids.shape[0], points.shape[0]
    else:
        B, N, _ = points.shape
    if centroids.dim() == 2:
        centroids = centroids.unsqueeze(0).expand(B, -1, -1)
    # Clustering decisions are argmaxes over a softmax across up to N positions: compute them in at least
    # float32 even under bf16/fp16 autocast, where ties and underflow would scramble the assignment.
    dtype = torch.promote_types(torch.promote_types(points.dtype, centroids.dtype), torch.float32)
    with torch.autocast(device_type=points.device.type, enabled=False):
        points = points.to(dtype)
        raw, scores, unused = _scores(points, _unit(centroids.to(dtype), similarity), similarity, scale,
                                      key_padding_mask, num_clusters)
        # Eq. 2: U_ij = softmax over positions j. A sequence that is all padding has no positions, and an unused
        # centroid no scores: U = 0 for both.
        # Softmax along the last, contiguous dim of a (B, k, N) copy: CUDA's kernel for a softmax over a strided
        # dim took 157 ms of a 160 ms forward at N = 131,072 on an H100 (docs/speed-and-memory.md#on-a-gpu); this takes
        # < 1 ms.
        # The (B, N, k) view it returns is what _weighted_sums wants: its transpose is contiguous.
        by_centroid = scores.transpose(1, 2)
        if key_padding_mask is None and unused is None:
            u = torch.softmax(by_centroid, dim=-1).transpose(1, 2)
        else:  # the library's rule for a row without any allowed entry (clusterformer.masks.allow_empty_rows): zeros
            _, no_key = allow_empty_rows(by_centroid > float("-inf"))  # (B, k, 1)
            u = torch.softmax(by_centroid.masked_fill(no_key, 0.0), dim=-1).masked_fill(no_key, 0.0).transpose(1, 2)
        updated = _weighted_sums(u, points)  # eq. 3: C_hat_i = sum_j U_ij X_j W^C, (B, k, d)
        ids = _assignments(raw, scores, unused, assign, key_padding_mask)  # eq. 4
        real = mask.real(B, N, points.device)
        unit_updated = _unit(updated, similarity)
        clustering_loss = _clustering_loss(points, ids, unit_updated, real, similarity)  # eq. 6
        sorting_loss = _sorting_loss(unit_updated, real, num_clusters, unused)  # eq. 11
    return NeuralClusteringOutput(ids, updated, clustering_loss, sorting_loss)


def _scores(points: torch.Tensor, unit_centroids: torch.Tensor, similarity: str, scale: float,
            key_padding_mask: torch.Tensor | None, num_clusters: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The raw products p . c (B, N, k), the scores of eq. 2 (scale * phi, -inf for padding and unused centroids)
    and the (B, 1, k) mask of the centroids a sequence does not use (None: all used). Shared (N, d) points: the
    (N, B k) product of every centroid set at once, viewed as (B, N, k) without a copy. Cosine divides the (N, k)
    product by the point norms instead of normalising the (N, d) points, so no (N, d) copy is kept for the
    backward."""
    B, k, d = unit_centroids.shape
    if points.dim() == 2:
        N = points.shape[0]
        raw = (points @ unit_centroids.reshape(B * k, d).T).view(N, B, k).transpose(0, 1)
    else:
        raw = points @ unit_centroids.transpose(1, 2)
    scores = raw
    if similarity == "cosine":
        scores = raw * points.norm(dim=-1, keepdim=True).clamp(min=1e-8).reciprocal()
    scores = scale * scores
    unused = None
    if num_clusters is not None:
        unused = (torch.arange(k, device=points.device) >= num_clusters.unsqueeze(1)).unsqueeze(1)
        scores = scores.masked_fill(unused, float("-inf"))
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask.unsqueeze(-1), float("-inf"))
    return raw, scores, unused


@torch.no_grad()
def _assignments(raw: torch.Tensor, scores: torch.Tensor, unused: torch.Tensor | None, assign: str,
                 key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """Eq. 4: I_j = argmax_i U_ij = argmax_i (score_ij - logsumexp_j' score_ij'), (B, N); padding gets k. No
    gradient: the assignment is a hard argmax in the paper too, and the temporaries are freed at once."""
    if assign in ("subordinate", "prefix"):  # normalised over every position, or over positions 0..j
        normaliser = (torch.logsumexp(scores, dim=1, keepdim=True) if assign == "subordinate"
                      else torch.logcumsumexp(scores, dim=1))  # padding and unused centroids: -inf
        relative = scores - normaliser
        if unused is not None:  # -inf - -inf is NaN: take unused centroids out of the argmax again
            relative = relative.masked_fill(unused, float("-inf"))
        ids = relative.argmax(dim=-1)
    else:  # a token's positive norm and the scale do not change its argmax: the same as nearest_centroid
        ids = (raw if unused is None else raw.masked_fill(unused, float("-inf"))).argmax(dim=-1)
    if key_padding_mask is not None:
        ids = ids.masked_fill(key_padding_mask, raw.shape[-1])
    return ids


def _clustering_loss(points: torch.Tensor, ids: torch.Tensor, unit_updated: torch.Tensor, real: torch.Tensor,
                     similarity: str) -> torch.Tensor:
    """Eq. 6: L1 = -mean_j phi(X_j W^C, C_hat_{I_j}) over real tokens. phi is bilinear in the (unit) vectors, so
    the points of each cluster are summed first (a scatter-add, no (B, N, d) gather): sum_j phi(p_j, c_{I_j}) =
    sum_i phi(sum_{j in i} p_j, c_i). Shared (N, d) points: the sums of every set as one product of a one-hot
    matrix."""
    B, k, d = unit_updated.shape
    unit_points = _unit(points, similarity)  # not saved for the backward: scatter_add keeps only the index
    if points.dim() == 2:
        members = _weighted_sums(F.one_hot(ids, k + 1).to(points.dtype), unit_points)
    else:
        members = torch.zeros(B, k + 1, d, dtype=points.dtype, device=points.device)  # row k: padding
        members = members.scatter_add(1, ids.unsqueeze(-1).expand(*ids.shape, d), unit_points)
    return -(members[:, :k] * unit_updated).sum() / real.sum().clamp(min=1)


def _sorting_loss(unit_updated: torch.Tensor, real: torch.Tensor, num_clusters: torch.Tensor | None,
                  unused: torch.Tensor | None) -> torch.Tensor:
    """Eq. 11: L2 = -(1/k) (sum_{i>=2} phi(C_hat_i, C_hat_{i-1}) + phi(C_hat_1, C_hat_k)): a ring, closed at each
    sequence's own k when ``num_clusters`` gives one; the mean over the sequences with a real token."""
    B, k, d = unit_updated.shape
    if num_clusters is None:
        ring = (unit_updated * unit_updated.roll(1, dims=1)).sum(-1).mean(-1)  # (B,)
    else:  # each sequence's ring closes at its own k: C_hat_1 follows C_hat_{k_b}
        k_b = num_clusters.clamp(min=1).unsqueeze(1)
        previous = (torch.arange(k, device=unit_updated.device) - 1) % k_b  # (B, k)
        neighbour = unit_updated.gather(1, previous.unsqueeze(-1).expand(B, k, d))
        terms = (unit_updated * neighbour).sum(-1).masked_fill(unused.squeeze(1), 0.0)
        ring = terms.sum(-1) / k_b.squeeze(1)
    has_real = real.any(-1)
    ring = torch.where(has_real, ring, torch.zeros_like(ring))
    return -ring.sum() / has_real.sum().clamp(min=1)


def _weighted_sums(weights: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """sum_j weights[b, j, i] points[(b,) j] -> (B, r, d) for weights (B, N, r) and points (B, N, d) or (N, d).
    Shared points: one (B r, N) x (N, d) product; the small (N, B r) copy of the weights is what lets it fold."""
    if points.dim() == 3:
        return weights.transpose(1, 2) @ points
    B, N, r = weights.shape
    return (weights.transpose(0, 1).reshape(N, B * r).T @ points).view(B, r, -1)


def assignment_scores(points: torch.Tensor, centroids: torch.Tensor, similarity: str = "cosine",
                      scale: float = 10.0) -> torch.Tensor:
    """s = scale * phi(C_i, p): (..., k) for points (..., d) and centroids (k, d), in at least float32, computed as
    :func:`neural_clustering` computes them -- what one step of cached decoding with ``assign="prefix"`` needs.
    Centroids (..., k, d) broadcast against the points' leading dimensions: points (B, H, N, d) against each head's
    own (H, k, d)."""
    dtype = torch.promote_types(torch.promote_types(points.dtype, centroids.dtype), torch.float32)
    with torch.autocast(device_type=points.device.type, enabled=False):
        points = points.to(dtype)
        scores = points @ _unit(centroids.to(dtype), similarity).transpose(-1, -2)
        if similarity == "cosine":
            scores = scores * points.norm(dim=-1, keepdim=True).clamp(min=1e-8).reciprocal()
        return scale * scores


def prefix_assignment_step(scores_t: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``assign="prefix"``: scores_t (B, k) of the new token and ``lse`` (B, k), each centroid's
    log-sum-exp over the earlier tokens (-inf: none) -> (its cluster (B,), the log-sum-exps with it)."""
    lse = torch.logaddexp(lse, scores_t)
    return (scores_t - lse).argmax(dim=-1), lse


def nearest_centroid(points: torch.Tensor, centroids: torch.Tensor, similarity: str = "cosine") -> torch.Tensor:
    """argmax_i phi(C_i, p) for points (..., d) and centroids (k, d): the assignment of
    :func:`neural_clustering` with ``assign="nearest"`` (computed the same way), without the soft clustering and
    the losses -- what one step of cached decoding needs."""
    dtype = torch.promote_types(torch.promote_types(points.dtype, centroids.dtype), torch.float32)
    with torch.autocast(device_type=points.device.type, enabled=False):
        return (points.to(dtype) @ _unit(centroids.to(dtype), similarity).T).argmax(dim=-1)
