// Softmax attention of each query over its own list of keys, forward and backward in one pass each (CPU).
//
// q (B, H, N, D); k, v (B, H, Nk, D) -- these, the output and the gradients with unit stride along D and any other
// strides (views of a fused projection read and written in place: Rows); index (B, H, N, M) int64, the key positions query (b, h, i) reads, -1 for
// none; besides them, query i reads the `window` keys at positions i - offset .. i - offset + window - 1 that lie in
// [0, Nk) and are real (key_real (B, Nk) bool; an empty tensor: every key is real), so that a contiguous window
// needs no index. out[b, h, i] = sum_m p_m v[key_m] with p = softmax_m(q . k[key_m] * scale) over those keys;
// lse[b, h, i] = log sum_m exp(q . k[key_m] * scale) (-inf for a query without keys, whose output is 0).
//
// Slot runs (optional; empty tensors: none): order (B, H, Nk) int64, a permutation of the key positions (slot ->
// position); run_first, run_length (B, H, N, R) int64. Query i also reads the keys order[run_first[r] + u] for
// u < run_length[r] <= capacity, each run r: consecutive slots of a sorted order (cluster-select's selected clusters'
// members), listed without a (B, H, N, R * capacity) index.
//
// Range summaries (optional; empty tensors: none): prefix_k, prefix_v (B, H, R + 1, D) prefix sums of keys and
// values in some order of R rows (row 0 zero), start, total (B, H, C) int64 each group's first row and size,
// lower, upper (B, H, N, C) int64. Query i also reads, in the same softmax, one summary per group c of the rows
// start + [0, lower) and start + [upper, total), n = lower + total - upper of them (none where n <= 0): key = their
// sum of keys / n, value = their sum of values / n, logit = q . key * scale + log n (cluster-select's summaries).
//
// The backward takes the gradients of out and lse: ds_m = p_m (dout . v_m - dout . out + dlse); a summary's
// gradient reaches prefix_k and prefix_v at the four rows its sums read.
// Work is split over the (b, h) pairs, so the scatter of dk, dv and the prefix gradients has no race.
// Besides: summary_logits and bound_select (cluster-select's selections, no gradient) and top_members (its
// members="score": each selected group's best-scoring members per query).
// Python side: clusterformer/ops/listed_attention.py (validation, autograd, the reference, the build).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <utility>
#include <vector>

#include "rows.h"

namespace {

using clusterformer::Rows;
using clusterformer::rows_of;
using clusterformer::unit_rows;
using clusterformer::with_head_size;

// The slot runs of one (b, h) pair (pointers already offset to it); count == 0: none.
struct Runs {
  const int64_t* order = nullptr;   // (Nk,) slot -> position
  const int64_t* first = nullptr;   // (N, count)
  const int64_t* length = nullptr;  // (N, count)
  int64_t count = 0;
  int64_t capacity = 0;

  inline Runs at(int64_t pair, int64_t N, int64_t Nk) const {
    if (count == 0) return {};
    return {order + pair * Nk, first + pair * N * count, length + pair * N * count, count, capacity};
  }
};

// Calls visit(m, j) for the keys query i reads: first its window (m = 0 .. window - 1; j = -1 where the position
// is outside [0, Nk) or padding), then its listed keys (m = window .. window + M - 1; j = -1 where none), then its
// runs' keys (m = window + M + r * capacity + u, u < run_length; the rest of each run's places are not visited).
template <typename F>
inline void for_each_key(int64_t i, const int64_t* keys, int64_t M, const Runs& runs, int64_t window,
                         int64_t offset, int64_t Nk, const bool* real, F&& visit) {
  const int64_t first = i - offset;
  for (int64_t w = 0; w < window; ++w) {
    const int64_t j = first + w;
    visit(w, (j < 0 || j >= Nk || (real != nullptr && !real[j])) ? int64_t(-1) : j);
  }
  for (int64_t m = 0; m < M; ++m) visit(window + m, keys[m]);
  for (int64_t r = 0; r < runs.count; ++r) {
    const int64_t* slots = runs.order + runs.first[i * runs.count + r];
    const int64_t length = runs.length[i * runs.count + r];
    const int64_t base = window + M + r * runs.capacity;
    for (int64_t u = 0; u < length; ++u) visit(base + u, slots[u]);
  }
}

// The range summaries of one (b, h) pair (pointers already offset to it); groups == 0: none.
template <typename T>
struct Summaries {
  const T* prefix_k = nullptr;
  const T* prefix_v = nullptr;
  const int64_t* start = nullptr;
  const int64_t* total = nullptr;
  const int64_t* lower = nullptr;  // (N, C)
  const int64_t* upper = nullptr;
  int64_t groups = 0;

  // The summaries of (b, h) pair `pair` (this struct holding all pairs' tensors), or none.
  inline Summaries at(int64_t pair, int64_t prefix_rows, int64_t N, int64_t D) const {
    if (groups == 0) return {};
    return {prefix_k + pair * prefix_rows * D, prefix_v == nullptr ? nullptr : prefix_v + pair * prefix_rows * D,
            start + pair * groups, total + pair * groups, lower + pair * N * groups, upper + pair * N * groups,
            groups};
  }

  // The four prefix rows of query i's summary of group c, and its count n (rows: +a - b + c - d). An empty upper
  // range reads row s three times, not rows s + t and s + up: the sum (a - b) + (c - d), which the compiler may
  // reassociate (-fassociative-math), then never holds the group's total -- under a causal mask a sum over later
  // keys, whose rounding must not reach the output.
  inline int64_t rows(int64_t i, int64_t c, int64_t* r) const {
    const int64_t s = start[c], t = total[c], lo = lower[i * groups + c], up = upper[i * groups + c];
    r[0] = s + lo;
    r[1] = s;
    r[2] = up < t ? s + t : s;
    r[3] = up < t ? s + up : s;
    return lo + t - up;
  }
};

// What the forward and the backward read: q, k, v, the listed keys (B, H, N, M), the slot runs, the key mask (B, Nk)
// or null, the range summaries, the shapes and the window; pair(p, D) gives (b, h) pair p's own share of them.
template <typename T>
struct Listed {
  Rows<const T> q, k, v;
  const int64_t* index = nullptr;
  Runs runs;
  const bool* key_real = nullptr;
  Summaries<T> sums;
  int64_t prefix_rows = 0, pairs = 0, H = 1, N = 0, Nk = 0, M = 0, window = 0, offset = 0;
  T scale = 1;

  struct Pair {
    const T* q;
    const T* k;
    const T* v;
    const int64_t* index;  // (N, M)
    Runs runs;
    const bool* real;  // (Nk,) or null
    Summaries<T> sums;
  };

  inline Pair pair(int64_t p, int64_t D) const {
    return {q.at(p), k.at(p), v.at(p), index + p * N * M, runs.at(p, N, Nk),
            key_real == nullptr ? nullptr : key_real + (p / H) * Nk, sums.at(p, prefix_rows, N, D)};
  }
};

// exp(x) for x <= 0 in plain arithmetic, so that a loop over a buffer vectorises (std::exp is a call per element):
// exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2] (Cody and Waite's ln 2 in two
// parts), exp(r) by its Taylor series to degree 7 (float) or 12 (double): relative error about 1e-8 / 3e-16. x is
// clamped to [-87, 0] (float) or [-708, 0] (double), so that 2^n stays a normal number: a key e^87 below the
// largest gets e^-87 of its weight instead of 0.
template <typename T>
inline T exp_nonpositive(T x) {
  constexpr bool single = std::is_same<T, float>::value;
  using Bits = typename std::conditional<single, int32_t, int64_t>::type;
  constexpr T low = single ? T(-87) : T(-708);
  constexpr T log2e = T(1.4426950408889634074);
  constexpr T ln2_hi = single ? T(0.693359375) : T(6.93147180369123816490e-01);
  constexpr T ln2_lo = single ? T(-2.12194440e-4) : T(1.90821492927058770002e-10);
  constexpr int degree = single ? 7 : 12;
  x = x < low ? low : (x > T(0) ? T(0) : x);
  const Bits n = static_cast<Bits>(x * log2e - T(0.5));  // x <= 0: truncation of y - 0.5 rounds y to nearest
  const T whole = static_cast<T>(n);
  const T r = (x - whole * ln2_hi) - whole * ln2_lo;
  T p = T(1);
  for (int i = degree; i >= 1; --i) p = T(1) + p * (r * (T(1) / T(i)));  // 1 + r (1 + r / 2 (1 + r / 3 (...)))
  const Bits exponent = (n + (single ? Bits(127) : Bits(1023))) << (single ? 23 : 52);
  T scale;
  std::memcpy(&scale, &exponent, sizeof(T));
  return p * scale;
}

template <typename T, int64_t FixedD>
void forward_pairs(const Listed<T>& in, const Rows<T>& out, T* lse, int64_t head_dim, int64_t first, int64_t last) {
  const int64_t D = FixedD ? FixedD : head_dim;  // a compile-time head size unrolls the loops over channels
  const int64_t C = in.sums.groups, N = in.N, Nk = in.Nk, M = in.M, window = in.window, offset = in.offset;
  const Rows<const T>& k = in.k;
  const Rows<const T>& v = in.v;
  const T scale = in.scale;
  const T minus_inf = -std::numeric_limits<T>::infinity();
  const int64_t listed = M + in.runs.count * in.runs.capacity;  // places after the window, before the summaries
  {
    std::vector<T> scores(window + listed + C);
    for (int64_t pair = first; pair < last; ++pair) {
      const auto at = in.pair(pair, D);  // this pair's q, k, v, listed keys, runs, key mask, summaries
      const T* kp = at.k;  // the rows the loops over keys read, in locals
      const T* vp = at.v;
      T* op = out.at(pair);
      T* lp = lse + pair * N;
      for (int64_t i = 0; i < N; ++i) {
        const T* __restrict__ qi = at.q + i * in.q.row;
        T* __restrict__ oi = op + i * out.row;
        T largest = minus_inf;
        for_each_key(i, at.index + i * M, M, at.runs, window, offset, Nk, at.real, [&](int64_t m, int64_t j) {
          if (j < 0) {
            scores[m] = minus_inf;
            return;
          }
          const T* __restrict__ kj = kp + j * k.row;
          T dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
          scores[m] = dot * scale;
          if (scores[m] > largest) largest = scores[m];
        });
        for (int64_t c = 0; c < C; ++c) {  // summaries: q . (sum of keys) / n * scale + log n
          int64_t r[4];
          const int64_t n = at.sums.rows(i, c, r);
          T& score = scores[window + listed + c];
          if (n <= 0) {
            score = minus_inf;
            continue;
          }
          const T* a = at.sums.prefix_k + r[0] * D; const T* b = at.sums.prefix_k + r[1] * D;
          const T* e = at.sums.prefix_k + r[2] * D; const T* f = at.sums.prefix_k + r[3] * D;
          T dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * ((a[d] - b[d]) + (e[d] - f[d]));
          score = dot * scale / T(n) + std::log(T(n));
          if (score > largest) largest = score;
        }
        for (int64_t d = 0; d < D; ++d) oi[d] = 0;
        if (largest == minus_inf) {  // no key: output 0, lse -inf
          lp[i] = minus_inf;
          continue;
        }
        {  // every place's weight in one vectorised pass (places of no key: read by nobody below)
          T* __restrict__ sp = scores.data();
          const int64_t places = window + listed + C;
          for (int64_t m = 0; m < places; ++m) sp[m] = exp_nonpositive(sp[m] - largest);
        }
        T total = 0;
        for_each_key(i, at.index + i * M, M, at.runs, window, offset, Nk, at.real, [&](int64_t m, int64_t j) {
          if (j < 0) return;
          const T p = scores[m];
          total += p;
          const T* __restrict__ vj = vp + j * v.row;
          for (int64_t d = 0; d < D; ++d) oi[d] += p * vj[d];
        });
        for (int64_t c = 0; c < C; ++c) {
          int64_t r[4];
          const int64_t n = at.sums.rows(i, c, r);
          if (n <= 0) continue;  // no summary
          const T p = scores[window + listed + c];
          total += p;
          const T w = p / T(n);
          const T* a = at.sums.prefix_v + r[0] * D; const T* b = at.sums.prefix_v + r[1] * D;
          const T* e = at.sums.prefix_v + r[2] * D; const T* f = at.sums.prefix_v + r[3] * D;
          for (int64_t d = 0; d < D; ++d) oi[d] += w * ((a[d] - b[d]) + (e[d] - f[d]));
        }
        const T inverse = T(1) / total;
        for (int64_t d = 0; d < D; ++d) oi[d] *= inverse;
        lp[i] = largest + std::log(total);
      }
    }
  }
}

// forward_kernel: forward_pairs over every pair, split over torch's threads. The body is a function of its own, not
// the parallel loop's lambda, so that its loops compile as they would inline whatever the loop does with it.
template <typename T, int64_t FixedD>
void forward_kernel(const Listed<T>& in, const Rows<T>& out, T* lse, int64_t head_dim) {
  at::parallel_for(0, in.pairs, 1, [&](int64_t first, int64_t last) {
    forward_pairs<T, FixedD>(in, out, lse, head_dim, first, last);
  });
}

// Head sizes up to this take the backward in two passes over a query's keys (scores and dout . v into buffers, their
// exp in one vectorised loop, then the gradients); larger ones in one pass, an inline exp per key. The kernel's
// forward and backward, one thread (docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step):
// at D = 16 (N 512, 144 keys per query) two passes 101 ms, one pass 129; at D = 64 (N 1,024, 256 keys) one pass
// 172-182 ms, two passes 210. D = 32: not measured.
constexpr int64_t kTwoPassBackward = 32;

template <typename T, int64_t FixedD>
void backward_pairs(const Listed<T>& in, const Rows<const T>& out, const T* lse, const Rows<const T>& dout,
                    const T* dlse, const Rows<T>& dq, const Rows<T>& dk, const Rows<T>& dv, T* dprefix_k,
                    T* dprefix_v, int64_t head_dim, int64_t first, int64_t last) {
  const int64_t D = FixedD ? FixedD : head_dim;
  const int64_t C = in.sums.groups, N = in.N, Nk = in.Nk, M = in.M, window = in.window, offset = in.offset;
  const int64_t prefix_rows = in.prefix_rows;
  const Rows<const T>& k = in.k;
  const Rows<const T>& v = in.v;
  const T scale = in.scale;
  const T minus_inf = -std::numeric_limits<T>::infinity();
  const int64_t listed = M + in.runs.count * in.runs.capacity;
  {
    // the query's row, its output gradient and its dq in buffers of their own: no aliasing with dk, dv
    std::vector<T> q_buffer(D), g_buffer(D), dq_buffer(D);
    std::vector<T> weights(window + listed), dots(window + listed);  // per key: p, then dout . v
    T* __restrict__ qi = q_buffer.data();
    T* __restrict__ gi = g_buffer.data();
    T* __restrict__ dqi = dq_buffer.data();
    for (int64_t pair = first; pair < last; ++pair) {
      const auto at = in.pair(pair, D);  // this pair's q, k, v, listed keys, runs, key mask, summaries
      const T* kp = at.k;  // the rows the loops over keys read, in locals
      const T* vp = at.v;
      T* dpk = C ? dprefix_k + pair * prefix_rows * D : nullptr;
      T* dpv = C ? dprefix_v + pair * prefix_rows * D : nullptr;
      const T* op = out.at(pair);
      const T* lp = lse + pair * N;
      const T* gp = dout.at(pair);
      const T* glp = dlse + pair * N;
      T* dqp = dq.at(pair);
      T* dkp = dk.at(pair);
      T* dvp = dv.at(pair);
      for (int64_t i = 0; i < N; ++i) {
        const T log_total = lp[i];
        T* dq_row = dqp + i * dq.row;
        if (log_total == minus_inf) {  // no key: no gradient (dq is not zero-filled beforehand)
          std::fill(dq_row, dq_row + D, T(0));
          continue;
        }
        const T* oi = op + i * out.row;
        const T* q_row = at.q + i * in.q.row;
        const T* g_row = gp + i * dout.row;
        T delta = 0;  // dout . out
        for (int64_t d = 0; d < D; ++d) {
          qi[d] = q_row[d] * scale;
          gi[d] = g_row[d];
          dqi[d] = 0;
          delta += gi[d] * oi[d];
        }
        const T shift = glp[i] - delta;
        T* __restrict__ wp = weights.data();
        T* __restrict__ dotp = dots.data();
        if (D <= kTwoPassBackward) {  // small heads: the weights' exp in one vectorised pass over a buffer
          for_each_key(i, at.index + i * M, M, at.runs, window, offset, Nk, at.real, [&](int64_t m, int64_t j) {
            if (j < 0) return;
            const T* __restrict__ kj = kp + j * k.row;
            const T* __restrict__ vj = vp + j * v.row;
            T score = 0, dp = 0;
            for (int64_t d = 0; d < D; ++d) {
              score += qi[d] * kj[d];
              dp += gi[d] * vj[d];
            }
            wp[m] = score - log_total;
            dotp[m] = dp;
          });
          for (int64_t m = 0; m < window + listed; ++m) wp[m] = exp_nonpositive(wp[m]);
        }
        for_each_key(i, at.index + i * M, M, at.runs, window, offset, Nk, at.real, [&](int64_t m, int64_t j) {
          if (j < 0) return;
          const T* __restrict__ kj = kp + j * k.row;
          T* __restrict__ dkj = dkp + j * dk.row;
          T* __restrict__ dvj = dvp + j * dv.row;
          T p, dp;
          if (D <= kTwoPassBackward) {
            p = wp[m];
            dp = dotp[m];
          } else {  // large heads: one pass over the keys, which the second would read again
            const T* __restrict__ vj = vp + j * v.row;
            T score = 0;
            dp = 0;
            for (int64_t d = 0; d < D; ++d) {
              score += qi[d] * kj[d];
              dp += gi[d] * vj[d];
            }
            p = exp_nonpositive(score - log_total);
          }
          const T ds = p * (dp + shift);
          for (int64_t d = 0; d < D; ++d) dvj[d] += p * gi[d];
          for (int64_t d = 0; d < D; ++d) dkj[d] += ds * qi[d];
          for (int64_t d = 0; d < D; ++d) dqi[d] += ds * kj[d];
        });
        for (int64_t c = 0; c < C; ++c) {  // a summary: key = K / n, value = V / n, logit = q . K * scale / n + log n
          int64_t r[4];
          const int64_t n = at.sums.rows(i, c, r);
          if (n <= 0) continue;
          const T inverse_n = T(1) / T(n);
          const T* ka = at.sums.prefix_k + r[0] * D; const T* kb = at.sums.prefix_k + r[1] * D;
          const T* ke = at.sums.prefix_k + r[2] * D; const T* kf = at.sums.prefix_k + r[3] * D;
          const T* va = at.sums.prefix_v + r[0] * D; const T* vb = at.sums.prefix_v + r[1] * D;
          const T* ve = at.sums.prefix_v + r[2] * D; const T* vf = at.sums.prefix_v + r[3] * D;
          T score = 0, dp = 0;
          for (int64_t d = 0; d < D; ++d) {
            score += qi[d] * ((ka[d] - kb[d]) + (ke[d] - kf[d]));
            dp += gi[d] * ((va[d] - vb[d]) + (ve[d] - vf[d]));
          }
          const T p = std::exp(score * inverse_n + std::log(T(n)) - log_total);
          const T ds = p * (dp * inverse_n + shift) * inverse_n;  // d logit / d (q . K) = 1 / n (q already scaled)
          const T w = p * inverse_n;                              // d out / d V
          for (int64_t d = 0; d < D; ++d) dqi[d] += ds * ((ka[d] - kb[d]) + (ke[d] - kf[d]));
          const T signs[4] = {T(1), T(-1), T(1), T(-1)};
          for (int row = 0; row < 4; ++row) {
            T* __restrict__ gk = dpk + r[row] * D;
            T* __restrict__ gv = dpv + r[row] * D;
            const T sk = signs[row] * ds, sv = signs[row] * w;
            for (int64_t d = 0; d < D; ++d) gk[d] += sk * qi[d];
            for (int64_t d = 0; d < D; ++d) gv[d] += sv * gi[d];
          }
        }
        for (int64_t d = 0; d < D; ++d) dq_row[d] = dqi[d] * scale;
      }
    }
  }
}

// backward_kernel: backward_pairs over every pair, split over torch's threads. The body is a function of its own, not
// the parallel loop's lambda, so that its loops compile as they would inline whatever the loop does with it.
template <typename T, int64_t FixedD>
void backward_kernel(const Listed<T>& in, const Rows<const T>& out, const T* lse, const Rows<const T>& dout,
                     const T* dlse, const Rows<T>& dq, const Rows<T>& dk, const Rows<T>& dv, T* dprefix_k,
                     T* dprefix_v, int64_t head_dim) {
  at::parallel_for(0, in.pairs, 1, [&](int64_t first, int64_t last) {
    backward_pairs<T, FixedD>(in, out, lse, dout, dlse, dq, dk, dv, dprefix_k, dprefix_v, head_dim, first, last);
  });
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& index,
                  const torch::Tensor& key_real) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && index.device().is_cpu(),
              "listed attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && index.dim() == 4, "expected 4-D q, k, v and index");
  TORCH_CHECK(unit_rows(q) && unit_rows(k) && unit_rows(v) && index.is_contiguous(),
              "expected q, k, v with unit stride along D and a contiguous index");
  TORCH_CHECK(index.scalar_type() == torch::kLong, "index must be int64");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "q (B, H, N, D), k and v (B, H, Nk, D)");
  TORCH_CHECK(index.size(0) == q.size(0) && index.size(1) == q.size(1) && index.size(2) == q.size(2),
              "index (B, H, N, M)");
  TORCH_CHECK(key_real.numel() == 0 || (key_real.scalar_type() == torch::kBool && key_real.is_contiguous() &&
                                        key_real.dim() == 2 && key_real.size(0) == q.size(0) &&
                                        key_real.size(1) == k.size(2)),
              "key_real: empty, or a contiguous (B, Nk) bool tensor");
}

// The summaries' tensors as pointers (groups 0 where prefix_k is empty), checked against q.
template <typename T>
Summaries<T> summaries_of(const torch::Tensor& q, const torch::Tensor& prefix_k, const torch::Tensor& prefix_v,
                          const torch::Tensor& start, const torch::Tensor& total, const torch::Tensor& lower,
                          const torch::Tensor& upper) {
  Summaries<T> s;
  if (prefix_k.numel() == 0) return s;
  TORCH_CHECK(prefix_k.is_contiguous() && prefix_v.is_contiguous() && start.is_contiguous() && total.is_contiguous()
                  && lower.is_contiguous() && upper.is_contiguous(), "expected contiguous summaries");
  TORCH_CHECK(prefix_k.sizes() == prefix_v.sizes() && prefix_k.dim() == 4 && prefix_k.size(0) == q.size(0) &&
              prefix_k.size(1) == q.size(1) && prefix_k.size(3) == q.size(3), "prefix sums (B, H, R + 1, D)");
  TORCH_CHECK(start.scalar_type() == torch::kLong && total.scalar_type() == torch::kLong &&
              lower.scalar_type() == torch::kLong && upper.scalar_type() == torch::kLong, "int64 ranges");
  TORCH_CHECK(lower.dim() == 4 && lower.sizes() == upper.sizes() && lower.size(2) == q.size(2) &&
              start.dim() == 3 && start.sizes() == total.sizes() && start.size(2) == lower.size(3),
              "start, total (B, H, C); lower, upper (B, H, N, C)");
  s.prefix_k = prefix_k.data_ptr<T>();
  s.prefix_v = prefix_v.data_ptr<T>();
  s.start = start.data_ptr<int64_t>();
  s.total = total.data_ptr<int64_t>();
  s.lower = lower.data_ptr<int64_t>();
  s.upper = upper.data_ptr<int64_t>();
  s.groups = start.size(2);
  return s;
}

const bool* real_or_null(const torch::Tensor& key_real) {
  return key_real.numel() == 0 ? nullptr : key_real.data_ptr<bool>();
}

// The slot runs as pointers (count 0 where order is empty), checked against q and k.
Runs runs_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& order, const torch::Tensor& first,
             const torch::Tensor& length, int64_t capacity) {
  Runs r;
  if (order.numel() == 0) return r;
  TORCH_CHECK(order.is_contiguous() && first.is_contiguous() && length.is_contiguous(), "expected contiguous runs");
  TORCH_CHECK(order.scalar_type() == torch::kLong && first.scalar_type() == torch::kLong &&
              length.scalar_type() == torch::kLong, "int64 runs");
  TORCH_CHECK(order.dim() == 3 && order.size(0) == q.size(0) && order.size(1) == q.size(1) &&
              order.size(2) == k.size(2) && first.dim() == 4 && first.sizes() == length.sizes() &&
              first.size(0) == q.size(0) && first.size(1) == q.size(1) && first.size(2) == q.size(2),
              "order (B, H, Nk); run_first, run_length (B, H, N, R)");
  r.order = order.data_ptr<int64_t>();
  r.first = first.data_ptr<int64_t>();
  r.length = length.data_ptr<int64_t>();
  r.count = first.size(3);
  r.capacity = capacity;
  return r;
}

// The inputs of the forward and the backward as a Listed (the runs already checked; the summaries checked here).
template <typename T>
Listed<T> listed_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& index,
                    const Runs& runs, const torch::Tensor& key_real, int64_t window, int64_t offset,
                    const torch::Tensor& prefix_k, const torch::Tensor& prefix_v, const torch::Tensor& start,
                    const torch::Tensor& total, const torch::Tensor& lower, const torch::Tensor& upper, double scale) {
  return {rows_of<const T>(q), rows_of<const T>(k), rows_of<const T>(v), index.data_ptr<int64_t>(), runs,
          real_or_null(key_real), summaries_of<T>(q, prefix_k, prefix_v, start, total, lower, upper),
          prefix_k.numel() ? prefix_k.size(2) : 0, q.size(0) * q.size(1), q.size(1), q.size(2), k.size(2),
          index.size(3), window, offset, static_cast<T>(scale)};
}

}  // namespace

std::vector<torch::Tensor> listed_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor index,
                                          torch::Tensor order, torch::Tensor run_first, torch::Tensor run_length,
                                          int64_t capacity, torch::Tensor key_real, int64_t window, int64_t offset,
                                          torch::Tensor prefix_k, torch::Tensor prefix_v, torch::Tensor start,
                                          torch::Tensor total, torch::Tensor lower, torch::Tensor upper,
                                          torch::Tensor out, double scale) {
  check_inputs(q, k, v, index, key_real);
  TORCH_CHECK(unit_rows(out) && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out: q's shape and dtype, unit stride along D");
  const int64_t D = q.size(3);
  auto lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "listed_forward", [&] {
    const auto in = listed_of<scalar_t>(q, k, v, index, runs_of(q, k, order, run_first, run_length, capacity),
                                        key_real, window, offset, prefix_k, prefix_v, start, total, lower, upper, scale);
    with_head_size(D, [&](auto fixed) {
      forward_kernel<scalar_t, decltype(fixed)::value>(in, rows_of<scalar_t>(out), lse.data_ptr<scalar_t>(), D);
    });
  });
  return {out, lse};
}

std::vector<torch::Tensor> listed_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor index,
                                           torch::Tensor order, torch::Tensor run_first, torch::Tensor run_length,
                                           int64_t capacity, torch::Tensor key_real, int64_t window, int64_t offset,
                                           torch::Tensor prefix_k, torch::Tensor prefix_v, torch::Tensor start,
                                           torch::Tensor total, torch::Tensor lower, torch::Tensor upper,
                                           torch::Tensor out, torch::Tensor lse, torch::Tensor dout,
                                           torch::Tensor dlse, torch::Tensor dq, torch::Tensor dk, torch::Tensor dv,
                                           double scale) {
  check_inputs(q, k, v, index, key_real);
  TORCH_CHECK(unit_rows(out) && unit_rows(dout) && out.sizes() == q.sizes() && dout.sizes() == q.sizes() &&
              lse.is_contiguous() && dlse.is_contiguous(), "out, dout: q's shape, unit stride along D; lse, dlse "
              "contiguous");
  // the caller's gradients (in the layout it wants them): dq's every row is written here, dk and dv accumulate
  // into zeros
  TORCH_CHECK(unit_rows(dq) && unit_rows(dk) && unit_rows(dv) && dq.sizes() == q.sizes() && dk.sizes() == k.sizes()
              && dv.sizes() == v.sizes(), "dq, dk, dv: q's, k's, v's shapes, unit stride along D");
  const int64_t D = q.size(3);
  auto dprefix_k = torch::zeros_like(prefix_k);
  auto dprefix_v = torch::zeros_like(prefix_v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "listed_backward", [&] {
    const auto in = listed_of<scalar_t>(q, k, v, index, runs_of(q, k, order, run_first, run_length, capacity),
                                        key_real, window, offset, prefix_k, prefix_v, start, total, lower, upper, scale);
    scalar_t* dpk = in.prefix_rows ? dprefix_k.data_ptr<scalar_t>() : nullptr;
    scalar_t* dpv = in.prefix_rows ? dprefix_v.data_ptr<scalar_t>() : nullptr;
    with_head_size(D, [&](auto fixed) {
      backward_kernel<scalar_t, decltype(fixed)::value>(
          in, rows_of<const scalar_t>(out), lse.data_ptr<scalar_t>(), rows_of<const scalar_t>(dout),
          dlse.data_ptr<scalar_t>(), rows_of<scalar_t>(dq), rows_of<scalar_t>(dk), rows_of<scalar_t>(dv), dpk, dpv, D);
    });
  });
  return {dprefix_k, dprefix_v};
}

// The summaries' logits alone, (B, H, N, C): q . (sum of keys) * scale / n + log n, -inf where n <= 0 (to rank
// groups; no gradient).
torch::Tensor summary_logits(torch::Tensor q, torch::Tensor prefix_k, torch::Tensor start, torch::Tensor total,
                             torch::Tensor lower, torch::Tensor upper, double scale) {
  TORCH_CHECK(q.device().is_cpu() && unit_rows(q), "q: a (B, H, N, D) CPU tensor, unit stride along D");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t rows = prefix_k.size(2), C = start.size(2);
  auto logits = torch::empty({B, H, N, C}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "summary_logits", [&] {
    const auto all = summaries_of<scalar_t>(q, prefix_k, prefix_k, start, total, lower, upper);
    const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
    const Rows<const scalar_t> qd = rows_of<const scalar_t>(q);
    scalar_t* out = logits.data_ptr<scalar_t>();
    at::parallel_for(0, B * H, 1, [&](int64_t first, int64_t last) {
      for (int64_t pair = first; pair < last; ++pair) {
        const Summaries<scalar_t> sums = all.at(pair, rows, N, D);
        for (int64_t i = 0; i < N; ++i) {
          const scalar_t* qi = qd.at(pair) + i * qd.row;
          scalar_t* oi = out + (pair * N + i) * C;
          for (int64_t c = 0; c < C; ++c) {
            int64_t r[4];
            const int64_t n = sums.rows(i, c, r);
            if (n <= 0) {
              oi[c] = minus_inf;
              continue;
            }
            const scalar_t* a = sums.prefix_k + r[0] * D; const scalar_t* b = sums.prefix_k + r[1] * D;
            const scalar_t* e = sums.prefix_k + r[2] * D; const scalar_t* f = sums.prefix_k + r[3] * D;
            scalar_t dot = 0;
            for (int64_t d = 0; d < D; ++d) dot += qi[d] * ((a[d] - b[d]) + (e[d] - f[d]));
            oi[c] = dot * static_cast<scalar_t>(scale) / scalar_t(n) + std::log(scalar_t(n));
          }
        }
      }
    });
  });
  return logits;
}

// ---------------------------------------------------------------------------------------------------------------
// Quest's bound on groups (cluster-select's selection="bound"), fused with the choice of the best groups.
//
// q (B, H, N, D) and its scale, k (B, H, N, D), ids (B, H, N) int64 in [0, G] (G: in no group). For query t and
// group g, the upper bound sum_d max(q_d hi_d, q_d lo_d) of q . k over g's members in the whole blocks of `block`
// positions outside t's window (causal: blocks < floor((t + 1 - window) / block); otherwise the larger of the bound
// over blocks < floor((t - window / 2) / block) and the bound over blocks >= ceil((t + window - window / 2) /
// block)); -inf where there is no such member. The blocks join a running max / min as the queries move (forward for
// the blocks before the window, backward for those after it): O(N D) to build, O(N G D) to score, no state per
// block. select > 0: the `select` groups of largest bound per query, best first, ties to the lower group id;
// select == 0: the bounds themselves (B, H, N, G).

inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

template <typename T, int64_t FixedD>
void bound_pairs(const Rows<const T>& q, const Rows<const T>& k, const int64_t* ids, T* bounds_out, int64_t* chosen_out, int64_t pairs,
                  int64_t N, int64_t head_dim, int64_t G, int64_t S, int64_t window, int64_t block, bool causal,
                 T scale, int64_t first_pair, int64_t last_pair) {
  const int64_t D = FixedD ? FixedD : head_dim;
  const T inf = std::numeric_limits<T>::infinity();
  const int64_t blocks = (N + block - 1) / block;
  {
    std::vector<T> hi(G * D), lo(G * D), other(G), q_up(D), q_down(D);
    std::vector<char> filled(G);
    std::vector<T> rows(causal ? G : N * G);  // non-causal: the bounds before the window, for the backward sweep
    std::vector<T> best_values(S > 0 ? S : 1);
    for (int64_t pair = first_pair; pair < last_pair; ++pair) {
      const T* qp = q.at(pair);
      const T* kp = k.at(pair);
      const int64_t* ip = ids + pair * N;
      auto reset = [&]() {
        std::fill(hi.begin(), hi.end(), -inf);
        std::fill(lo.begin(), lo.end(), inf);
        std::fill(filled.begin(), filled.end(), char(0));
      };
      auto merge_block = [&](int64_t b) {  // block b's members into their groups' running max and min
        const int64_t end = std::min((b + 1) * block, N);
        for (int64_t j = b * block; j < end; ++j) {
          const int64_t g = ip[j];
          if (g < 0 || g >= G) continue;
          T* __restrict__ h = hi.data() + g * D;
          T* __restrict__ l = lo.data() + g * D;
          const T* __restrict__ kj = kp + j * k.row;
          for (int64_t d = 0; d < D; ++d) {
            h[d] = std::max(h[d], kj[d]);
            l[d] = std::min(l[d], kj[d]);
          }
          filled[g] = 1;
        }
      };
      // max(q_d hi_d, q_d lo_d) is q_d hi_d where q_d >= 0 and q_d lo_d where q_d < 0 (hi_d >= lo_d): with the
      // query split once into its positive and negative parts, two fused multiply-adds per channel instead of two
      // products and a max (1.2x faster at D = 64). The other part's product is an exact 0 for a finite extreme (a
      // filled group's; an infinite key makes the attention itself NaN). The query is scaled here, as it is split,
      // not by the caller (a scaled copy of q: a 4,096-token layer's 33 MB of fresh pages, ~35 ms on this VM).
      auto score = [&](const T* __restrict__ qi, T* __restrict__ out) {
        T* __restrict__ up = q_up.data();
        T* __restrict__ down = q_down.data();
        for (int64_t d = 0; d < D; ++d) {
          const T scaled = qi[d] * scale;
          up[d] = std::max(scaled, T(0));
          down[d] = std::min(scaled, T(0));
        }
        for (int64_t g = 0; g < G; ++g) {
          if (!filled[g]) {
            out[g] = -inf;
            continue;
          }
          const T* __restrict__ h = hi.data() + g * D;
          const T* __restrict__ l = lo.data() + g * D;
          T sum = 0;
          for (int64_t d = 0; d < D; ++d) sum += up[d] * h[d] + down[d] * l[d];
          out[g] = sum;
        }
      };
      auto emit = [&](int64_t t, const T* row) {
        if (bounds_out != nullptr) std::copy(row, row + G, bounds_out + (pair * N + t) * G);
        if (chosen_out == nullptr) return;
        int64_t* best = chosen_out + (pair * N + t) * S;
        int64_t held = 0;  // best[0 .. held) by value, descending; equal values in order of arrival (lower id)
        for (int64_t g = 0; g < G; ++g) {
          const T value = row[g];
          if (held == S) {
            if (!(value > best_values[S - 1])) continue;
            held = S - 1;  // the worst leaves
          }
          int64_t p = held;
          while (p > 0 && best_values[p - 1] < value) {
            best_values[p] = best_values[p - 1];
            best[p] = best[p - 1];
            --p;
          }
          best_values[p] = value;
          best[p] = g;
          ++held;
        }
      };
      reset();
      int64_t joined = 0;  // blocks 0 .. joined - 1 are in the running state
      const int64_t before_shift = causal ? 1 - window : -(window / 2);
      for (int64_t t = 0; t < N; ++t) {
        const int64_t target = std::min(std::max(floor_div(t + before_shift, block), int64_t(0)), blocks);
        while (joined < target) merge_block(joined++);
        T* row = causal ? rows.data() : rows.data() + t * G;
        score(qp + t * q.row, row);
        if (causal) emit(t, row);
      }
      if (causal) continue;
      reset();
      int64_t from = blocks;  // blocks from .. blocks - 1 are in the running state
      const int64_t after_end = window - window / 2;
      for (int64_t t = N - 1; t >= 0; --t) {
        const int64_t target = std::min(std::max(floor_div(t + after_end + block - 1, block), int64_t(0)), blocks);
        while (from > target) merge_block(--from);
        T* row = rows.data() + t * G;
        score(qp + t * q.row, other.data());
        for (int64_t g = 0; g < G; ++g) row[g] = std::max(row[g], other[g]);
      }
      for (int64_t t = 0; t < N; ++t) emit(t, rows.data() + t * G);
    }
  }
}

// bound_kernel: bound_pairs over every pair, split over torch's threads. The body is a function of its own, not
// the parallel loop's lambda, so that its loops compile as they would inline whatever the loop does with it.
template <typename T, int64_t FixedD>
void bound_kernel(const Rows<const T>& q, const Rows<const T>& k, const int64_t* ids, T* bounds_out, int64_t* chosen_out, int64_t pairs,
                  int64_t N, int64_t head_dim, int64_t G, int64_t S, int64_t window, int64_t block, bool causal,
                  T scale) {
  at::parallel_for(0, pairs, 1, [&](int64_t first, int64_t last) {
    bound_pairs<T, FixedD>(q, k, ids, bounds_out, chosen_out, pairs, N, head_dim, G, S, window, block, causal, scale,
                           first, last);
  });
}

// selection="bound"'s groups (B, H, N, select), or with select == 0 the bounds (B, H, N, G); see bound_kernel.
torch::Tensor bound_select(torch::Tensor q, torch::Tensor k, torch::Tensor ids, int64_t groups, int64_t select,
                           int64_t window, int64_t block, bool causal, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && ids.device().is_cpu(), "bound_select runs on CPU tensors");
  TORCH_CHECK(unit_rows(q) && unit_rows(k) && q.sizes() == k.sizes() && q.scalar_type() == k.scalar_type(),
              "q and k: (B, H, N, D) tensors of one dtype, unit stride along D");
  TORCH_CHECK(ids.dim() == 3 && ids.size(0) == q.size(0) && ids.size(1) == q.size(1) && ids.size(2) == q.size(2) &&
              ids.is_contiguous() && ids.scalar_type() == torch::kLong, "ids: a contiguous (B, H, N) int64 tensor");
  TORCH_CHECK(groups >= 1 && select >= 0 && select <= groups && block >= 1 && window >= 0, "bad sizes");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  torch::Tensor out = select > 0 ? torch::empty({B, H, N, select}, ids.options())
                                 : torch::empty({B, H, N, groups}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "bound_select", [&] {
    scalar_t* bounds = select > 0 ? nullptr : out.data_ptr<scalar_t>();
    int64_t* chosen = select > 0 ? out.data_ptr<int64_t>() : nullptr;
    auto run = [&](auto kernel) {
      kernel(rows_of<const scalar_t>(q), rows_of<const scalar_t>(k), ids.data_ptr<int64_t>(), bounds, chosen, B * H, N, D,
             groups, select, window, block, causal, static_cast<scalar_t>(scale));
    };
    with_head_size(D, [&](auto fixed) { run(bound_kernel<scalar_t, decltype(fixed)::value>); });
  });
  return out;
}

// A float's bits as an unsigned integer of the same order (larger float, larger integer; -0 and +0 one key, as
// they compare equal): the sign bit flipped for positives, every bit for negatives. NaNs land above or below every
// number, deterministically.
template <typename T> struct OrderedKey;
template <> struct OrderedKey<float> { using type = uint32_t; };
template <> struct OrderedKey<double> { using type = uint64_t; };

template <typename T>
inline typename OrderedKey<T>::type ordered_key(T value) {
  using Key = typename OrderedKey<T>::type;
  constexpr int top = int(8 * sizeof(Key)) - 1;
  Key bits;
  std::memcpy(&bits, &value, sizeof(Key));
  bits = (bits << 1) == 0 ? Key(0) : bits;  // -0 -> +0 (a sum from +0 is +0, but -fno-signed-zeros may drop the +0)
  const Key negative = Key(0) - (bits >> top);  // all ones for a negative number
  return bits ^ (negative | (Key(1) << top));
}

// members="score": per query and selected group, its `keep` members of largest q . k among the slots of the
// group's runs (slots first[r] .. first[r] + length[r] - 1, runs r = s * per_group .. (s + 1) * per_group - 1 of
// group s; key order[slot]), read from k (B, H, Nk, D) at their positions (a run holds its members in position
// order, so the reads move forward through the pair's keys). Written in slot order, -1 after them where the group
// has fewer; equal scores at the cut keep the later position. A group with at most `keep` candidates is copied
// whole, without a score; a larger one is cut at its keep-th largest score (found bit by bit, branch-free). One
// pass per query, split over torch's threads by (pair, query); no gradient.
template <typename T, int64_t FixedD>
void top_members_kernel(const Rows<const T>& q, const Rows<const T>& k, const int64_t* order, const int64_t* first,
                        const int64_t* length, int64_t* out, int64_t pairs, int64_t N, int64_t Nk, int64_t head_dim,
                        int64_t runs, int64_t per_group, int64_t keep) {
  const int64_t D = FixedD ? FixedD : head_dim;  // a compile-time head size unrolls the dot products
  const int64_t groups = runs / per_group;
  at::parallel_for(0, pairs * N, 16, [&](int64_t begin, int64_t end) {
    using Key = typename OrderedKey<T>::type;
    std::vector<Key> keys;
    std::vector<int64_t> members, kept;  // the group's candidates' positions in slot order; the kept ones
    for (int64_t row = begin; row < end; ++row) {
      const int64_t pair = row / N;
      const T* __restrict__ qi = q.at(pair) + (row - pair * N) * q.row;
      const T* kp = k.at(pair);
      const int64_t* positions = order + pair * Nk;
      int64_t* dst = out + row * groups * keep;
      for (int64_t s = 0; s < groups; ++s) {
        members.clear();
        for (int64_t r = s * per_group; r < (s + 1) * per_group; ++r) {
          const int64_t* slot = positions + first[row * runs + r];
          members.insert(members.end(), slot, slot + length[row * runs + r]);
        }
        const int64_t count = static_cast<int64_t>(members.size());
        int64_t* group_out = dst + s * keep;
        if (count <= keep) {  // every candidate is kept: no score needed
          for (int64_t m = 0; m < keep; ++m) group_out[m] = m < count ? members[m] : int64_t(-1);
          continue;
        }
        keys.resize(count);
        Key* __restrict__ key = keys.data();
        for (int64_t c = 0; c < count; ++c) {
          const T* __restrict__ kj = kp + members[c] * k.row;
          T dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
          key[c] = ordered_key(dot);
        }
        // the cut: the keep-th largest key, built bit by bit from the top (the largest t with at least `keep` keys
        // >= t), each bit one branch-free counting pass -- a partition's compares mispredict at random; it stops
        // early once exactly `keep` keys lie at or above the bits so far. Kept: the keys above the cut and, of
        // those equal to it, the latest slots (the later positions); one pass writes them in slot order.
        Key cut = 0;
        for (int bit = int(8 * sizeof(Key)) - 1; bit >= 0; --bit) {
          const Key candidate = cut | (Key(1) << bit);
          int64_t at_least = 0;
          for (int64_t c = 0; c < count; ++c) at_least += key[c] >= candidate;
          if (at_least >= keep) cut = candidate;
          if (at_least == keep) break;
        }
        int64_t above = 0, equal = 0;
        for (int64_t c = 0; c < count; ++c) {
          above += key[c] > cut;
          equal += key[c] == cut;
        }
        const int64_t skip_equal = equal - (keep - above);  // the earliest equal keys that do not fit
        // branch-free: every candidate is written at the next place, which advances only for a kept one
        kept.resize(count + 1);
        int64_t m = 0, seen_equal = 0;
        for (int64_t c = 0; c < count; ++c) {
          const bool tie = key[c] == cut;
          const bool take = (key[c] > cut) | (tie & (seen_equal >= skip_equal));
          seen_equal += tie;
          kept[m] = members[c];
          m += take;
        }
        std::copy(kept.begin(), kept.begin() + keep, group_out);  // m == keep: `keep` keys lie at or above the cut
      }
    }
  });
}

torch::Tensor top_members(torch::Tensor q, torch::Tensor k, torch::Tensor order, torch::Tensor first,
                          torch::Tensor length, int64_t per_group, int64_t keep) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "top_members runs on CPU tensors");
  TORCH_CHECK(unit_rows(q) && unit_rows(k) && q.scalar_type() == k.scalar_type() && q.size(0) == k.size(0) &&
              q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "q (B, H, N, D) and k (B, H, Nk, D): unit stride along D, one dtype");
  TORCH_CHECK(order.is_contiguous() && first.is_contiguous() && length.is_contiguous() &&
              order.scalar_type() == torch::kLong && first.scalar_type() == torch::kLong &&
              length.scalar_type() == torch::kLong, "order, first, length: contiguous int64 tensors");
  TORCH_CHECK(per_group >= 1 && keep >= 1 && first.dim() == 4 && first.size(3) % per_group == 0 &&
              first.sizes() == length.sizes(), "runs: (B, H, N, groups * per_group)");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Nk = k.size(2);
  const int64_t runs = first.size(3);
  torch::Tensor out = torch::empty({B, H, N, runs / per_group * keep}, order.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "top_members", [&] {
    auto run = [&](auto kernel) {
      kernel(rows_of<const scalar_t>(q), rows_of<const scalar_t>(k), order.data_ptr<int64_t>(),
             first.data_ptr<int64_t>(), length.data_ptr<int64_t>(), out.data_ptr<int64_t>(), B * H, N, Nk, D, runs,
             per_group, keep);
    };
    with_head_size(D, [&](auto fixed) { run(top_members_kernel<scalar_t, decltype(fixed)::value>); });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("summary_logits", &summary_logits, "the summaries' logits alone (no gradient)");
  m.def("forward", &listed_forward, "listed attention: (out, lse)");
  m.def("backward", &listed_backward, "listed attention's backward into the given dq, dk, dv: (dprefix_k, dprefix_v)");
  m.def("bound_select", &bound_select, "selection='bound': the best groups per query (select > 0) or the bounds");
  m.def("top_members", &top_members, "members='score': each selected group's best-scoring members per query");
}
