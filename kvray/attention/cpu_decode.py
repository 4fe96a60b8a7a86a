"""Paged decode attention for CPUs: a small C++ kernel built on first use.

Decode attention is memory bound: each step reads every running request's K/V once. The
pure-torch path first gathers those rows into a padded copy and then runs SDPA over it,
moving the data three times. This kernel reads K/V straight from the pool through the page
table, one (request, KV head) pair per task across the cores, with AVX-512 for the dot
products, an exact-to-float32-rounding exp, and the softmax in float32.

`paged_decode(q, k_flat, v_flat, page_table, seq_lens, scale)`:
    q          [B, Hq, D] bfloat16 or float32 (one query token per request)
    k_flat     [slots, Hkv, D] the layer's K pool (same dtype as q); v_flat likewise
    page_table [B, max_len] int64 token slots; seq_lens [B] int64 context lengths
returns [B, Hq, D]. `available()` is False where the kernel cannot be built (no compiler,
no AVX-512): callers then use the torch path.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> 16 float
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline void store16(uint16_t* p, __m512 v) {  // float -> bfloat16, round to nearest even
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline __m512 exp16(__m512 x) {  // e^x = 2^n * 2^f, |f| <= 1/2, degree-7 polynomial for 2^f
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

constexpr int64_t kAhead = 6;  // rows prefetched ahead: enough to cover DRAM latency

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {  // every cache line of an n-element row
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * (int64_t)sizeof(T); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

#ifdef __AVX512BF16__
// scores of every query head against every key of one request, bf16 dot products.
void score_bf16(const uint16_t* q, const uint16_t* k, const int64_t* slots, int64_t L,
                int64_t Hq, int64_t Hkv, int64_t D, float scale, float* sc) {
  const int64_t G = Hq / Hkv, np = D / 32, row = Hkv * D;
  std::vector<__m512bh> qb(Hq * np);
  for (int64_t hq = 0; hq < Hq; ++hq)
    for (int64_t j = 0; j < np; ++j)
      qb[hq * np + j] = (__m512bh)_mm512_loadu_si512(q + hq * D + 32 * j);
  for (int64_t t = 0; t < L; ++t) {
    const uint16_t* kp = k + slots[t] * row;
    if (t + kAhead < L) prefetch_row(k + slots[t + kAhead] * row, row);
    for (int64_t h = 0; h < Hkv; ++h) {
      __m512bh kb[8];
      for (int64_t j = 0; j < np; ++j) kb[j] = (__m512bh)_mm512_loadu_si512(kp + h * D + 32 * j);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < np; ++j) acc = _mm512_dpbf16_ps(acc, qb[hq * np + j], kb[j]);
        sc[hq * L + t] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  }
}
#endif

template <typename T>
void decode(const T* q, const T* k, const T* v, const int64_t* pt, const int64_t* lens, T* out,
            int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Lmax, float scale) {
  // One task per request: its K/V rows (all local KV heads of a slot, contiguous) are read
  // once, in position order, while they are in cache.
  const int64_t G = Hq / Hkv, nv = D / 16, row = Hkv * D;
  // Small batches stay on the calling thread: waking a pool costs more than they take.
  at::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), sc;
    std::vector<__m512> acc(Hq * nv);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      const int64_t* slots = pt + b * Lmax;
      sc.resize(Hq * L);
      for (int64_t hq = 0; hq < Hq; ++hq)
        for (int64_t j = 0; j < nv; ++j)
          _mm512_storeu_ps(&qf[hq * D + 16 * j],
                           _mm512_mul_ps(load16(q + (b * Hq + hq) * D + 16 * j),
                                         _mm512_set1_ps(scale)));
      // scores[hq][t] = q[hq] . k[t][hq / G]
      bool done = false;
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (D % 32 == 0) {  // bf16 pairs straight into float accumulators, no conversion
          score_bf16(q + b * Hq * D, k, slots, L, Hq, Hkv, D, scale, sc.data());
          done = true;
        }
      }
#endif
      if (!done) {
        for (int64_t t = 0; t < L; ++t) {
          const T* kp = k + slots[t] * row;
          if (t + kAhead < L) prefetch_row(k + slots[t + kAhead] * row, row);
          for (int64_t h = 0; h < Hkv; ++h) {
            __m512 kv[16];
            for (int64_t j = 0; j < nv; ++j) kv[j] = load16(kp + h * D + 16 * j);
            for (int64_t g = 0; g < G; ++g) {
              const float* qg = &qf[(h * G + g) * D];
              __m512 acc0 = _mm512_setzero_ps();
              for (int64_t j = 0; j < nv; ++j)
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), kv[j], acc0);
              sc[(h * G + g) * L + t] = _mm512_reduce_add_ps(acc0);
            }
          }
        }
      }
      // softmax over each query head's row, in float32
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* s = sc.data() + hq * L;
        __m512 m = _mm512_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 16 <= L; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
        float mx = _mm512_reduce_max_ps(m);
        for (; t < L; ++t) mx = std::max(mx, s[t]);
        __m512 mv = _mm512_set1_ps(mx), sum = _mm512_setzero_ps();
        for (t = 0; t + 16 <= L; t += 16) {
          __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
          _mm512_storeu_ps(s + t, e);
          sum = _mm512_add_ps(sum, e);
        }
        if (t < L) {
          __mmask16 mask = (__mmask16)((1u << (L - t)) - 1);
          __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), mv));
          e = _mm512_maskz_mov_ps(mask, e);
          _mm512_mask_storeu_ps(s + t, mask, e);
          sum = _mm512_add_ps(sum, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        for (t = 0; t + 16 <= L; t += 16)
          _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
        for (; t < L; ++t) s[t] *= _mm512_cvtss_f32(inv);
      }
      // out[hq] = sum_t p[hq][t] * v[t][hq / G]
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        const T* vp = v + slots[t] * row;
        if (t + kAhead < L) prefetch_row(v + slots[t + kAhead] * row, row);
        for (int64_t h = 0; h < Hkv; ++h) {
          __m512 vv[16];
          for (int64_t j = 0; j < nv; ++j) vv[j] = load16(vp + h * D + 16 * j);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t hq = h * G + g;
            const __m512 p = _mm512_set1_ps(sc[hq * L + t]);
            for (int64_t j = 0; j < nv; ++j)
              acc[hq * nv + j] = _mm512_fmadd_ps(p, vv[j], acc[hq * nv + j]);
          }
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq)
        for (int64_t j = 0; j < nv; ++j)
          store16(out + (b * Hq + hq) * D + 16 * j, acc[hq * nv + j]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor pt,
                           torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [B,Hq,D], k/v [slots,Hkv,D]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && pt.is_contiguous());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type());
  TORCH_CHECK(pt.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), Lmax = pt.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && Hq % Hkv == 0, "need head_dim % 16 == 0, <= 256");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
    decode<uint16_t>(reinterpret_cast<const uint16_t*>(q.data_ptr()),
                     reinterpret_cast<const uint16_t*>(k.data_ptr()),
                     reinterpret_cast<const uint16_t*>(v.data_ptr()), pt.data_ptr<int64_t>(),
                     lens.data_ptr<int64_t>(), reinterpret_cast<uint16_t*>(out.data_ptr()), B, Hq,
                     Hkv, D, Lmax, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "bfloat16 or float32 only");
    decode<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                  pt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, Hq,
                  Hkv, D, Lmax, static_cast<float>(scale));
  }
  return out;
}
"""

_lock = threading.Lock()
_module: Any = None
_failed = False


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return False


def _load() -> Any:
    global _module, _failed
    with _lock:
        if _module is not None or _failed:
            return _module
        if os.environ.get("KVRAY_CPU_KERNELS", "1") == "0" or not _cpu_has_avx512():
            _failed = True
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            _module = load_inline(
                name="kvray_paged_decode_v5",
                cpp_sources=_SOURCE,
                functions=["paged_decode"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
            )
        except Exception as e:  # noqa: BLE001 - no compiler or ninja: the torch path serves
            log.warning("kvray CPU decode kernel unavailable (%s); using torch attention", e)
            _failed = True
        return _module


def available() -> bool:
    return _load() is not None


def paged_decode(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    mod = _load()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available on this machine")
    return mod.paged_decode(q.contiguous(), k_flat, v_flat, page_table, seq_lens, scale)
