#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
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

constexpr int64_t kAhead = 12;  // rows prefetched ahead: enough to cover DRAM latency

// Every cache line of an n-element row, into L2: prefetching into L1 instead evicts rows
// still in use and measured ~25% slower here.
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * (int64_t)sizeof(T); off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// Softmax of each query head's row of scores sc[hq * L + t], in place, in float32.
inline void softmax_rows(float* sc, int64_t Hq, int64_t L) {
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* s = sc + hq * L;
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
}

#ifdef __AVX512BF16__
// bfloat16 fast path (head_dim a multiple of 32): K and V stay bf16 pairs fed straight to
// the dot-product unit; scores, softmax and accumulation are float32.

// r[i] = sum of the 16 lanes of a[i]: a pairwise tree (15 permute-add rounds for 16 sums)
// instead of 16 separate horizontal reductions. `a` is clobbered.
inline __m512 hsum16(__m512* a) {
  alignas(64) static const int32_t even[16] = {0,  2,  4,  6,  8,  10, 12, 14,
                                               16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static const int32_t odd[16] = {1,  3,  5,  7,  9,  11, 13, 15,
                                              17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i ie = _mm512_load_si512(even), io = _mm512_load_si512(odd);
  // After the round that halves n vectors, a[i] holds 16/n partial sums of each of
  // a[i*32/n ...] in order; after the last round a[0] lane i is the sum of a[i].
  for (int n = 16; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i)
      a[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], ie, a[2 * i + 1]),
                           _mm512_permutex2var_ps(a[2 * i], io, a[2 * i + 1]));
  return a[0];
}

// sc[hq * L + t] = scale * q[hq] . k[t][hq / G], 16 positions at a time.
template <int NP>  // NP = head_dim / 32 bf16 pairs-of-16
void scores_bf16(const uint16_t* q, const uint16_t* k, const int64_t* slots, int64_t L, int64_t Hq,
                 int64_t Hkv, float scale, float* sc) {
  constexpr int64_t D = NP * 32;
  const int64_t G = Hq / Hkv, row = Hkv * D;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - t0);
    // two blocks ahead
    for (int64_t i = 32; i < 48 && t0 + i < L; ++i) prefetch_row(k + slots[t0 + i] * row, row);
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        __m512bh qb[NP];
        for (int j = 0; j < NP; ++j) qb[j] = (__m512bh)_mm512_loadu_si512(q + hq * D + 32 * j);
        __m512 acc[16];
        for (int64_t i = 0; i < 16; ++i) {
          __m512 a = _mm512_setzero_ps();
          if (i < n) {  // positions past L are never read
            const uint16_t* kp = k + slots[t0 + i] * row + h * D;
            for (int j = 0; j < NP; ++j)
              a = _mm512_dpbf16_ps(a, qb[j], (__m512bh)_mm512_loadu_si512(kp + 32 * j));
          }
          acc[i] = a;
        }
        const __mmask16 mask = (__mmask16)((1u << n) - 1);
        _mm512_mask_storeu_ps(sc + hq * L + t0, mask, _mm512_mul_ps(hsum16(acc), vscale));
      }
    }
  }
}

// out[hq] = sum_t p[hq][t] v[t][hq / G]. Two positions per dot-product: the V rows of
// positions t and t+1 are interleaved (unpacklo/hi), and pb[hq] holds the probabilities as
// bf16 pairs (p_t, p_t+1). Accumulator lane 4c+i of chunk j covers d = 32j + 8c + i (lo)
// and 32j + 8c + 4 + i (hi); the store puts them back in order.
template <int NP, int GC>  // GC: query heads accumulated at once (registers)
void values_bf16(const uint32_t* pb, int64_t pairs_stride, const uint16_t* v, const int64_t* slots,
                 int64_t L, int64_t Hq, int64_t Hkv, uint16_t* out) {
  constexpr int64_t D = NP * 32;
  const int64_t G = Hq / Hkv, row = Hkv * D;
  alignas(64) static const int32_t first[16] = {0, 1, 2, 3, 16, 17, 18, 19,
                                                4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t second[16] = {8,  9,  10, 11, 24, 25, 26, 27,
                                                 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i i1 = _mm512_load_si512(first), i2 = _mm512_load_si512(second);
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t g0 = 0; g0 < G; g0 += GC) {
      const int64_t gc = std::min<int64_t>(GC, G - g0);
      __m512 lo[GC][NP], hi[GC][NP];
      for (int g = 0; g < GC; ++g)
        for (int j = 0; j < NP; ++j) lo[g][j] = hi[g][j] = _mm512_setzero_ps();
      for (int64_t t = 0; t < L; t += 2) {
        const uint16_t* v0 = v + slots[t] * row + h * D;
        // An odd tail pairs the last row with itself at probability 0 (never past L).
        const uint16_t* v1 = t + 1 < L ? v + slots[t + 1] * row + h * D : v0;
        if (t + 2 * kAhead < L) {
          prefetch_row(v + slots[t + 2 * kAhead] * row + h * D, D);
          prefetch_row(v + slots[t + 2 * kAhead + 1 < L ? t + 2 * kAhead + 1 : t] * row + h * D, D);
        }
        for (int j = 0; j < NP; ++j) {
          const __m512i a = _mm512_loadu_si512(v0 + 32 * j), b = _mm512_loadu_si512(v1 + 32 * j);
          const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b);
          const __m512bh vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
          for (int g = 0; g < GC; ++g) {
            if (g < gc) {
              const __m512bh p =
                  (__m512bh)_mm512_set1_epi32((int32_t)pb[(h * G + g0 + g) * pairs_stride + t / 2]);
              lo[g][j] = _mm512_dpbf16_ps(lo[g][j], p, vlo);
              hi[g][j] = _mm512_dpbf16_ps(hi[g][j], p, vhi);
            }
          }
        }
      }
      for (int g = 0; g < GC; ++g) {
        if (g >= gc) continue;
        uint16_t* o = out + (h * G + g0 + g) * D;
        for (int j = 0; j < NP; ++j) {
          store16(o + 32 * j, _mm512_permutex2var_ps(lo[g][j], i1, hi[g][j]));
          store16(o + 32 * j + 16, _mm512_permutex2var_ps(lo[g][j], i2, hi[g][j]));
        }
      }
    }
  }
}

template <int NP, int GC>
void decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* pt,
                 const int64_t* lens, uint16_t* out, int64_t B, int64_t Hq, int64_t Hkv,
                 int64_t Lmax, float scale) {
  constexpr int64_t D = NP * 32;
  at::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> sc;
    std::vector<uint32_t> pb;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b], P = (L + 1) / 2;
      const int64_t* slots = pt + b * Lmax;
      sc.resize(Hq * L);
      pb.resize(Hq * P);
      scores_bf16<NP>(q + b * Hq * D, k, slots, L, Hq, Hkv, scale, sc.data());
      softmax_rows(sc.data(), Hq, L);
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const float* s = sc.data() + hq * L;
        uint16_t* dst = reinterpret_cast<uint16_t*>(pb.data() + hq * P);
        int64_t t = 0;
        for (; t + 16 <= L; t += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
        if (t < L) {
          const __mmask16 mask = (__mmask16)((1u << (L - t)) - 1);
          _mm256_mask_storeu_epi16(dst + t, mask,
                                   (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, s + t)));
        }
        if (L % 2) dst[L] = 0;
      }
      values_bf16<NP, GC>(pb.data(), P, v, slots, L, Hq, Hkv, out + b * Hq * D);
    }
  });
}

bool try_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* pt,
                     const int64_t* lens, uint16_t* out, int64_t B, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t Lmax, float scale) {
  switch (D) {
    case 32:
      decode_bf16<1, 6>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, scale);
      return true;
    case 64:
      decode_bf16<2, 4>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, scale);
      return true;
    case 128:
      decode_bf16<4, 2>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, scale);
      return true;
    case 256:
      decode_bf16<8, 1>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, scale);
      return true;
    default:
      return false;
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
          _mm512_storeu_ps(
              &qf[hq * D + 16 * j],
              _mm512_mul_ps(load16(q + (b * Hq + hq) * D + 16 * j), _mm512_set1_ps(scale)));
      // scores[hq][t] = q[hq] . k[t][hq / G]
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
      softmax_rows(sc.data(), Hq, L);
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
#ifdef __AVX512BF16__
    if (try_decode_bf16(reinterpret_cast<const uint16_t*>(q.data_ptr()),
                        reinterpret_cast<const uint16_t*>(k.data_ptr()),
                        reinterpret_cast<const uint16_t*>(v.data_ptr()), pt.data_ptr<int64_t>(),
                        lens.data_ptr<int64_t>(), reinterpret_cast<uint16_t*>(out.data_ptr()), B,
                        Hq, Hkv, D, Lmax, static_cast<float>(scale)))
      return out;
#endif
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV pool");
}
