// What kvray's fused elementwise kernels share, whatever vector width they compute in
// (fused_ops.cpp: AVX-512; fused_ops_avx2.cpp: AVX2): scalar conversions, row addressing,
// RMSNorm's sum of squares in ATen's order, and which tensors they serve. Needs AVX2.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <vector>

namespace kvray_fused {

using bf16 = uint16_t;  // raw bfloat16 bits; a T below is bf16 or float, computed as float

// ---- scalar conversions ---------------------------------------------------------------------

inline float to_float(bf16 h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(float f) { return f; }

// float -> bfloat16 as c10::BFloat16 does it: round to nearest even, NaN stays NaN,
// denormals kept.
inline bf16 bf16_of(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return bf16(u >> 16);
}
template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, bf16>) {
    return bf16_of(f);
  } else {
    return f;
  }
}
template <typename T>
inline float round_to(float f) {  // f rounded to T's precision
  return to_float(from_float<T>(f));
}

// ---- rows ---------------------------------------------------------------------------------

// Rows of a [A, B, D] tensor whose last dim is contiguous: row r is (r / B, r % B).
template <typename T>
struct Rows {
  T* base;
  int64_t B, sA, sB;
  explicit Rows(const torch::Tensor& t)
      : base(reinterpret_cast<T*>(t.data_ptr())), B(t.size(1)), sA(t.stride(0)), sB(t.stride(1)) {}
  T* operator[](int64_t r) const { return base + (r / B) * sA + (r % B) * sB; }
};

// Rows per task: enough work per task that small batches stay on the calling thread
// (waking the pool costs more than they take).
inline int64_t grain(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
}

// ---- RMSNorm's sum of squares ---------------------------------------------------------------

inline int64_t ceil_log2(int64_t x) {  // c10 utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(uint64_t(x - 1));
}

// sum(x.float() ** 2) over one row, added in exactly the order of ATen's CPU sum over a
// contiguous last dim (SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum,
// 4-way ILP, a 4-level cascade, then the lanes one by one after the scalar tail), so the
// mean matches to the bit. ATen registers its sum kernel with REGISTER_DISPATCH, which
// skips AVX-512: on AVX-512 machines it runs the AVX2 build, whose vectors have 8 lanes.
inline __m256 load8(const bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  constexpr int64_t kLanes = 8, kLevels = 4, kIlp = 4;
  if (n < kLanes) {  // too short for a vector: ATen's scalar_inner_sum, 4-way ILP
    float p[kIlp] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto sq1 = [&](int64_t k) {
      const float a = to_float(x[k]);
      return a * a;
    };
    const int64_t nilp = n / kIlp;  // 0 or 1: far below one cascade level
    for (int64_t i = 0; i < nilp; ++i)
      for (int64_t k = 0; k < kIlp; ++k) p[k] += sq1(i * kIlp + k);
    for (int64_t k = nilp * kIlp; k < n; ++k) p[0] += sq1(k);
    for (int64_t k = 1; k < kIlp; ++k) p[0] += p[k];
    return p[0];
  }
  const int64_t nvec = n / kLanes, nilp = nvec / kIlp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(nilp) / kLevels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  auto sq = [&](int64_t v) {
    __m256 a = load8(x + kLanes * v);
    return _mm256_mul_ps(a, a);
  };
  __m256 acc[kLevels][kIlp];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + level_step <= nilp) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], sq(i * kIlp + k));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < nilp; ++i)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], sq(i * kIlp + k));
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = nilp * kIlp; v < nvec; ++v) acc[0][0] = _mm256_add_ps(acc[0][0], sq(v));
  for (int64_t k = 1; k < kIlp; ++k) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
  float total = 0.0f;
  for (int64_t k = nvec * kLanes; k < n; ++k) {
    const float a = to_float(x[k]);
    const float a2 = a * a;
    total += a2;
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, acc[0][0]);
  for (int64_t k = 0; k < kLanes; ++k) total += lanes[k];
  return total;
}

// 1 / sqrt(mean(x^2) + eps), as torch computes it: the sum above, divided by n, eps added,
// then sqrt and division (each correctly rounded, as ATen's rsqrt is).
template <typename T>
inline float inv_rms(const T* x, int64_t n, float eps) {
  const float mean = sum_squares(x, n) / float(n);
  return 1.0f / std::sqrt(mean + eps);
}

// ---- what the kernels serve -----------------------------------------------------------------

// Tensors of one dtype (bfloat16 or float32), on the CPU, last dim contiguous, none that
// autograd must see.
inline bool servable(std::initializer_list<const torch::Tensor*> ts) {
  const auto dtype = (*ts.begin())->scalar_type();
  if (dtype != torch::kBFloat16 && dtype != torch::kFloat32) return false;
  const bool grad = at::GradMode::is_enabled();
  for (const auto* t : ts) {
    if (!t->device().is_cpu() || t->scalar_type() != dtype || t->dim() == 0 || t->stride(-1) != 1 ||
        (grad && t->requires_grad()))
      return false;
  }
  return true;
}

// x [..., D] as a [A, B, D] view, if there is one.
inline std::optional<torch::Tensor> rows3(const torch::Tensor& x) {
  if (x.dim() == 3) return x;
  if (x.dim() == 2) return x.unsqueeze(0);
  if (x.dim() == 1) return x.view({1, 1, x.size(0)});
  if (x.is_contiguous()) return x.view({-1, x.size(-2), x.size(-1)});
  return std::nullopt;
}

inline bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }

// What each op serves, the same for every build: the tensors above, and the shapes it takes.
inline bool norm_servable(const torch::Tensor& x, const torch::Tensor& w) {
  return servable({&x, &w}) && w.dim() == 1 && w.size(0) == x.size(-1);
}
inline bool add_norm_servable(const torch::Tensor& x, const torch::Tensor& res,
                              const torch::Tensor& w) {
  return servable({&x, &res, &w}) && x.sizes() == res.sizes() && w.dim() == 1 &&
         w.size(0) == x.size(-1);
}
inline bool silu_mul_servable(const torch::Tensor& gu) {
  return servable({&gu}) && gu.dim() == 2 && gu.size(1) % 2 == 0;
}
inline bool rotary_servable(const torch::Tensor& x, const torch::Tensor& cos,
                            const torch::Tensor& sin) {
  if (!servable({&x, &cos, &sin}) || x.dim() != 3 || x.size(2) % 2 != 0 ||
      at::has_internal_overlap(x) == at::MemOverlap::Yes)  // e.g. an expanded x
    return false;
  for (const auto* t : {&cos, &sin})
    if (t->dim() != 2 || t->size(0) != x.size(0) || t->size(1) != x.size(2)) return false;
  return true;
}
inline bool argmax_servable(const torch::Tensor& x) {
  return servable({&x}) && x.dim() == 2 && x.size(1) > 0;
}
inline bool mask_rows_servable(const torch::Tensor& x, const torch::Tensor& bitmask,
                               const std::vector<int64_t>& rows) {
  if (!servable({&x}) || x.dim() != 2 || bitmask.scalar_type() != torch::kInt32 ||
      !bitmask.device().is_cpu() || bitmask.dim() != 2 || bitmask.stride(1) != 1 ||
      bitmask.size(0) < x.size(0) || bitmask.size(1) * 32 < x.size(1))
    return false;
  for (const int64_t r : rows) {
    if (r < 0 || r >= x.size(0)) return false;
  }
  return true;
}

}  // namespace kvray_fused
