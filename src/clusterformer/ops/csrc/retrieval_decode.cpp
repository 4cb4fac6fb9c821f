// Cluster retrieval's decoding step fused into one call that reads the cache in place (CPU).
//
// One query position per sequence (a decoding step), its H = Hkv x rep query heads grouped by key/value head. Per
// unit -- the rep heads of a key/value head (per_head false: "group" selection) or one head (per_head true) -- the
// step of clusterformer/ops/retrieval.py's _attend_retrieved, reading the cache where it lies instead of gathering:
//   1. score every cluster, q . mu_c (the best over the unit's heads), and order the clusters by it, descending,
//      ties to the lower id (a stable sort, as torch.sort(stable=True) orders them);
//   2. the candidates: the first min(members, retrieved x rerank) slots of the clusters in that order (a cluster's
//      members in the order they joined);
//   3. rerank > 1: keep the `retrieved` candidates of highest exact score (q . k, the best over the unit's heads),
//      with each head's q . k of them, so that step 4 does not read their keys again;
//   4. each head's softmax over the sinks it reads, its window (positions window_first .. n - 1 that are real) and
//      the kept candidates: out = sum p v, the unit's heads together (each key and value row read once for all of
//      them). The three sets are disjoint (the index holds neither sinks nor window).
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

// What one unit reads: its keys (sinks, window, then the kept candidates), and before the re-ranking its
// candidates and their scores.
template <typename T>
struct UnitKeys {
  std::vector<int64_t> keys;
  std::vector<int64_t> candidates;
  std::vector<T> scores;      // per candidate: the best q . k over the unit's heads
  std::vector<T> logits;      // per candidate and head (candidate-major): q . k
  std::vector<T> kept_logits; // per kept candidate and head, in the order they follow the sinks and window in keys
  int64_t retrieved = 0;
  int64_t scored_from = 0;    // keys[scored_from ..] have their logits in kept_logits (none: keys.size())
  bool rerank = false;  // candidates to score, then keep the best `retrieved`
};

// Steps 1-2 for one unit: sinks and window, the clusters ranked, the candidates (kept at once without re-ranking).
template <typename T>
void gather_unit(UnitKeys<T>& unit, const T* q, int64_t heads, int64_t D, int64_t n, const T* centroids_t,
                 const int64_t* counts, const int64_t* members, int64_t C, int64_t capacity, const int64_t* sinks,
                 const bool* sink_live, int64_t S, int64_t sink_count, int64_t window_first, const bool* real,
                 int64_t retrieved, int64_t rerank) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  auto& keys = unit.keys;
  keys.reserve(S + (n - window_first) + retrieved);
  for (int64_t s = 0; s < std::min(S, sink_count); ++s)  // the first sink_count sinks, before the window
    if (sink_live[s] && sinks[s] < window_first) keys.push_back(sinks[s]);
  for (int64_t j = window_first; j < n; ++j)
    if (real == nullptr || real[j]) keys.push_back(j);
  unit.retrieved = retrieved;
  unit.scored_from = keys.size();
  if (retrieved <= 0) return;
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
  auto& candidates = unit.candidates;
  candidates.reserve(wanted);
  for (int64_t r = 0; r < C && static_cast<int64_t>(candidates.size()) < wanted; ++r) {
    const int64_t c = order[r];
    const int64_t take = std::min(counts[c], wanted - static_cast<int64_t>(candidates.size()));
    const int64_t* list = members + c * capacity;
    candidates.insert(candidates.end(), list, list + take);
  }
  if (rerank > 1 && static_cast<int64_t>(candidates.size()) > retrieved) {
    unit.rerank = true;
    unit.scores.resize(candidates.size());
    unit.logits.resize(candidates.size() * heads);
  } else {  // every candidate is kept (at most `retrieved` of them), its logits computed in step 4
    keys.insert(keys.end(), candidates.begin(), candidates.end());
    unit.scored_from = keys.size();
  }
}

// Step 3's scores of candidates [first, last) of a unit: the best q . k over its heads.
template <typename T>
void score_candidates(UnitKeys<T>& unit, int64_t first, int64_t last, const T* q, int64_t heads, int64_t D,
                      const T* k) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t m = first; m < last; ++m) {
    if (m + static_cast<int64_t>(kAhead) < last) prefetch_row(k + unit.candidates[m + kAhead] * D, D);
    const T* key = k + unit.candidates[m] * D;
    T best = neg_inf;
    T* logit = unit.logits.data() + m * heads;
    for (int64_t h = 0; h < heads; ++h) {
      logit[h] = dot(q + h * D, key, D);
      best = std::max(best, logit[h]);
    }
    unit.scores[m] = best;
  }
}

// Step 3: keep the `retrieved` candidates of highest score, and their logits.
template <typename T>
void keep_best(UnitKeys<T>& unit, int64_t heads) {
  std::vector<int64_t> at(unit.candidates.size());
  std::iota(at.begin(), at.end(), int64_t(0));
  std::nth_element(at.begin(), at.begin() + unit.retrieved, at.end(),
                   [&](int64_t a, int64_t b) { return unit.scores[a] > unit.scores[b]; });
  unit.kept_logits.resize(unit.retrieved * heads);
  for (int64_t m = 0; m < unit.retrieved; ++m) {
    unit.keys.push_back(unit.candidates[at[m]]);
    std::copy_n(unit.logits.data() + at[m] * heads, heads, unit.kept_logits.data() + m * heads);
  }
}

// Step 4 for one unit: each of its heads' softmax over the unit's keys, out = sum p v, every key and value row
// read once for all the heads (the logits of kept candidates from step 3). No key: zeros.
template <typename T>
void attend_unit(const UnitKeys<T>& unit, const T* q, int64_t heads, int64_t D, const T* k, const T* v,
                 int64_t Dv, T* out) {
  const auto& keys = unit.keys;
  const int64_t K = keys.size(), first_scored = unit.scored_from;
  std::fill(out, out + heads * Dv, T(0));
  if (K == 0) return;
  std::vector<T> weights(K * heads);  // key-major: weights[m * heads + h]
  for (int64_t m = 0; m < first_scored; ++m) {
    if (m + static_cast<int64_t>(kAhead) < first_scored) prefetch_row(k + keys[m + kAhead] * D, D);
    const T* key = k + keys[m] * D;
    for (int64_t h = 0; h < heads; ++h) weights[m * heads + h] = dot(q + h * D, key, D);
  }
  std::copy(unit.kept_logits.begin(), unit.kept_logits.end(), weights.begin() + first_scored * heads);
  std::vector<T> top(heads, -std::numeric_limits<T>::infinity()), total(heads, T(0));
  for (int64_t m = 0; m < K; ++m)
    for (int64_t h = 0; h < heads; ++h) top[h] = std::max(top[h], weights[m * heads + h]);
  for (int64_t m = 0; m < K; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      weights[m * heads + h] = std::exp(weights[m * heads + h] - top[h]);
      total[h] += weights[m * heads + h];
    }
  for (int64_t m = 0; m < K; ++m) {
    if (m + static_cast<int64_t>(kAhead) < K) prefetch_row(v + keys[m + kAhead] * Dv, Dv);
    const T* value = v + keys[m] * Dv;
    for (int64_t h = 0; h < heads; ++h) {
      const T p = weights[m * heads + h];
      T* o = out + h * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] += p * value[d];
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < Dv; ++d) out[h * Dv + d] /= total[h];
}

constexpr int64_t kChunk = 512;  // candidates per piece of work in the scoring, so that few units fill the threads

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
  const int64_t units = per_head ? rep : 1, heads = per_head ? 1 : rep, H = Hkv * rep;
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
    // Work in three passes, each split over torch's threads by its own pieces -- units (sequence, key/value head,
    // unit), candidate chunks, units -- so that the scoring, most of a step's reads, fills more threads than a
    // decoding step of one sequence has key/value heads.
    const int64_t U = B * Hkv * units;
    std::vector<UnitKeys<scalar_t>> read(U);
    auto unit_q = [&](int64_t u) { return qp + ((u / units) * rep + (u % units) * heads) * D; };
    at::parallel_for(0, U, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t pair = u / units, b = pair / Hkv;
        gather_unit<scalar_t>(read[u], unit_q(u), heads, D, n, cp + pair * D * C, counts_p + pair * C,
                              members_p + pair * C * capacity, C, capacity, sinks_p + b * S, sink_live_p + b * S, S,
                              rows_p[b * 3 + 2], rows_p[b * 3 + 1], real_p == nullptr ? nullptr : real_p + b * n,
                              rows_p[b * 3], rerank);
      }
    });
    std::vector<std::pair<int64_t, int64_t>> pieces;  // (unit, first candidate) of each chunk to score
    for (int64_t u = 0; u < U; ++u)
      if (read[u].rerank)
        for (int64_t first = 0; first < static_cast<int64_t>(read[u].candidates.size()); first += kChunk)
          pieces.emplace_back(u, first);
    at::parallel_for(0, pieces.size(), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        auto [u, first] = pieces[i];
        const int64_t last = std::min<int64_t>(first + kChunk, read[u].candidates.size());
        score_candidates<scalar_t>(read[u], first, last, unit_q(u), heads, D, kp + (u / units) * n * D);
      }
    });
    at::parallel_for(0, U, 1, [&](int64_t begin, int64_t end) {  // units, their heads in (b, kv head, rep) order
      for (int64_t u = begin; u < end; ++u) {
        if (read[u].rerank) keep_best<scalar_t>(read[u], heads);
        const int64_t pair = u / units, first_head = pair * rep + (u % units) * heads;
        attend_unit<scalar_t>(read[u], unit_q(u), heads, D, kp + pair * n * D, vp + pair * n * Dv, Dv,
                              op + first_head * Dv);
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &retrieval_decode, "cluster retrieval's decoding step: (B, Hkv, rep, Dv)");
}
