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
#include <tuple>
#include <type_traits>
#include <vector>

#include "bf16_round.h"
#include "fused_common.h"

// Built with -ffp-contract=off: a multiply followed by an add must round twice, as the
// separate torch ops do, never fuse into one FMA. FMAs are written explicitly where ATen
// (SLEEF) uses them.

namespace {

using kvray_fused::add_norm_servable;
using kvray_fused::argmax_servable;
using kvray_fused::bf16;
using kvray_fused::bf16_of;
using kvray_fused::from_float;
using kvray_fused::grain;
using kvray_fused::inv_rms;
using kvray_fused::is_bf16;
using kvray_fused::mask_rows_servable;
using kvray_fused::norm_servable;
using kvray_fused::rotary_servable;
using kvray_fused::round_to;
using kvray_fused::Rows;
using kvray_fused::rows3;
using kvray_fused::silu_mul_servable;
using kvray_fused::to_float;

// ---- loads and conversions ------------------------------------------------------------------

inline __m512 bf16_to_float(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const bf16* p) {
  return bf16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  return bf16_to_float(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1); }

// ---- rounding 16 floats to bfloat16 ---------------------------------------------------------

using kvray_bf16::rne_bits;
using kvray_bf16::to_bf16;

// v rounded to T's precision, kept as float: what a T tensor holding v reads back as.
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return _mm512_castsi512_ps(_mm512_and_si512(rne_bits(v), _mm512_set1_epi32(0xFFFF0000)));
  } else {
    return v;
  }
}

inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16(v)); }
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

// ---- RMSNorm ----------------------------------------------------------------------------

// out = weight * (x * r).to(T), the transformers expression: in bf16 the normalised value
// is rounded to bf16 before the product with the weight, which is rounded again.
template <typename T>
inline void scale_row(const T* x, const T* w, T* out, int64_t n, float r) {
  const __m512 rv = _mm512_set1_ps(r);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 y = round_to<T>(_mm512_mul_ps(load16(x + j), rv));
    store16(out + j, _mm512_mul_ps(load16(w + j), y));
  }
  if (j < n) {
    const __mmask16 m = tail_mask(n - j);
    const __m512 y = round_to<T>(_mm512_mul_ps(load16(x + j, m), rv));
    store16(out + j, _mm512_mul_ps(load16(w + j, m), y), m);
  }
}

// out [A, B, D] contiguous.
template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, float eps) {
  const Rows<const T> xr(x);
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  const int64_t rows = x.size(0) * x.size(1), n = x.size(2);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = xr[i];
      const float r = inv_rms(xi, n, eps);
      scale_row(xi, wp, op + i * n, n, r);
    }
  });
}

// new_res = x + res (rounded to T), out = rms_norm(new_res), row by row while the row is in
// L1. out and new_res [A, B, D] contiguous.
template <typename T>
void add_rms_norm_impl(const torch::Tensor& x, const torch::Tensor& res, const torch::Tensor& w,
                       torch::Tensor& out, torch::Tensor& new_res, float eps) {
  const Rows<const T> xr(x), rr(res);
  T* op = reinterpret_cast<T*>(out.data_ptr());
  T* sp = reinterpret_cast<T*>(new_res.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  const int64_t rows = x.size(0) * x.size(1), n = x.size(2);
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* a = xr[i];
      const T* b = rr[i];
      T* s = sp + i * n;
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) store16(s + j, _mm512_add_ps(load16(a + j), load16(b + j)));
      if (j < n) {
        const __mmask16 m = tail_mask(n - j);
        store16(s + j, _mm512_add_ps(load16(a + j, m), load16(b + j, m)), m);
      }
      const float r = inv_rms(s, n, eps);
      scale_row(s, wp, op + i * n, n, r);
    }
  });
}

// ---- SiLU(gate) * up ------------------------------------------------------------------------

// SLEEF's Sleef_expf16_u10 (sleefsimdsp.c xexpf, AVX-512F helpers), which ATen's
// Vectorized<float>::exp() calls: same operations, same order, same FMAs.
inline __m512 sleef_expf16_u10(__m512 d) {
  const float kR_LN2f = 1.442695040888963407359924681001892137426645954152985934135449406931f;
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(kR_LN2f)));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  // SLEEF's ldexp2, u * 2^(q >> 1) * 2^(q - (q >> 1)), multiplies by two powers of two:
  // exact but for the final rounding into the denormal range. VSCALEFPS computes u * 2^q
  // with that same single rounding, in one instruction.
  u = _mm512_scalef_ps(u, qf);
  u = _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), u);
  u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ),
                         _mm512_set1_ps(INFINITY));
  return u;
}

inline __m512 silu16(__m512 x) {  // the vector loop's silu, before its rounding
  const __m512 e = sleef_expf16_u10(_mm512_xor_ps(x, _mm512_set1_ps(-0.0f)));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// A bfloat16 gate has 65536 values: the vector loop's rounded silu of each, computed once
// with that loop's own operations (so a lookup gives its bits), 256 KiB that stay in L2. A
// 16-lane gather takes about a third of the time of the exp and the division it replaces.
const float* bf16_silu_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    alignas(64) bf16 g[16];
    for (int64_t i = 0; i < 65536; i += 16) {
      for (int64_t l = 0; l < 16; ++l) g[l] = static_cast<bf16>(i + l);
      _mm512_storeu_ps(t.data() + i, round_to<bf16>(silu16(load16(g))));
    }
    return t;
  }();
  return table.data();
}

// silu(gate) as ATen's silu kernel computes it, rounded to T, times up, rounded to T. ATen's
// vectorised loop takes two vectors at a time (64 bf16 or 32 float elements) and leaves the
// rest of a row to its scalar loop, which calls the C library's expf instead of SLEEF's; this
// kernel splits each row the same way. (For bfloat16 the two give the same result for every
// input; for float32 they do not, and ATen can also split a row between threads.)
template <typename T>
void silu_mul_impl(const torch::Tensor& gu, torch::Tensor& out) {
  const int64_t rows = gu.size(0), I = out.size(1), sg = gu.stride(0), so = out.stride(0);
  const T* gp = reinterpret_cast<const T*>(gu.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  constexpr int64_t kStep = std::is_same_v<T, bf16> ? 64 : 32;
  const int64_t nvec = I / kStep * kStep;
  [[maybe_unused]] const float* table = nullptr;
  if constexpr (std::is_same_v<T, bf16>) table = bf16_silu_table();
  at::parallel_for(0, rows, grain(3 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * sg;
      const T* u = g + I;
      T* o = op + r * so;
      for (int64_t j = 0; j < nvec; j += 16) {
        __m512 silu;
        if constexpr (std::is_same_v<T, bf16>) {
          const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j));
          silu = _mm512_i32gather_ps(_mm512_cvtepu16_epi32(bits), table, 4);
        } else {
          silu = silu16(load16(g + j));
        }
        store16(o + j, _mm512_mul_ps(silu, load16(u + j)));
      }
      for (int64_t j = nvec; j < I; ++j) {
        const float x = to_float(g[j]);
        const float silu = round_to<T>(x / (1.0f + std::exp(-x)));
        o[j] = from_float<T>(silu * to_float(u[j]));
      }
    }
  });
}

// ---- rotary (rotate-half), in place ---------------------------------------------------------

// x[t, h] = x * cos[t] + rotate_half(x) * sin[t], rounding each product and the sum to T.
template <typename T>
void rotary_impl(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  T* xp = reinterpret_cast<T*>(x.data_ptr());
  const int64_t tokens = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  const T* cp = reinterpret_cast<const T*>(cos.data_ptr());
  const T* sp = reinterpret_cast<const T*>(sin.data_ptr());
  const int64_t sc = cos.stride(0), ss = sin.stride(0);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  at::parallel_for(0, tokens, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * sc;
      const T* s = sp + t * ss;
      for (int64_t j = 0; j < half; j += 16) {
        const __mmask16 m = tail_mask(std::min<int64_t>(16, half - j));
        const __m512 c0 = load16(c + j, m), c1 = load16(c + half + j, m);
        const __m512 s0 = load16(s + j, m), s1 = load16(s + half + j, m);
        for (int64_t h = 0; h < H; ++h) {
          T* p = xp + t * st + h * sh;
          const __m512 lo = load16(p + j, m), hi = load16(p + half + j, m);
          // first half: lo * cos + (-hi) * sin; second half: hi * cos + lo * sin
          const __m512 a0 = round_to<T>(_mm512_mul_ps(lo, c0));
          const __m512 b0 = round_to<T>(_mm512_mul_ps(_mm512_xor_ps(hi, sign), s0));
          const __m512 a1 = round_to<T>(_mm512_mul_ps(hi, c1));
          const __m512 b1 = round_to<T>(_mm512_mul_ps(lo, s1));
          store16(p + j, _mm512_add_ps(a0, b0), m);
          store16(p + half + j, _mm512_add_ps(a1, b1), m);
        }
      }
    }
  });
}

// ---- greedy argmax over rows ----------------------------------------------------------------

// out[r] = torch.argmax(x[r]): the first index of the row's largest value, or of its first
// NaN (argmax ranks NaN above everything). One pass for the maximum, one to find it.
template <typename T>
void argmax_rows_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), V = x.size(1), sx = x.stride(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* p = xp + r * sx;
      const int64_t full = V / 16 * 16;
      const __mmask16 tm = tail_mask(V - full);
      __m512 mx = _mm512_set1_ps(-INFINITY);
      __mmask16 nan = 0;
      for (int64_t j = 0; j < full; j += 16) {
        const __m512 v = load16(p + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
      }
      if (tm) {
        const __m512 v = load16(p + full, tm);
        nan |= _mm512_mask_cmp_ps_mask(tm, v, v, _CMP_UNORD_Q);
        mx = _mm512_mask_max_ps(mx, tm, mx, v);
      }
      int64_t idx = 0;
      if (nan) {
        while (!std::isnan(to_float(p[idx]))) ++idx;
      } else {
        const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        int64_t j = 0;
        for (; j < full; j += 16) {
          const __mmask16 hit = _mm512_cmp_ps_mask(load16(p + j), best, _CMP_EQ_OQ);
          if (hit) break;
        }
        const __mmask16 hit =
            j < full ? _mm512_cmp_ps_mask(load16(p + j), best, _CMP_EQ_OQ)
                     : _mm512_mask_cmp_ps_mask(tm, load16(p + j, tm), best, _CMP_EQ_OQ);
        idx = j + __builtin_ctz(hit);
      }
      op[r] = idx;
    }
  });
}

// ---- grammar token masks --------------------------------------------------------------------

// x[r, j] = -inf wherever bit j % 32 of word j / 32 of bitmask[r] is 0 (a token the row's
// grammar disallows), for each listed row r: one masked store per word of 32 tokens.
template <typename T>
void mask_rows_impl(torch::Tensor& x, const torch::Tensor& bitmask,
                    const std::vector<int64_t>& rows) {
  const int64_t V = x.size(1), sx = x.stride(0), sb = bitmask.stride(0);
  T* xp = reinterpret_cast<T*>(x.data_ptr());
  const int32_t* bp = bitmask.data_ptr<int32_t>();
  // One thread: a row takes microseconds, less than waking the pool costs.
  for (const int64_t r : rows) {
    T* p = xp + r * sx;
    const int32_t* words = bp + r * sb;
    for (int64_t j = 0; j < V; j += 32) {
      uint32_t off = ~uint32_t(words[j / 32]);  // the disallowed tokens of this word
      if (V - j < 32) off &= (1u << (V - j)) - 1u;
      if (!off) continue;
      if constexpr (std::is_same_v<T, bf16>) {
        _mm512_mask_storeu_epi16(p + j, off, _mm512_set1_epi16(int16_t(0xFF80)));  // -inf
      } else {
        const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
        _mm512_mask_storeu_ps(p + j, __mmask16(off), neg_inf);
        _mm512_mask_storeu_ps(p + j + 16, __mmask16(off >> 16), neg_inf);
      }
    }
  }
}

// ---- entry points: each returns nothing (None in Python) for inputs it does not serve,
// and the caller then runs the torch expression -----------------------------------------

}  // namespace

std::optional<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  if (!norm_servable(x, w)) return std::nullopt;
  const auto x3 = rows3(x);
  if (!x3) return std::nullopt;
  auto out = torch::empty(x3->sizes(), x.options());
  if (is_bf16(x)) rms_norm_impl<bf16>(*x3, w, out, float(eps));
  else rms_norm_impl<float>(*x3, w, out, float(eps));
  return out.view(x.sizes());
}

std::optional<std::tuple<torch::Tensor, torch::Tensor>> add_rms_norm(torch::Tensor x,
                                                                     torch::Tensor res,
                                                                     torch::Tensor w, double eps) {
  if (!add_norm_servable(x, res, w)) return std::nullopt;
  const auto x3 = rows3(x), r3 = rows3(res);
  if (!x3 || !r3) return std::nullopt;
  auto out = torch::empty(x3->sizes(), x.options());
  auto new_res = torch::empty(x3->sizes(), x.options());
  if (is_bf16(x)) add_rms_norm_impl<bf16>(*x3, *r3, w, out, new_res, float(eps));
  else add_rms_norm_impl<float>(*x3, *r3, w, out, new_res, float(eps));
  return std::make_tuple(out.view(x.sizes()), new_res.view(x.sizes()));
}

std::optional<torch::Tensor> silu_mul(torch::Tensor gu) {
  if (!silu_mul_servable(gu)) return std::nullopt;
  auto out = torch::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  if (is_bf16(gu)) silu_mul_impl<bf16>(gu, out);
  else silu_mul_impl<float>(gu, out);
  return out;
}

// The bf16 silu table (bf16_silu_table), for kernels elsewhere that fuse silu_mul.
torch::Tensor silu_table() {
  return torch::from_blob(const_cast<float*>(bf16_silu_table()), {65536}, torch::kFloat).clone();
}

std::optional<torch::Tensor> rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  if (!rotary_servable(x, cos, sin)) return std::nullopt;
  if (is_bf16(x)) rotary_impl<bf16>(x, cos, sin);
  else rotary_impl<float>(x, cos, sin);
  return x;
}

std::optional<torch::Tensor> argmax_rows(torch::Tensor x) {
  if (!argmax_servable(x)) return std::nullopt;
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  if (is_bf16(x)) argmax_rows_impl<bf16>(x, out);
  else argmax_rows_impl<float>(x, out);
  return out;
}

// In place; false (nothing done) for inputs it does not serve.
bool mask_rows_(torch::Tensor x, torch::Tensor bitmask, std::vector<int64_t> rows) {
  if (!mask_rows_servable(x, bitmask, rows)) return false;
  if (is_bf16(x)) mask_rows_impl<bf16>(x, bitmask, rows);
  else mask_rows_impl<float>(x, bitmask, rows);
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows);
  m.def("mask_rows_", &mask_rows_);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("silu_table", &silu_table);
  m.def("rotary_", &rotary_);
}
