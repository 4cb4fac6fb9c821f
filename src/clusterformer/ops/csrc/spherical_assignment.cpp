// Online spherical k-means' per-token work in one pass per token (CPU): each key's nearest unit centroid, its squared
// distance to it (the commitment loss, differentiable in the key) and the per-cluster sums of the unit keys (the EMA
// update's statistics).
//
// k (B, H, N, D), unit stride along D (a view of a fused projection is read in place); mu (H, C, D) unit centroids; bias (H, C) or an empty tensor; real (B, N) bool or an empty tensor
// (every token real). With u = k / max(|k|, 1e-12) (torch.nn.functional.normalize):
//   id[b, h, n]  = argmax_c (u . mu[h, c] + bias[h, c])      the first of equal maxima, as torch.argmax
//   gap[b, h, n] = |u - mu[h, id]|^2
//   sums[b, h, c] = sum of u over the real tokens n of (b, h) with id = c; counts[b, h, c] their number
// The backward takes the gradient of gap: dk = g (2 / max(|k|, eps)) ((u - mu_id) - [|k| >= eps] u (u . (u - mu_id))),
// torch's gradient of normalize followed by the squared distance.
// Work is split over the (b, h) pairs; each token's sums run in the same order whatever the batch holds.
// Python side: clusterformer/ops/spherical.py (validation, autograd, the reference composition).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "rows.h"

namespace {

using clusterformer::Rows;
using clusterformer::rows_of;
using clusterformer::unit_rows;
using clusterformer::with_head_size;

template <typename T, int64_t FixedD>
void assign_kernel(const Rows<const T>& k, const T* mu, const T* mu_t, const T* bias, const bool* real, int64_t* ids, T* gap,
                   T* sums, T* counts, int64_t B, int64_t H, int64_t N, int64_t head_dim, int64_t C, T eps) {
  const int64_t D = FixedD ? FixedD : head_dim;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> unit(D), cosines(C);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / H, h = pair % H;
      const T* centroids = mu + h * C * D;
      const T* by_dim = mu_t + h * D * C;  // (D, C): the cosines accumulate over d, vectorised over the clusters
      for (int64_t n = 0; n < N; ++n) {
        const T* __restrict__ x = k.at(pair) + n * k.row;
        T square = 0;
        for (int64_t d = 0; d < D; ++d) square += x[d] * x[d];
        const T denominator = std::max(std::sqrt(square), eps);
        T* __restrict__ u = unit.data();
        for (int64_t d = 0; d < D; ++d) u[d] = x[d] / denominator;
        T* __restrict__ cos = cosines.data();
        std::fill(cos, cos + C, T(0));
        for (int64_t d = 0; d < D; ++d) {
          const T ud = u[d];
          const T* __restrict__ row = by_dim + d * C;
          for (int64_t c = 0; c < C; ++c) cos[c] += ud * row[c];
        }
        if (bias != nullptr) {
          for (int64_t c = 0; c < C; ++c) cos[c] += bias[h * C + c];
        }
        int64_t best = 0;
        for (int64_t c = 1; c < C; ++c) best = cos[c] > cos[best] ? c : best;
        ids[pair * N + n] = best;
        const T* __restrict__ m = centroids + best * D;
        T distance = 0;
        for (int64_t d = 0; d < D; ++d) distance += (u[d] - m[d]) * (u[d] - m[d]);
        gap[pair * N + n] = distance;
        if (real == nullptr || real[b * N + n]) {
          T* __restrict__ s = sums + (pair * C + best) * D;
          for (int64_t d = 0; d < D; ++d) s[d] += u[d];
          counts[pair * C + best] += T(1);
        }
      }
    }
  });
}

template <typename T, int64_t FixedD>
void gap_backward_kernel(const Rows<const T>& k, const T* mu, const int64_t* ids, const T* grad, const Rows<T>& dk, int64_t pairs, int64_t H,
                         int64_t N, int64_t head_dim, int64_t C, T eps) {
  const int64_t D = FixedD ? FixedD : head_dim;
  at::parallel_for(0, pairs * N, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> unit(D);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = (row / N) % H;
      const T* __restrict__ x = k.at(row / N) + (row % N) * k.row;
      const T* __restrict__ m = mu + (h * C + ids[row]) * D;
      T* __restrict__ out = dk.at(row / N) + (row % N) * dk.row;
      T square = 0;
      for (int64_t d = 0; d < D; ++d) square += x[d] * x[d];
      const T norm = std::sqrt(square);
      const T denominator = std::max(norm, eps);
      T* __restrict__ u = unit.data();
      for (int64_t d = 0; d < D; ++d) u[d] = x[d] / denominator;
      // d gap / d u = 2 (u - m); through u = x / max(|x|, eps): (g_u - u (g_u . u) [|x| >= eps]) / max(|x|, eps)
      T along = 0;
      if (norm >= eps) {
        for (int64_t d = 0; d < D; ++d) along += (u[d] - m[d]) * u[d];
      }
      const T scale = T(2) * grad[row] / denominator;
      for (int64_t d = 0; d < D; ++d) out[d] = scale * ((u[d] - m[d]) - along * u[d]);
    }
  });
}

void check_inputs(const torch::Tensor& k, const torch::Tensor& mu) {
  TORCH_CHECK(k.device().is_cpu() && mu.device().is_cpu(), "spherical assignment runs on CPU tensors");
  TORCH_CHECK(unit_rows(k) && mu.dim() == 3 && mu.is_contiguous() &&
              k.scalar_type() == mu.scalar_type() && mu.size(0) == k.size(1) && mu.size(2) == k.size(3),
              "k (B, H, N, D) with unit stride along D and contiguous centroids (H, C, D), one dtype");
}

std::vector<torch::Tensor> assign(torch::Tensor k, torch::Tensor mu, torch::Tensor bias, torch::Tensor real,
                                  double eps) {
  check_inputs(k, mu);
  const int64_t B = k.size(0), H = k.size(1), N = k.size(2), D = k.size(3), C = mu.size(1);
  TORCH_CHECK(C >= 1, "at least one centroid");
  TORCH_CHECK(bias.numel() == 0 || (bias.is_contiguous() && bias.scalar_type() == k.scalar_type() &&
                                    bias.dim() == 2 && bias.size(0) == H && bias.size(1) == C), "bias (H, C)");
  TORCH_CHECK(real.numel() == 0 || (real.is_contiguous() && real.scalar_type() == torch::kBool && real.dim() == 2 &&
                                    real.size(0) == B && real.size(1) == N), "real (B, N) bool");
  torch::Tensor ids = torch::empty({B, H, N}, k.options().dtype(torch::kLong));
  torch::Tensor gap = torch::empty({B, H, N}, k.options());
  torch::Tensor sums = torch::zeros({B, H, C, D}, k.options());
  torch::Tensor counts = torch::zeros({B, H, C}, k.options());
  torch::Tensor mu_t = mu.transpose(1, 2).contiguous();
  AT_DISPATCH_FLOATING_TYPES(k.scalar_type(), "spherical_assign", [&] {
    auto run = [&](auto kernel) {
      kernel(rows_of<const scalar_t>(k), mu.data_ptr<scalar_t>(), mu_t.data_ptr<scalar_t>(),
             bias.numel() ? bias.data_ptr<scalar_t>() : nullptr, real.numel() ? real.data_ptr<bool>() : nullptr,
             ids.data_ptr<int64_t>(), gap.data_ptr<scalar_t>(), sums.data_ptr<scalar_t>(),
             counts.data_ptr<scalar_t>(), B, H, N, D, C, static_cast<scalar_t>(eps));
    };
    with_head_size(D, [&](auto fixed) { run(assign_kernel<scalar_t, decltype(fixed)::value>); });
  });
  return {ids, gap, sums, counts};
}

torch::Tensor gap_backward(torch::Tensor k, torch::Tensor mu, torch::Tensor ids, torch::Tensor grad, double eps) {
  check_inputs(k, mu);
  const int64_t B = k.size(0), H = k.size(1), N = k.size(2), D = k.size(3), C = mu.size(1);
  TORCH_CHECK(ids.is_contiguous() && ids.scalar_type() == torch::kLong && ids.dim() == 3 && ids.size(0) == B &&
              ids.size(1) == H && ids.size(2) == N, "ids (B, H, N) int64");
  TORCH_CHECK(grad.is_contiguous() && grad.scalar_type() == k.scalar_type() && grad.sizes() == ids.sizes(),
              "grad (B, H, N)");
  // laid out as (B, N, H, D), the order of the projection's rows: the engine adds it to the attention's gradient of
  // k, a view of the projection's gradient, faster than a (B, H, N, D) tensor
  torch::Tensor dk = torch::empty({B, N, H, D}, k.options()).transpose(1, 2);
  AT_DISPATCH_FLOATING_TYPES(k.scalar_type(), "spherical_gap_backward", [&] {
    auto run = [&](auto kernel) {
      kernel(rows_of<const scalar_t>(k), mu.data_ptr<scalar_t>(), ids.data_ptr<int64_t>(), grad.data_ptr<scalar_t>(),
             rows_of<scalar_t>(dk), B * H, H, N, D, C, static_cast<scalar_t>(eps));
    };
    with_head_size(D, [&](auto fixed) { run(gap_backward_kernel<scalar_t, decltype(fixed)::value>); });
  });
  return dk;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("assign", &assign, "nearest unit centroids: (ids, gap, per-pair sums, per-pair counts)");
  m.def("gap_backward", &gap_backward, "the gradient of the squared distances to the assigned centroids");
}
