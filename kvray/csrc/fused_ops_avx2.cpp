// kvray's fused elementwise ops (kvray/models/fused.py) for CPUs with AVX2 and FMA but not
// AVX-512 (fused_ops.cpp), in float32: the dtype kvray serves in on such CPUs (oneDNN has no
// fast bfloat16 kernels for them). Each op gives the bits of the torch expression it
// replaces, as ATen's AVX2 build computes it (8-lane vectors); bfloat16 and the other inputs
// it does not serve return nothing, and the caller runs the torch expression.
//
// Built with -ffp-contract=off: a multiply followed by an add must round twice, as the
// separate torch ops do, never fuse into one FMA. FMAs are written explicitly where ATen
// (SLEEF) uses them.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "fused_common.h"

namespace {

using kvray_fused::add_norm_servable;
using kvray_fused::argmax_servable;
using kvray_fused::bf16;
using kvray_fused::grain;
using kvray_fused::inv_rms;
using kvray_fused::is_bf16;
using kvray_fused::mask_rows_servable;
using kvray_fused::norm_servable;
using kvray_fused::rotary_servable;
using kvray_fused::Rows;
using kvray_fused::rows3;
using kvray_fused::silu_mul_servable;

// The first n lanes (n < 8) of p, the others 0; and a store of the first n lanes.
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load8(const float* p, int64_t n) { return _mm256_maskload_ps(p, lanes_below(n)); }
inline void store8(float* p, __m256 v, int64_t n) { _mm256_maskstore_ps(p, lanes_below(n), v); }

// ---- RMSNorm ----------------------------------------------------------------------------

// out = weight * (x * r), each product rounded, as transformers' expression in float32.
inline void scale_row(const float* x, const float* w, float* out, int64_t n, float r) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(
        out + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(x + j), rv)));
  if (j < n)
    store8(out + j, _mm256_mul_ps(load8(w + j, n - j), _mm256_mul_ps(load8(x + j, n - j), rv)),
           n - j);
}

// out [A, B, D] contiguous.
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, float eps) {
  const Rows<const float> xr(x);
  float* op = out.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const int64_t rows = x.size(0) * x.size(1), n = x.size(2);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      scale_row(xr[i], wp, op + i * n, n, inv_rms(xr[i], n, eps));
  });
}

// new_res = x + res, out = rms_norm(new_res), row by row while the row is in L1. out and
// new_res [A, B, D] contiguous.
void add_rms_norm_impl(const torch::Tensor& x, const torch::Tensor& res, const torch::Tensor& w,
                       torch::Tensor& out, torch::Tensor& new_res, float eps) {
  const Rows<const float> xr(x), rr(res);
  float* op = out.data_ptr<float>();
  float* sp = new_res.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const int64_t rows = x.size(0) * x.size(1), n = x.size(2);
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* a = xr[i];
      const float* b = rr[i];
      float* s = sp + i * n;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j)));
      if (j < n) store8(s + j, _mm256_add_ps(load8(a + j, n - j), load8(b + j, n - j)), n - j);
      scale_row(s, wp, op + i * n, n, inv_rms(s, n, eps));
    }
  });
}

// ---- SiLU(gate) * up ------------------------------------------------------------------------

// SLEEF's Sleef_expf8_u10 (sleefsimdsp.c xexpf with the AVX2 helpers), which ATen's AVX2
// Vectorized<float>::exp() calls: same operations, same order, same FMAs, and its ldexp as two
// products by powers of two.
inline __m256 sleef_expf8_u10(__m256 d) {
  const float kR_LN2f = 1.442695040888963407359924681001892137426645954152985934135449406931f;
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(kR_LN2f)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  // vldexp2: u * 2^(q >> 1) * 2^(q - (q >> 1)), each power built from its exponent bits
  const __m256i h = _mm256_srai_epi32(q, 1);
  auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(0x7f)), 23));
  };
  u = _mm256_mul_ps(_mm256_mul_ps(u, pow2(h)), pow2(_mm256_sub_epi32(q, h)));
  u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
  return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY),
                          _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
}

// silu(gate) as ATen's silu kernel computes it, times up. ATen's vectorised loop takes two
// vectors at a time (16 floats) and leaves the rest of a row to its scalar loop, which calls
// the C library's expf instead of SLEEF's; this kernel splits each row the same way.
void silu_mul_impl(const torch::Tensor& gu, torch::Tensor& out) {
  const int64_t rows = gu.size(0), I = out.size(1), sg = gu.stride(0), so = out.stride(0);
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t nvec = I / 16 * 16;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, rows, grain(3 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * sg;
      const float* u = g + I;
      float* o = op + r * so;
      for (int64_t j = 0; j < nvec; j += 8) {
        const __m256 x = _mm256_loadu_ps(g + j);
        const __m256 e = sleef_expf8_u10(_mm256_xor_ps(x, sign));
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(silu, _mm256_loadu_ps(u + j)));
      }
      for (int64_t j = nvec; j < I; ++j) {
        const float x = g[j];
        const float silu = x / (1.0f + std::exp(-x));
        o[j] = silu * u[j];
      }
    }
  });
}

// ---- rotary (rotate-half), in place ---------------------------------------------------------

// x[t, h] = x * cos[t] + rotate_half(x) * sin[t], each product and the sum rounded.
void rotary_impl(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  float* xp = x.data_ptr<float>();
  const int64_t tokens = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t sc = cos.stride(0), ss = sin.stride(0);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, tokens, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * sc;
      const float* s = sp + t * ss;
      for (int64_t j = 0; j < half; j += 8) {
        const int64_t n = std::min<int64_t>(8, half - j);
        const __m256 c0 = load8(c + j, n), c1 = load8(c + half + j, n);
        const __m256 s0 = load8(s + j, n), s1 = load8(s + half + j, n);
        for (int64_t h = 0; h < H; ++h) {
          float* p = xp + t * st + h * sh;
          const __m256 lo = load8(p + j, n), hi = load8(p + half + j, n);
          // first half: lo * cos + (-hi) * sin; second half: hi * cos + lo * sin
          const __m256 a0 = _mm256_mul_ps(lo, c0);
          const __m256 b0 = _mm256_mul_ps(_mm256_xor_ps(hi, sign), s0);
          const __m256 a1 = _mm256_mul_ps(hi, c1);
          const __m256 b1 = _mm256_mul_ps(lo, s1);
          store8(p + j, _mm256_add_ps(a0, b0), n);
          store8(p + half + j, _mm256_add_ps(a1, b1), n);
        }
      }
    }
  });
}

// ---- greedy argmax over rows ----------------------------------------------------------------

// out[r] = torch.argmax(x[r]): the first index of the row's largest value, or of its first
// NaN (argmax ranks NaN above everything). One pass for the maximum, one to find it.
void argmax_rows_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), V = x.size(1), sx = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* p = xp + r * sx;
      const int64_t full = V / 8 * 8;
      __m256 mx = _mm256_set1_ps(-INFINITY);
      __m256 nan = _mm256_setzero_ps();
      for (int64_t j = 0; j < full; j += 8) {
        const __m256 v = _mm256_loadu_ps(p + j);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, v);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      float best = -INFINITY;
      bool has_nan = _mm256_movemask_ps(nan) != 0;
      for (float l : lanes) best = std::max(best, l);
      for (int64_t j = full; j < V; ++j) {
        has_nan = has_nan || std::isnan(p[j]);
        best = std::max(best, p[j]);
      }
      int64_t idx = 0;
      if (has_nan) {
        while (!std::isnan(p[idx])) ++idx;
      } else {
        const __m256 b = _mm256_set1_ps(best);
        int64_t j = 0;
        for (; j < full; j += 8) {
          const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), b, _CMP_EQ_OQ));
          if (hit) break;
        }
        idx = j;
        while (p[idx] != best) ++idx;
      }
      op[r] = idx;
    }
  });
}

// ---- grammar token masks --------------------------------------------------------------------

// x[r, j] = -inf wherever bit j % 32 of word j / 32 of bitmask[r] is 0 (a token the row's
// grammar disallows), for each listed row r; bfloat16 or float32 (T's -inf is `neg_inf`).
template <typename T>
void mask_rows_impl(torch::Tensor& x, const torch::Tensor& bitmask,
                    const std::vector<int64_t>& rows, T neg_inf) {
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
      for (; off; off &= off - 1) p[j + __builtin_ctz(off)] = neg_inf;
    }
  }
}

}  // namespace

// ---- entry points: each returns nothing (None in Python) for inputs it does not serve
// (bfloat16 among them), and the caller then runs the torch expression ----------------------

std::optional<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  if (!norm_servable(x, w) || is_bf16(x)) return std::nullopt;
  const auto x3 = rows3(x);
  if (!x3) return std::nullopt;
  auto out = torch::empty(x3->sizes(), x.options());
  rms_norm_impl(*x3, w, out, float(eps));
  return out.view(x.sizes());
}

std::optional<std::tuple<torch::Tensor, torch::Tensor>> add_rms_norm(torch::Tensor x,
                                                                     torch::Tensor res,
                                                                     torch::Tensor w, double eps) {
  if (!add_norm_servable(x, res, w) || is_bf16(x)) return std::nullopt;
  const auto x3 = rows3(x), r3 = rows3(res);
  if (!x3 || !r3) return std::nullopt;
  auto out = torch::empty(x3->sizes(), x.options());
  auto new_res = torch::empty(x3->sizes(), x.options());
  add_rms_norm_impl(*x3, *r3, w, out, new_res, float(eps));
  return std::make_tuple(out.view(x.sizes()), new_res.view(x.sizes()));
}

std::optional<torch::Tensor> silu_mul(torch::Tensor gu) {
  if (!silu_mul_servable(gu) || is_bf16(gu)) return std::nullopt;
  auto out = torch::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  silu_mul_impl(gu, out);
  return out;
}

// The bfloat16 silu table of fused_ops.cpp feeds the AMX kernels only: none here.
std::optional<torch::Tensor> silu_table() { return std::nullopt; }

std::optional<torch::Tensor> rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  if (!rotary_servable(x, cos, sin) || is_bf16(x)) return std::nullopt;
  rotary_impl(x, cos, sin);
  return x;
}

std::optional<torch::Tensor> argmax_rows(torch::Tensor x) {
  if (!argmax_servable(x) || is_bf16(x)) return std::nullopt;
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  argmax_rows_impl(x, out);
  return out;
}

// In place; false (nothing done) for inputs it does not serve.
bool mask_rows_(torch::Tensor x, torch::Tensor bitmask, std::vector<int64_t> rows) {
  if (!mask_rows_servable(x, bitmask, rows)) return false;
  if (is_bf16(x)) mask_rows_impl<bf16>(x, bitmask, rows, bf16(0xFF80));
  else mask_rows_impl<float>(x, bitmask, rows, -INFINITY);
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
