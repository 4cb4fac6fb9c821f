// What the C++ kernels of ops/csrc share: the rows of a (B, H, L, D) tensor read in place, and the head sizes their
// loops unroll at compile time. The build (clusterformer/ops/extensions.py) hashes this header with each source that
// includes it, so an edit here rebuilds them.

#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

namespace clusterformer {

// A (B, H, L, D) tensor's rows with unit stride along D and any other strides (q, k, v as views of the layer's fused
// projection; an output or gradient in the (B, L, H, D) order the heads are joined in): row i of (b, h) pair `pair`
// at at(pair) + i * row.
template <typename T>
struct Rows {
  T* data = nullptr;
  int64_t batch = 0, head = 0, row = 0, H = 1;
  inline T* at(int64_t pair) const { return data + (pair / H) * batch + (pair % H) * head; }
};

// rows_of<const T> to read, rows_of<T> to write
template <typename T>
Rows<T> rows_of(const torch::Tensor& t) {
  return {t.data_ptr<std::remove_const_t<T>>(), t.stride(0), t.stride(1), t.stride(2), t.size(1)};
}

// Whether t is 4-D with unit stride along its last dim (any stride where it has one element).
inline bool unit_rows(const torch::Tensor& t) { return t.dim() == 4 && (t.size(3) <= 1 || t.stride(3) == 1); }

// Calls run with std::integral_constant<int64_t, D> for the head sizes the kernels unroll at compile time (16, 32,
// 64, 128), and with std::integral_constant<int64_t, 0> for any other (the loops then read D at run time).
template <typename F>
void with_head_size(int64_t D, F&& run) {
  switch (D) {
    case 16: run(std::integral_constant<int64_t, 16>{}); break;
    case 32: run(std::integral_constant<int64_t, 32>{}); break;
    case 64: run(std::integral_constant<int64_t, 64>{}); break;
    case 128: run(std::integral_constant<int64_t, 128>{}); break;
    default: run(std::integral_constant<int64_t, 0>{});
  }
}

}  // namespace clusterformer
