// Softmax attention of each query over its own list of keys, forward and backward in one pass each (CPU).
//
// q (B, H, N, D); k, v (B, H, Nk, D); index (B, H, N, M) int64, the key positions query (b, h, i) reads, -1 for
// none; besides them, query i reads the `window` keys at positions i - offset .. i - offset + window - 1 that lie in
// [0, Nk) and are real (key_real (B, Nk) bool; an empty tensor: every key is real), so that a contiguous window
// needs no index. out[b, h, i] = sum_m p_m v[key_m] with p = softmax_m(q . k[key_m] * scale) over those keys;
// lse[b, h, i] = log sum_m exp(q . k[key_m] * scale) (-inf for a query without keys, whose output is 0).
// The backward takes the gradients of out and lse: ds_m = p_m (dout . v_m - dout . out + dlse).
// Work is split over the (b, h) pairs, so the scatter of dk and dv into one pair's keys has no race.
// Python side: clusterformer/ops/listed_attention.py (validation, autograd, the reference, the build).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

// Calls visit(m, j) for the keys query i reads: first its window (m = 0 .. window - 1; j = -1 where the position
// is outside [0, Nk) or padding), then its listed keys (m = window .. window + M - 1; j = -1 where none).
template <typename F>
inline void for_each_key(int64_t i, const int64_t* keys, int64_t M, int64_t window, int64_t offset, int64_t Nk,
                         const bool* real, F&& visit) {
  const int64_t first = i - offset;
  for (int64_t w = 0; w < window; ++w) {
    const int64_t j = first + w;
    visit(w, (j < 0 || j >= Nk || (real != nullptr && !real[j])) ? int64_t(-1) : j);
  }
  for (int64_t m = 0; m < M; ++m) visit(window + m, keys[m]);
}

template <typename T, int64_t FixedD>
void forward_kernel(const T* q, const T* k, const T* v, const int64_t* index, const bool* key_real, T* out, T* lse,
                    int64_t pairs, int64_t H, int64_t N, int64_t Nk, int64_t M, int64_t head_dim, int64_t window,
                    int64_t offset, T scale) {
  const int64_t D = FixedD ? FixedD : head_dim;  // a compile-time head size unrolls the loops over channels
  const T minus_inf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, pairs, 1, [&](int64_t first, int64_t last) {
    std::vector<T> scores(window + M);
    for (int64_t pair = first; pair < last; ++pair) {
      const T* qp = q + pair * N * D;
      const T* kp = k + pair * Nk * D;
      const T* vp = v + pair * Nk * D;
      const int64_t* ip = index + pair * N * M;
      const bool* real = key_real == nullptr ? nullptr : key_real + (pair / H) * Nk;
      T* op = out + pair * N * D;
      T* lp = lse + pair * N;
      for (int64_t i = 0; i < N; ++i) {
        const T* __restrict__ qi = qp + i * D;
        T* __restrict__ oi = op + i * D;
        T largest = minus_inf;
        for_each_key(i, ip + i * M, M, window, offset, Nk, real, [&](int64_t m, int64_t j) {
          if (j < 0) {
            scores[m] = minus_inf;
            return;
          }
          const T* __restrict__ kj = kp + j * D;
          T dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
          scores[m] = dot * scale;
          if (scores[m] > largest) largest = scores[m];
        });
        for (int64_t d = 0; d < D; ++d) oi[d] = 0;
        if (largest == minus_inf) {  // no key: output 0, lse -inf
          lp[i] = minus_inf;
          continue;
        }
        T total = 0;
        for_each_key(i, ip + i * M, M, window, offset, Nk, real, [&](int64_t m, int64_t j) {
          if (j < 0) return;
          const T p = std::exp(scores[m] - largest);
          total += p;
          const T* __restrict__ vj = vp + j * D;
          for (int64_t d = 0; d < D; ++d) oi[d] += p * vj[d];
        });
        const T inverse = T(1) / total;
        for (int64_t d = 0; d < D; ++d) oi[d] *= inverse;
        lp[i] = largest + std::log(total);
      }
    }
  });
}

template <typename T, int64_t FixedD>
void backward_kernel(const T* q, const T* k, const T* v, const int64_t* index, const bool* key_real, const T* out,
                     const T* lse, const T* dout, const T* dlse, T* dq, T* dk, T* dv, int64_t pairs, int64_t H,
                     int64_t N, int64_t Nk, int64_t M, int64_t head_dim, int64_t window, int64_t offset, T scale) {
  const int64_t D = FixedD ? FixedD : head_dim;
  const T minus_inf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, pairs, 1, [&](int64_t first, int64_t last) {
    // the query's row, its output gradient and its dq in buffers of their own: no aliasing with dk, dv
    std::vector<T> q_buffer(D), g_buffer(D), dq_buffer(D);
    T* __restrict__ qi = q_buffer.data();
    T* __restrict__ gi = g_buffer.data();
    T* __restrict__ dqi = dq_buffer.data();
    for (int64_t pair = first; pair < last; ++pair) {
      const T* qp = q + pair * N * D;
      const T* kp = k + pair * Nk * D;
      const T* vp = v + pair * Nk * D;
      const int64_t* ip = index + pair * N * M;
      const bool* real = key_real == nullptr ? nullptr : key_real + (pair / H) * Nk;
      const T* op = out + pair * N * D;
      const T* lp = lse + pair * N;
      const T* gp = dout + pair * N * D;
      const T* glp = dlse + pair * N;
      T* dqp = dq + pair * N * D;
      T* dkp = dk + pair * Nk * D;
      T* dvp = dv + pair * Nk * D;
      for (int64_t i = 0; i < N; ++i) {
        const T log_total = lp[i];
        if (log_total == minus_inf) continue;  // no key: no gradient
        const T* oi = op + i * D;
        T delta = 0;  // dout . out
        for (int64_t d = 0; d < D; ++d) {
          qi[d] = qp[i * D + d] * scale;
          gi[d] = gp[i * D + d];
          dqi[d] = 0;
          delta += gi[d] * oi[d];
        }
        const T shift = glp[i] - delta;
        for_each_key(i, ip + i * M, M, window, offset, Nk, real, [&](int64_t, int64_t j) {
          if (j < 0) return;
          const T* __restrict__ kj = kp + j * D;
          const T* __restrict__ vj = vp + j * D;
          T* __restrict__ dkj = dkp + j * D;
          T* __restrict__ dvj = dvp + j * D;
          T score = 0, dp = 0;
          for (int64_t d = 0; d < D; ++d) {
            score += qi[d] * kj[d];
            dp += gi[d] * vj[d];
          }
          const T p = std::exp(score - log_total);
          const T ds = p * (dp + shift);
          for (int64_t d = 0; d < D; ++d) dvj[d] += p * gi[d];
          for (int64_t d = 0; d < D; ++d) dkj[d] += ds * qi[d];
          for (int64_t d = 0; d < D; ++d) dqi[d] += ds * kj[d];
        });
        for (int64_t d = 0; d < D; ++d) dqp[i * D + d] = dqi[d] * scale;
      }
    }
  });
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& index,
                  const torch::Tensor& key_real) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && index.device().is_cpu(),
              "listed attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && index.dim() == 4, "expected 4-D q, k, v and index");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && index.is_contiguous(),
              "expected contiguous tensors");
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

const bool* real_or_null(const torch::Tensor& key_real) {
  return key_real.numel() == 0 ? nullptr : key_real.data_ptr<bool>();
}

}  // namespace

std::vector<torch::Tensor> listed_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor index,
                                          torch::Tensor key_real, int64_t window, int64_t offset, double scale) {
  check_inputs(q, k, v, index, key_real);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Nk = k.size(2), M = index.size(3);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({B, H, N}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "listed_forward", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), index.data_ptr<int64_t>(),
             real_or_null(key_real), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), B * H, H, N, Nk, M, D,
             window, offset, static_cast<scalar_t>(scale));
    };
    switch (D) {
      case 16: run(forward_kernel<scalar_t, 16>); break;
      case 32: run(forward_kernel<scalar_t, 32>); break;
      case 64: run(forward_kernel<scalar_t, 64>); break;
      case 128: run(forward_kernel<scalar_t, 128>); break;
      default: run(forward_kernel<scalar_t, 0>);
    }
  });
  return {out, lse};
}

std::vector<torch::Tensor> listed_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor index,
                                           torch::Tensor key_real, int64_t window, int64_t offset, torch::Tensor out,
                                           torch::Tensor lse, torch::Tensor dout, torch::Tensor dlse, double scale) {
  check_inputs(q, k, v, index, key_real);
  TORCH_CHECK(out.is_contiguous() && lse.is_contiguous() && dout.is_contiguous() && dlse.is_contiguous(),
              "expected contiguous tensors");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Nk = k.size(2), M = index.size(3);
  auto dq = torch::zeros_like(q);
  auto dk = torch::zeros_like(k);
  auto dv = torch::zeros_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "listed_backward", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), index.data_ptr<int64_t>(),
             real_or_null(key_real), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(),
             dlse.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
             B * H, H, N, Nk, M, D, window, offset, static_cast<scalar_t>(scale));
    };
    switch (D) {
      case 16: run(backward_kernel<scalar_t, 16>); break;
      case 32: run(backward_kernel<scalar_t, 32>); break;
      case 64: run(backward_kernel<scalar_t, 64>); break;
      case 128: run(backward_kernel<scalar_t, 128>); break;
      default: run(backward_kernel<scalar_t, 0>);
    }
  });
  return {dq, dk, dv};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &listed_forward, "listed attention: (out, lse)");
  m.def("backward", &listed_backward, "listed attention's backward: (dq, dk, dv)");
}
