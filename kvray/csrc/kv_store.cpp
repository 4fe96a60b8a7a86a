// store_kv for CPU pools: each of a step's K/V rows copied to its slot, both pools in one
// call. ATen's index_copy_ took 7-40 us a call on a decode step's rows (two calls a layer),
// most of it its own setup; this is a memcpy per row.
//
//   store_kv(k_pool, v_pool, k, v, loc) -> bool
//     k_pool/v_pool [slots, H, D] contiguous; k/v [T, H, D], each row's H x D contiguous
//     (a view of a wider projection is fine); loc int64 [T], every entry in [0, slots).
//   False (nothing written) where the inputs do not fit that shape (the caller then uses
//   index_copy_); an out-of-range slot is an error, checked before anything is written.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace {

bool rows_contiguous(const torch::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2);
}

}  // namespace

bool store_kv(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor k, torch::Tensor v,
              torch::Tensor loc) {
  if (!k_pool.is_cpu() || !k_pool.is_contiguous() || !v_pool.is_contiguous() || k_pool.dim() != 3 ||
      v_pool.sizes() != k_pool.sizes() || k.sizes() != v.sizes() || k.dim() != 3 ||
      k.size(1) != k_pool.size(1) || k.size(2) != k_pool.size(2) ||
      k.scalar_type() != k_pool.scalar_type() || v.scalar_type() != k_pool.scalar_type() ||
      v_pool.scalar_type() != k_pool.scalar_type() || !rows_contiguous(k) || !rows_contiguous(v) ||
      loc.scalar_type() != torch::kInt64 || !loc.is_contiguous() || loc.dim() != 1 ||
      loc.size(0) != k.size(0) || !loc.is_cpu() || !k.is_cpu() || !v.is_cpu())
    return false;
  const int64_t T = k.size(0), slots = k_pool.size(0);
  const int64_t* l = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(l[t] >= 0 && l[t] < slots, "store_kv: slot ", l[t], " outside the pool of ", slots);
  const int64_t row = k.size(1) * k.size(2) * k.element_size();
  auto* kp = static_cast<char*>(k_pool.data_ptr());
  auto* vp = static_cast<char*>(v_pool.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t kst = k.stride(0) * k.element_size(), vst = v.stride(0) * v.element_size();
  // A decode step's few rows stay on the calling thread; a prompt's are split.
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kp + l[t] * row, ks + t * kst, row);
      std::memcpy(vp + l[t] * row, vs + t * vst, row);
    }
  });
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("store_kv", &store_kv, "a step's K/V rows into their pool slots");
}
