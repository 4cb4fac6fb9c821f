// Cluster retrieval's decoding step fused into one pass per (sequence, key/value head, unit) (CPU).
//
// One query position per sequence (a decoding step), its H = Hkv x rep query heads grouped by key/value head. Per
// unit -- the rep heads of a key/value head (per_head false: "group" selection) or one head (per_head true) -- the
// step of clusterformer/ops/retrieval.py's _attend_retrieved, reading the cache where it lies instead of gathering:
//   1. score every cluster, q . mu_c (the best over the unit's heads), and order the clusters by it, descending,
//      ties to the lower id (a stable sort, as torch.sort(stable=True) orders them);
//   2. the candidates: the first min(members, retrieved x rerank) slots of the clusters in that order (a cluster's
//      members in the order they joined);
//   3. rerank > 1: keep the `retrieved` candidates of highest exact score (q . k, the best over the unit's heads);
//   4. each head's softmax over the sinks it reads, its window (positions window_first .. n - 1 that are real) and
//      the kept candidates: out = sum p v. The three sets are disjoint (the index holds neither sinks nor window).
//
// q (B, Hkv, rep, D), scaled; k (B, Hkv, n, D), v (B, Hkv, n, Dv) the cache; centroids_t (B Hkv, D, C) in k's
// dtype; counts (B Hkv, C) int64; members (B Hkv, C, capacity) int64; sinks (B, S) int64 positions of each
// sequence's first real tokens, sink_live (B, S) bool those that exist and lie before the index's end; rows (B, 3)
// int64 per sequence: the keys it retrieves, its window's first position, the sinks it reads (the first that many
// live ones before the window); real (B, n) bool, or an empty tensor (every key real). Returns out (B, Hkv, rep, Dv).
// A head without any key to read gets zeros.
// Python side: clusterformer/ops/retrieval.py (when it runs, the arguments) and ops/extensions.py (the build).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// The rows read are scattered over the cache (a cluster's members, the kept candidates): ask for a row this many
// places ahead, so that its cache lines arrive while the rows before it are scored.
constexpr size_t kAhead = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t length) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < length * static_cast<int64_t>(sizeof(T)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

template <typename T>
inline T dot(const T* a, const T* b, int64_t D) {
  T s = 0;
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

template <typename T>
void decode_unit(const T* q, int64_t heads, int64_t D, const T* k, const T* v, int64_t Dv, int64_t n,
                 const T* centroids_t, const int64_t* counts, const int64_t* members, int64_t C, int64_t capacity,
                 const int64_t* sinks, const bool* sink_live, int64_t S, int64_t sink_count, int64_t window_first,
                 const bool* real, int64_t retrieved, int64_t rerank, T* out) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  std::vector<int64_t> keys;  // the positions read: sinks, window, kept candidates
  keys.reserve(S + (n - window_first) + retrieved);
  for (int64_t s = 0; s < std::min(S, sink_count); ++s)  // the first sink_count sinks, before the window
    if (sink_live[s] && sinks[s] < window_first) keys.push_back(sinks[s]);
  for (int64_t j = window_first; j < n; ++j)
    if (real == nullptr || real[j]) keys.push_back(j);

  if (retrieved > 0) {
    // 1. the clusters in descending order of their best score over the unit's heads
    std::vector<T> score(C, neg_inf), head_score(C);
    for (int64_t h = 0; h < heads; ++h) {
      std::fill(head_score.begin(), head_score.end(), T(0));
      const T* qh = q + h * D;
      for (int64_t d = 0; d < D; ++d) {
        const T qd = qh[d];
        const T* row = centroids_t + d * C;
        for (int64_t c = 0; c < C; ++c) head_score[c] += qd * row[c];
      }
      for (int64_t c = 0; c < C; ++c) score[c] = std::max(score[c], head_score[c]);
    }
    std::vector<int64_t> order(C);
    std::iota(order.begin(), order.end(), int64_t(0));
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[a] > score[b]; });
    // 2. the candidates: the ranked clusters' members, in order, up to retrieved x rerank slots
    const int64_t wanted = retrieved * rerank;
    std::vector<int64_t> candidates;
    candidates.reserve(wanted);
    for (int64_t r = 0; r < C && static_cast<int64_t>(candidates.size()) < wanted; ++r) {
      const int64_t c = order[r];
      const int64_t take = std::min(counts[c], wanted - static_cast<int64_t>(candidates.size()));
      const int64_t* list = members + c * capacity;
      candidates.insert(candidates.end(), list, list + take);
    }
    // 3. re-ranked: the `retrieved` candidates of highest exact score, the best over the unit's heads
    if (rerank > 1 && static_cast<int64_t>(candidates.size()) > retrieved) {
      std::vector<std::pair<T, int64_t>> scored(candidates.size());
      for (size_t m = 0; m < candidates.size(); ++m) {
        if (m + kAhead < candidates.size()) prefetch_row(k + candidates[m + kAhead] * D, D);
        const T* key = k + candidates[m] * D;
        T best = neg_inf;
        for (int64_t h = 0; h < heads; ++h) best = std::max(best, dot(q + h * D, key, D));
        scored[m] = {best, candidates[m]};
      }
      std::nth_element(scored.begin(), scored.begin() + retrieved, scored.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      for (int64_t m = 0; m < retrieved; ++m) keys.push_back(scored[m].second);
    } else {
      const int64_t kept = std::min<int64_t>(retrieved, candidates.size());
      keys.insert(keys.end(), candidates.begin(), candidates.begin() + kept);
    }
  }

  // 4. each head's softmax over the keys read; the scores of all heads per key while its row is in cache
  const int64_t K = keys.size();
  if (K == 0) {
    std::fill(out, out + heads * Dv, T(0));
    return;
  }
  std::vector<T> logits(heads * K);
  std::vector<T> top(heads, neg_inf);
  for (int64_t m = 0; m < K; ++m) {
    if (m + kAhead < K) prefetch_row(k + keys[m + kAhead] * D, D);
    const T* key = k + keys[m] * D;
    for (int64_t h = 0; h < heads; ++h) {
      const T s = dot(q + h * D, key, D);
      logits[h * K + m] = s;
      top[h] = std::max(top[h], s);
    }
  }
  std::vector<T> total(heads, T(0));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t m = 0; m < K; ++m) {
      const T p = std::exp(logits[h * K + m] - top[h]);
      logits[h * K + m] = p;
      total[h] += p;
    }
  std::fill(out, out + heads * Dv, T(0));
  for (int64_t m = 0; m < K; ++m) {
    if (m + kAhead < K) prefetch_row(v + keys[m + kAhead] * Dv, Dv);
    const T* value = v + keys[m] * Dv;
    for (int64_t h = 0; h < heads; ++h) {
      const T p = logits[h * K + m] / total[h];
      T* o = out + h * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] += p * value[d];
    }
  }
}

torch::Tensor retrieval_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& centroids_t, const torch::Tensor& counts,
                               const torch::Tensor& members, const torch::Tensor& sinks,
                               const torch::Tensor& sink_live, const torch::Tensor& rows, const torch::Tensor& real,
                               int64_t rerank, bool per_head) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && centroids_t.is_contiguous() &&
                  counts.is_contiguous() && members.is_contiguous() && sinks.is_contiguous() &&
                  sink_live.is_contiguous() && rows.is_contiguous() && real.is_contiguous(),
              "every tensor must be contiguous");
  const int64_t B = q.size(0), Hkv = q.size(1), rep = q.size(2), D = q.size(3);
  const int64_t n = k.size(2), Dv = v.size(3);
  const int64_t C = counts.size(1), capacity = members.size(2), S = sinks.size(1);
  TORCH_CHECK(k.size(0) == B && k.size(1) == Hkv && k.size(3) == D && v.size(2) == n, "k, v do not match q");
  TORCH_CHECK(centroids_t.size(0) == B * Hkv && centroids_t.size(1) == D && centroids_t.size(2) == C,
              "centroids_t must be (B Hkv, D, C)");
  TORCH_CHECK(members.size(0) == B * Hkv && members.size(1) == C, "members must be (B Hkv, C, capacity)");
  TORCH_CHECK(rows.size(0) == B && rows.size(1) == 3, "rows must be (B, 3)");
  TORCH_CHECK(rerank >= 1, "rerank must be >= 1");
  const bool has_real = real.numel() > 0;
  auto out = torch::empty({B, Hkv, rep, Dv}, v.options());
  const int64_t units = per_head ? rep : 1, heads = per_head ? 1 : rep;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "retrieval_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const scalar_t* cp = centroids_t.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t* counts_p = counts.data_ptr<int64_t>();
    const int64_t* members_p = members.data_ptr<int64_t>();
    const int64_t* sinks_p = sinks.data_ptr<int64_t>();
    const bool* sink_live_p = sink_live.data_ptr<bool>();
    const int64_t* rows_p = rows.data_ptr<int64_t>();
    const bool* real_p = has_real ? real.data_ptr<bool>() : nullptr;
    at::parallel_for(0, B * Hkv * units, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t pair = task / units, unit = task % units, b = pair / Hkv;
        const int64_t head = unit * heads;  // the unit's first query head within its group
        decode_unit<scalar_t>(qp + (pair * rep + head) * D, heads, D, kp + pair * n * D, vp + pair * n * Dv, Dv, n,
                              cp + pair * D * C, counts_p + pair * C, members_p + pair * C * capacity, C, capacity,
                              sinks_p + b * S, sink_live_p + b * S, S, rows_p[b * 3 + 2], rows_p[b * 3 + 1],
                              real_p == nullptr ? nullptr : real_p + b * n, rows_p[b * 3], rerank,
                              op + (pair * rep + head) * Dv);
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &retrieval_decode, "cluster retrieval's decoding step: (B, Hkv, rep, Dv)");
}
