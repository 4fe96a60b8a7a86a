// Paged attention for CPUs, reading K/V in place through the page table (cpu_paged.py):
//   paged_decode   one query per request; AMX tiles for bf16 where the CPU and OS give them
//                  (head_dim 32, 64, 128 or 256), else AVX-512 (bf16 dot products where the
//                  CPU has them)
//   paged_extend   a request's prompt (chunk) over its whole context; AMX tiles, else AVX-512
//                  BF16 dot products; bf16 only, head_dim 32, 64, 128 or 256; returns false
//                  where it cannot run (the caller then uses torch's SDPA)
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_round.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVRAY_AMX 1
#include "amx_tiles.h"
#endif

namespace {

inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> 16 float
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline void store16(uint16_t* p, __m512 v) {  // float -> bfloat16, round to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), kvray_bf16::to_bf16(v));
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
                 int64_t Lmax, int64_t qs, float scale) {
  constexpr int64_t D = NP * 32;
  at::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> sc;
    std::vector<uint32_t> pb;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b], P = (L + 1) / 2;
      const int64_t* slots = pt + b * Lmax;
      sc.resize(Hq * L);
      pb.resize(Hq * P);
      scores_bf16<NP>(q + b * qs, k, slots, L, Hq, Hkv, scale, sc.data());
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
                     int64_t D, int64_t Lmax, int64_t qs, float scale) {
  switch (D) {
    case 32:
      decode_bf16<1, 6>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, qs, scale);
      return true;
    case 64:
      decode_bf16<2, 4>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, qs, scale);
      return true;
    case 128:
      decode_bf16<4, 2>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, qs, scale);
      return true;
    case 256:
      decode_bf16<8, 1>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, qs, scale);
      return true;
    default:
      return false;
  }
}
#endif

template <typename T>
void decode(const T* q, const T* k, const T* v, const int64_t* pt, const int64_t* lens, T* out,
            int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Lmax, int64_t qs, float scale) {
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
          _mm512_storeu_ps(&qf[hq * D + 16 * j], _mm512_mul_ps(load16(q + b * qs + hq * D + 16 * j),
                                                               _mm512_set1_ps(scale)));
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

#ifdef __AVX512BF16__
// ---- extend (prefill) attention -----------------------------------------------------------
// Each request's new queries attend over its whole context (cached prefix + this step's
// tokens, all already in the pool), causally: query i of Lq sees keys 0 .. Lk - Lq + i.
// Flash-style: per (request, query head, block of 16 queries), 32 keys at a time, online
// softmax in float32. K and V are first packed per (request, KV head) into a bf16
// pair-interleaved layout that serves two engines of products (bf16 in, float32 sums):
//   AMX tiles (attend_block_tiles), where the CPU and OS give them;
//   AVX-512 BF16 dot products (attend_block_dp) elsewhere: each VDPBF16PS takes 16 lanes
//   of one bf16 pair, a query's dim pair (broadcast) against 16 keys for the scores, a
//   query's pair of key probabilities (broadcast) against 16 dims of two values for P.V.

// kp[kb][j][r][n][e] = K[16 kb + n][32 j + 2 r + e]: per 16-key block and 32-dim chunk, 16
// dim pairs x 16 keys (a B tile; row r is 16 keys' dim pair 16 j + r). vp[vb][c][r][n][e] =
// V[32 vb + 2 r + e][16 c + n]: per 32-key block and 16-dim chunk, 16 key pairs x 16 dims (a
// B tile; row r is key pair r's 16 dims). Keys past L are zeros.
void pack_kv(const uint16_t* k, const uint16_t* v, const int64_t* slots, int64_t L, int64_t h,
             int64_t row, int64_t D, uint16_t* kp, uint16_t* vp) {
  // Both padded to whole 32-key blocks: the scores read two 16-key blocks at a time.
  const int64_t nvb = (L + 31) / 32, nkb = 2 * nvb, NP = D / 32, NC = D / 16;
  for (int64_t kb = 0; kb < nkb; ++kb)
    for (int64_t n = 0; n < 16; ++n) {
      const int64_t t = kb * 16 + n;
      const uint32_t* src =
          t < L ? reinterpret_cast<const uint32_t*>(k + slots[t] * row + h * D) : nullptr;
      for (int64_t j = 0; j < NP; ++j)
        for (int64_t r = 0; r < 16; ++r)
          reinterpret_cast<uint32_t*>(kp)[((kb * NP + j) * 16 + r) * 16 + n] =
              src ? src[16 * j + r] : 0u;
    }
  for (int64_t vb = 0; vb < nvb; ++vb)
    for (int64_t r = 0; r < 16; ++r)
      for (int e = 0; e < 2; ++e) {
        const int64_t t = vb * 32 + 2 * r + e;
        const uint16_t* src = t < L ? v + slots[t] * row + h * D : nullptr;
        for (int64_t c = 0; c < NC; ++c)
          for (int64_t n = 0; n < 16; ++n)
            vp[(((vb * NC + c) * 16 + r) * 16 + n) * 2 + e] = src ? src[16 * c + n] : 0;
      }
}

// Lazy rescaling: a row's exponents are taken against a reference max that moves only when a
// score exceeds it by more than this (natural log units): the outputs then accumulate
// untouched across blocks (probabilities stay below e^8 ~ 3000, exact enough in float32 and
// bf16's relative precision).
constexpr float kRescaleMargin = 8.0f;

// The online softmax of one block of 32 keys, the scores `sbuf` [16][32] of the block's
// queries (rows past nq are padding; row r is at position first_pos + r and sees keys up to
// it): probabilities as bf16 into pbuf [16][32] (0 for keys a row may not see), their sums
// added to lacc [16][16]. A row whose reference max m[r] moves gets its lacc rescaled and
// alpha[r], the factor its output so far must take; every other alpha is 1. Returns whether
// any row moved (rare). With `plo`, each probability is also split: pbuf its bf16 rounding,
// plo [16][32] the bf16 rounding of what that left, so that P.V taken over both is as exact
// as float32 P (and lacc sums the float32 probabilities); without, lacc sums the rounded ones.
inline bool softmax_block(const float* sbuf, uint16_t* pbuf, float* lacc, float* m, float* alpha,
                          int64_t nq, int64_t first_pos, int64_t k0, int64_t L, __m512 vscale,
                          uint16_t* plo = nullptr) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  bool rescale = false;
  for (int64_t r = 0; r < 16; ++r) {
    alpha[r] = 1.0f;
    uint16_t* pr = pbuf + r * 32;
    const int64_t vis = r < nq ? std::min<int64_t>(first_pos + r + 1, L) - k0 : 0;
    if (vis <= 0) {  // nothing of this block visible (or a padding row)
      _mm512_storeu_si512(pr, _mm512_setzero_si512());
      if (plo != nullptr) _mm512_storeu_si512(plo + r * 32, _mm512_setzero_si512());
      continue;
    }
    const __mmask16 m0 = vis >= 16 ? 0xFFFF : (__mmask16)((1u << vis) - 1);
    const __mmask16 m1 = vis >= 32 ? 0xFFFF : vis <= 16 ? 0 : (__mmask16)((1u << (vis - 16)) - 1);
    const __m512 s0 = _mm512_mask_mul_ps(ninf, m0, _mm512_loadu_ps(sbuf + r * 32), vscale);
    const __m512 s1 = _mm512_mask_mul_ps(ninf, m1, _mm512_loadu_ps(sbuf + r * 32 + 16), vscale);
    // The reference max moves only when a score passes it by the margin (checked without a
    // horizontal reduction, which the common case then skips).
    const __m512 limit = _mm512_set1_ps(m[r] + kRescaleMargin);
    if (_mm512_cmp_ps_mask(s0, limit, _CMP_GT_OQ) | _mm512_cmp_ps_mask(s1, limit, _CMP_GT_OQ)) {
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      if (m[r] != -INFINITY) {
        alpha[r] = std::exp(m[r] - mx);
        rescale = true;
        _mm512_store_ps(lacc + 16 * r,
                        _mm512_mul_ps(_mm512_load_ps(lacc + 16 * r), _mm512_set1_ps(alpha[r])));
      }
      m[r] = mx;
    }
    const __m512 vm = _mm512_set1_ps(m[r]);
    const __m512 p0 = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(s0, vm)));
    const __m512 p1 = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(s1, vm)));
    const __m256bh b0 = _mm512_cvtneps_pbh(p0), b1 = _mm512_cvtneps_pbh(p1);
    // The sum is of the probabilities P.V multiplies: rounded, or whole when split.
    const __m512 r0 = load16(reinterpret_cast<const uint16_t*>(&b0));
    const __m512 r1 = load16(reinterpret_cast<const uint16_t*>(&b1));
    const __m512 sum = plo != nullptr ? _mm512_add_ps(p0, p1) : _mm512_add_ps(r0, r1);
    _mm512_store_ps(lacc + 16 * r, _mm512_add_ps(_mm512_load_ps(lacc + 16 * r), sum));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr), (__m256i)b0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16), (__m256i)b1);
    if (plo != nullptr) {
      const __m256bh l0 = _mm512_cvtneps_pbh(_mm512_sub_ps(p0, r0));
      const __m256bh l1 = _mm512_cvtneps_pbh(_mm512_sub_ps(p1, r1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(plo + r * 32), (__m256i)l0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(plo + r * 32 + 16), (__m256i)l1);
    }
  }
  return rescale;
}

// o [16][D] (row stride D) times alpha, row by row.
inline void rescale_rows(float* o, const float* alpha, int64_t D) {
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t d = 0; d < D; d += 16)
      _mm512_store_ps(o + r * D + d,
                      _mm512_mul_ps(_mm512_load_ps(o + r * D + d), _mm512_set1_ps(alpha[r])));
}

// The block's first nq output rows: o [16][D] over each row's probability sum, as bf16.
inline void finish_rows(const float* o, const float* lacc, int64_t nq, int64_t D, uint16_t* out,
                        int64_t out_row_stride) {
  for (int64_t r = 0; r < nq; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(lacc + 16 * r)));
    for (int64_t d = 0; d < D; d += 16)
      store16(out + r * out_row_stride + d, _mm512_mul_ps(_mm512_load_ps(o + r * D + d), inv));
  }
}

// Up to 16 query rows (row stride q_row_stride) -> bf16 [16][D], padding rows zero.
inline void load_queries(const uint16_t* q, int64_t q_row_stride, int64_t nq, int64_t D,
                         uint16_t* qbuf) {
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = r < nq ? q[r * q_row_stride + d] : 0;
}

using BlockFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, const uint16_t*,
                         const uint16_t*, float, uint16_t*, int64_t);

#ifdef KVRAY_AMX
using kvray_amx::configure_full_tiles;

// Every tile is 16 rows x 64 bytes: 0-1 queries (A, 32 dims each), 2 keys (B), 3-4 scores
// (C, 16 keys each), 5 probabilities (A, 32 keys), 6 values (B, 16 dims), 7 P.V (C).
// A kernel or VM that refuses the tile registers leaves the dot-product path.

// Output chunks (16 dims each) that stay in tiles 4-7 across key blocks; a head_dim past 64
// keeps the rest in memory.
constexpr int64_t kTileChunks = 4;

// P.V of one 32-key block into the output tiles 4 .. 4 + min(NC, 4) - 1 (tile 3 holds each
// V chunk).
template <int NT>
inline void pv_tiles(const uint16_t* vblock) {
  _tile_loadd(3, vblock, 64);
  _tile_dpbf16ps(4, 2, 3);
  if constexpr (NT > 1) {
    _tile_loadd(3, vblock + 16 * 32, 64);
    _tile_dpbf16ps(5, 2, 3);
  }
  if constexpr (NT > 2) {
    _tile_loadd(3, vblock + 2 * 16 * 32, 64);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(3, vblock + 3 * 16 * 32, 64);
    _tile_dpbf16ps(7, 2, 3);
  }
}
template <int NT>  // the output tiles' chunks into o [16][D] (row stride D floats)
inline void store_out_tiles(float* o, int64_t D) {
  _tile_stored(4, o, 4 * D);
  if constexpr (NT > 1) _tile_stored(5, o + 16, 4 * D);
  if constexpr (NT > 2) {
    _tile_stored(6, o + 32, 4 * D);
    _tile_stored(7, o + 48, 4 * D);
  }
}
template <int NT>
inline void load_out_tiles(const float* o, int64_t D) {
  _tile_loadd(4, o, 4 * D);
  if constexpr (NT > 1) _tile_loadd(5, o + 16, 4 * D);
  if constexpr (NT > 2) {
    _tile_loadd(6, o + 32, 4 * D);
    _tile_loadd(7, o + 48, 4 * D);
  }
}

// One block of up to 16 queries (rows of one request, one query head) over its keys.
// NC = D / 16 output chunks: the first four in tiles 4-7, the rest (D > 64) added up in
// memory from a scratch tile (1, with 0 for V: the query and key tiles are free by then).
template <int NC>
void attend_block_tiles(const uint16_t* q, int64_t q_row_stride, int64_t nq, int64_t first_pos,
                        int64_t L, const uint16_t* kp, const uint16_t* vp, float scale,
                        uint16_t* out, int64_t out_row_stride) {
  constexpr int64_t D = NC * 16, NP = D / 32;
  alignas(64) uint16_t qbuf[16 * D];
  alignas(64) float sbuf[16 * 32];
  alignas(64) uint16_t pbuf[16 * 32];
  alignas(64) float lacc[16 * 16];
  alignas(64) float o[16 * D];  // [16][D]: the tiles' chunks on the way out, then the rest
  constexpr int64_t NT = NC < kTileChunks ? NC : kTileChunks;  // chunks held in tiles
  alignas(64) float cbuf[16 * 16];
  alignas(64) float alpha[16];
  float m[16];
  load_queries(q, q_row_stride, nq, D, qbuf);
  for (int64_t r = 0; r < 16; ++r) {
    _mm512_store_ps(lacc + 16 * r, _mm512_setzero_ps());
    for (int64_t d = NT * 16; d < D; ++d) o[r * D + d] = 0.0f;
    m[r] = -INFINITY;
  }
  _tile_zero(4);
  if constexpr (NT > 1) _tile_zero(5);
  if constexpr (NT > 2) {
    _tile_zero(6);
    _tile_zero(7);
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t kend = std::min<int64_t>(L, first_pos + nq);  // keys the last row sees
  for (int64_t k0 = 0; k0 < kend; k0 += 32) {
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < NP; ++j) {
      _tile_loadd(0, qbuf + 32 * j, D * 2);
      _tile_loadd(1, kp + ((k0 / 16) * NP + j) * 16 * 32, 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(1, kp + ((k0 / 16 + 1) * NP + j) * 16 * 32, 64);
      _tile_dpbf16ps(3, 0, 1);
    }
    _tile_stored(2, sbuf, 128);
    _tile_stored(3, sbuf + 16, 128);
    if (softmax_block(sbuf, pbuf, lacc, m, alpha, nq, first_pos, k0, L, vscale)) {
      // a row's max moved: bring its output down to the new reference
      store_out_tiles<NT>(o, D);
      rescale_rows(o, alpha, D);
      load_out_tiles<NT>(o, D);
    }
    _tile_loadd(2, pbuf, 64);
    const uint16_t* vblock = vp + (k0 / 32) * NC * 16 * 32;
    pv_tiles<NT>(vblock);
    for (int64_t c = NT; c < NC; ++c) {
      _tile_loadd(0, vblock + c * 16 * 32, 64);
      _tile_zero(1);
      _tile_dpbf16ps(1, 2, 0);
      _tile_stored(1, cbuf, 64);
      for (int64_t r = 0; r < nq; ++r) {
        float* orow = o + r * D + 16 * c;
        _mm512_store_ps(orow, _mm512_add_ps(_mm512_load_ps(orow), _mm512_load_ps(cbuf + 16 * r)));
      }
    }
  }
  store_out_tiles<NT>(o, D);
  finish_rows(o, lacc, nq, D, out, out_row_stride);
}
#endif  // KVRAY_AMX

#ifdef KVRAY_AMX
// ---- decode on AMX tiles ------------------------------------------------------------------
// A request's query heads go in column groups of up to 16 (whole KV heads where G <= 16).
// Scores: S^T [16 keys][16 columns] = K x Q^T on the tile unit, with A a 16-key block of
// the pool read in place (16 rows of 32 dims, the row stride the pool's) and B each KV
// head's 32-dim chunk of its own query columns (zero in every other column), so one C tile
// holds every column's scores whatever its KV head. P.V: O [16 columns][32 dims] += P x V,
// with B the block's V rows read in place: a plain row as a B tile puts dims 2n and 2n+1 in
// one column's pair, so P goes in twice, on the even and on the odd elements of A (the other
// zero), into two C tiles that take the even and the odd dims. A holds one KV head's columns
// of P (zero in the other rows). Softmax in float32 over the whole row of scores (two passes:
// every score first, then P.V), P rounded to bf16 and its sum taken over the rounded values.
// Blocks that are not 16 consecutive slots (a page size below 16, the last block) are copied
// first, with zero rows past the context.

constexpr int64_t kKeyBlock = 16;

// Whether s[0..15] are 16 consecutive slots.
inline bool consecutive16(const int64_t* s) {
  const __m512i base = _mm512_set1_epi64(s[0]);
  const __m512i lo = _mm512_add_epi64(base, _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
  const __m512i hi = _mm512_add_epi64(base, _mm512_set_epi64(15, 14, 13, 12, 11, 10, 9, 8));
  return (_mm512_cmpeq_epi64_mask(_mm512_loadu_si512(s), lo) &
          _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(s + 8), hi)) == 0xFF;
}

// The rows of a 16-key block's slots s[0 .. n): in place where they are 16 consecutive
// slots, else copied into buf [16][row] with zero rows from n on.
inline const uint16_t* block_rows(const uint16_t* pool, const int64_t* s, int64_t n, int64_t row,
                                  uint16_t* buf) {
  if (n == kKeyBlock && consecutive16(s)) return pool + s[0] * row;
  for (int64_t i = 0; i < kKeyBlock; ++i) {
    if (i < n) std::memcpy(buf + i * row, pool + s[i] * row, row * sizeof(uint16_t));
    else std::memset(buf + i * row, 0, row * sizeof(uint16_t));
  }
  return buf;
}

// The block `kBlocksAhead` ahead into L2. Tile loads that miss stall the tile unit in turn
// (about 10 GB/s per core here), so the block should be in L2 when they come; prefetching
// every line of it instead fills the core's line-fill buffers and measured slower than none.
// Two lines per 4 KB start the L2's own streamer on the block (random 6 KB blocks: 21-23
// GB/s on two cores, against 17 with no prefetch and 14 with every line prefetched).
constexpr int64_t kBlocksAhead = 2;
inline void prefetch_block(const uint16_t* pool, const int64_t* s, int64_t n, int64_t row) {
  if (n == kKeyBlock && consecutive16(s)) {
    const char* c = reinterpret_cast<const char*>(pool + s[0] * row);
    for (int64_t o = 0; o < kKeyBlock * row * 2; o += 4096) {
      _mm_prefetch(c + o, _MM_HINT_T1);
      _mm_prefetch(c + o + 64, _MM_HINT_T1);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) prefetch_row(pool + s[i] * row, row);
  }
}

// Block b's rows (block_rows), block b + kBlocksAhead's prefetched first.
inline const uint16_t* stream_block(const uint16_t* pool, const int64_t* slots, int64_t b,
                                    int64_t L, int64_t row, uint16_t* buf) {
  const int64_t ahead = (b + kBlocksAhead) * kKeyBlock, t0 = b * kKeyBlock;
  if (ahead < L) prefetch_block(pool, slots + ahead, std::min<int64_t>(kKeyBlock, L - ahead), row);
  return block_rows(pool, slots + t0, std::min<int64_t>(kKeyBlock, L - t0), row, buf);
}

// r[0..15] (16 x 16 dwords) transposed in place.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Each 128-bit lane now holds a 4 x 4 block: rows 4a..4a+3 of lane l are columns
  // 4l..4l+3 of rows 4a..; gather the lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

struct DecodeScratch {
  std::vector<uint32_t> qt;    // [kv heads of the group][NP][16 dim pairs][16 columns]
  std::vector<float> sc;       // [blocks * 16 keys][16 columns]
  std::vector<uint32_t> pe;    // [blocks][16 columns][16 keys]: bf16 P in each dword's low half
  std::vector<uint32_t> po;    // the same in the high half
  std::vector<uint16_t> kbuf;  // [16][row], a copied block
  std::vector<uint16_t> vbuf;
};

// Scores: tile 0 S^T (C), 1 a key chunk (A), 2 a query chunk (B), all 16 rows.
inline void configure_score_tiles() { configure_full_tiles(); }

// P.V for M query columns of one KV head: 0-1 P even / odd (A, M rows), 2-3 two value chunks
// (B, 16 keys), 4-7 outputs (C, M rows: chunk 0 even, odd dims, chunk 1 even, odd).
inline void configure_value_tiles(int64_t M) {
  kvray_amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t == 2 || t == 3 ? 16 : static_cast<uint8_t>(M);
    cfg.colsb[t] = 64;
  }
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");  // see configure_full_tiles
  _tile_loadconfig(&cfg);
}

// One request's decode attention for query heads c0 .. c0 + nc - 1: whole KV heads where
// G <= 16 (M = G columns per KV head), else a chunk of one KV head's columns (M = nc).
template <int NP>  // head_dim = 32 NP
void decode_group_tiles(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                        const int64_t* slots, int64_t L, int64_t Hkv, int64_t G, int64_t c0,
                        int64_t nc, float scale, uint16_t* out, DecodeScratch& s) {
  constexpr int64_t D = NP * 32;
  const int64_t row = Hkv * D, h0 = c0 / G, nh = (c0 + nc - 1) / G - h0 + 1;
  const int64_t M = nh == 1 ? nc : G;
  const int64_t nblk = (L + kKeyBlock - 1) / kKeyBlock;
  s.qt.assign(nh * NP * 256, 0u);
  s.sc.resize(nblk * 256);
  s.pe.resize(nblk * 256);
  s.po.resize(nblk * 256);
  s.kbuf.resize(kKeyBlock * row);
  s.vbuf.resize(kKeyBlock * row);
  for (int64_t c = 0; c < nc; ++c) {  // column c's query, dim pair 16 j + r -> qt[hh][j][r][c]
    const int64_t hh = (c0 + c) / G - h0;
    const auto* qd = reinterpret_cast<const uint32_t*>(q + (c0 + c) * D);
    for (int64_t j = 0; j < NP; ++j)
      for (int64_t r = 0; r < 16; ++r) s.qt[((hh * NP + j) * 16 + r) * 16 + c] = qd[16 * j + r];
  }
  // Scores.
  configure_score_tiles();
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t t0 = b * kKeyBlock;
    const uint16_t* kb = stream_block(k, slots, b, L, row, s.kbuf.data());
    _tile_zero(0);
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t j = 0; j < NP; ++j) {
        _tile_loadd(1, kb + (h0 + hh) * D + 32 * j, row * 2);
        _tile_loadd(2, s.qt.data() + (hh * NP + j) * 256, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
    _tile_stored(0, s.sc.data() + t0 * 16, 64);
  }
  // Softmax: each column's max over the context, then P (bf16, transposed) and its sum.
  // A block's scores are transposed first, so that only the nc columns in use (9 of the
  // embedded model's 16) take an exp: a vector per column, its 16 keys in the lanes.
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < L; ++t) m = _mm512_max_ps(m, _mm512_loadu_ps(s.sc.data() + t * 16));
  alignas(64) float mcol[16];
  _mm512_store_ps(mcol, m);
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 colsum[16];
  for (int64_t c = 0; c < nc; ++c) colsum[c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t t0 = b * kKeyBlock, n = std::min<int64_t>(kKeyBlock, L - t0);
    const auto keys = static_cast<__mmask16>((1u << n) - 1);  // lanes of real keys
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = i < n ? _mm512_loadu_si512(s.sc.data() + (t0 + i) * 16) : _mm512_setzero_si512();
    transpose16(r);  // r[c]: column c's 16 scores
    for (int64_t c = 0; c < nc; ++c) {
      const __m512 x =
          _mm512_mul_ps(_mm512_sub_ps(_mm512_castsi512_ps(r[c]), _mm512_set1_ps(mcol[c])), vscale);
      const __m512i p = _mm512_maskz_cvtepu16_epi32(keys, (__m256i)_mm512_cvtneps_pbh(exp16(x)));
      colsum[c] = _mm512_add_ps(colsum[c], _mm512_castsi512_ps(_mm512_slli_epi32(p, 16)));
      _mm512_storeu_si512(s.pe.data() + b * 256 + c * 16, p);
      _mm512_storeu_si512(s.po.data() + b * 256 + c * 16, _mm512_slli_epi32(p, 16));
    }
  }
  alignas(64) float sums[16];
  for (int64_t c = 0; c < nc; ++c) sums[c] = _mm512_reduce_add_ps(colsum[c]);
  // P.V per KV head, two 32-dim chunks at a time.
  configure_value_tiles(M);
  alignas(64) float ob[4][256];
  alignas(64) static const int32_t lo_idx[16] = {0, 16, 1, 17, 2, 18, 3, 19,
                                                 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int32_t hi_idx[16] = {8,  24, 9,  25, 10, 26, 11, 27,
                                                 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const int64_t cb = nh == 1 ? 0 : hh * G;  // the head's first column in the group
    for (int64_t j0 = 0; j0 < NP; j0 += 2) {
      const bool two = j0 + 1 < NP;
      _tile_zero(4);
      _tile_zero(5);
      if (two) {
        _tile_zero(6);
        _tile_zero(7);
      }
      for (int64_t b = 0; b < nblk; ++b) {
        const uint16_t* vb = stream_block(v, slots, b, L, row, s.vbuf.data());
        const uint16_t* vh = vb + (h0 + hh) * D + 32 * j0;
        _tile_loadd(0, s.pe.data() + b * 256 + cb * 16, 64);
        _tile_loadd(1, s.po.data() + b * 256 + cb * 16, 64);
        _tile_loadd(2, vh, row * 2);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 1, 2);
        if (two) {
          _tile_loadd(3, vh + 32, row * 2);
          _tile_dpbf16ps(6, 0, 3);
          _tile_dpbf16ps(7, 1, 3);
        }
      }
      _tile_stored(4, ob[0], 64);
      _tile_stored(5, ob[1], 64);
      if (two) {
        _tile_stored(6, ob[2], 64);
        _tile_stored(7, ob[3], 64);
      }
      // out[c][32 j + 2 n + e] = ob[2 (j - j0) + e][c - cb][n] / sum[c]
      for (int64_t i = 0; i < M; ++i) {
        const int64_t c = cb + i;
        const __m512 inv = _mm512_set1_ps(1.0f / sums[c]);
        for (int64_t jj = 0; jj < (two ? 2 : 1); ++jj) {
          const __m512 e = _mm512_load_ps(ob[2 * jj] + i * 16);
          const __m512 o = _mm512_load_ps(ob[2 * jj + 1] + i * 16);
          uint16_t* dst = out + (c0 + c) * D + 32 * (j0 + jj);
          store16(dst, _mm512_mul_ps(_mm512_permutex2var_ps(e, il, o), inv));
          store16(dst + 16, _mm512_mul_ps(_mm512_permutex2var_ps(e, ih, o), inv));
        }
      }
    }
  }
}

template <int NP>
void decode_tiles(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* pt,
                  const int64_t* lens, uint16_t* out, int64_t B, int64_t Hq, int64_t Hkv,
                  int64_t Lmax, int64_t qs, float scale) {
  constexpr int64_t D = NP * 32;
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    DecodeScratch s;
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* qb = q + b * qs;
      uint16_t* ob = out + b * Hq * D;
      if (G <= 16) {  // whole KV heads, as many as 16 columns hold
        const int64_t cols = (16 / G) * G;
        for (int64_t c0 = 0; c0 < Hq; c0 += cols)
          decode_group_tiles<NP>(qb, k, v, pt + b * Lmax, lens[b], Hkv, G, c0,
                                 std::min<int64_t>(cols, Hq - c0), scale, ob, s);
      } else {  // 16 columns of one KV head at a time
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t g0 = 0; g0 < G; g0 += 16)
            decode_group_tiles<NP>(qb, k, v, pt + b * Lmax, lens[b], Hkv, G, h * G + g0,
                                   std::min<int64_t>(16, G - g0), scale, ob, s);
      }
    }
    _tile_release();
  });
}

bool try_decode_tiles(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* pt,
                      const int64_t* lens, uint16_t* out, int64_t B, int64_t Hq, int64_t Hkv,
                      int64_t D, int64_t Lmax, int64_t qs, float scale) {
  if (!kvray_amx::tiles_permitted()) return false;
  switch (D) {
    case 32:
      decode_tiles<1>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, qs, scale);
      return true;
    case 64:
      decode_tiles<2>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, qs, scale);
      return true;
    case 128:
      decode_tiles<4>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, qs, scale);
      return true;
    case 256:
      decode_tiles<8>(q, k, v, pt, lens, out, B, Hq, Hkv, Lmax, qs, scale);
      return true;
    default:
      return false;
  }
}
#endif  // KVRAY_AMX

// 16 lanes of the bf16 pair at p, as one VDPBF16PS operand.
inline __m512bh pair16(const uint16_t* p) {
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}
inline __m512bh row16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// Rows handled at once by the dot-product kernel: 8 rows x 2 vectors of sums in registers.
constexpr int64_t kDpRows = 8;

// sbuf [16][32] = qbuf [16][D] . keys of the 32-key block at kblock (two 16-key blocks of
// kp), for the first `rows` query rows (8 or 16).
template <int NP>
inline void scores_dp(const uint16_t* qbuf, int64_t rows, const uint16_t* kblock, float* sbuf) {
  constexpr int64_t D = NP * 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kDpRows) {
    __m512 acc[kDpRows][2];
    for (int64_t i = 0; i < kDpRows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < NP; ++j)
      for (int64_t r = 0; r < 16; ++r) {  // dim pair 16 j + r
        const __m512bh k0 = row16(kblock + (j * 16 + r) * 32);
        const __m512bh k1 = row16(kblock + ((NP + j) * 16 + r) * 32);
        const uint16_t* qp = qbuf + r0 * D + 32 * j + 2 * r;
        for (int64_t i = 0; i < kDpRows; ++i) {
          const __m512bh qi = pair16(qp + i * D);
          acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qi, k0);
          acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qi, k1);
        }
      }
    for (int64_t i = 0; i < kDpRows; ++i) {
      _mm512_store_ps(sbuf + (r0 + i) * 32, acc[i][0]);
      _mm512_store_ps(sbuf + (r0 + i) * 32 + 16, acc[i][1]);
    }
  }
}

// o [16][D] += pbuf [16][32] . the values of the 32-key block at vblock (vp's layout), for
// the first `rows` query rows, two 16-dim chunks at a time.
template <int NC>
inline void pv_dp(const uint16_t* pbuf, int64_t rows, const uint16_t* vblock, float* o) {
  constexpr int64_t D = NC * 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kDpRows)
    for (int64_t c = 0; c < NC; c += 2) {
      __m512 acc[kDpRows][2];
      for (int64_t i = 0; i < kDpRows; ++i) {
        acc[i][0] = _mm512_load_ps(o + (r0 + i) * D + 16 * c);
        acc[i][1] = _mm512_load_ps(o + (r0 + i) * D + 16 * c + 16);
      }
      for (int64_t r = 0; r < 16; ++r) {  // key pair r
        const __m512bh v0 = row16(vblock + (c * 16 + r) * 32);
        const __m512bh v1 = row16(vblock + ((c + 1) * 16 + r) * 32);
        const uint16_t* pp = pbuf + r0 * 32 + 2 * r;
        for (int64_t i = 0; i < kDpRows; ++i) {
          const __m512bh pi = pair16(pp + i * 32);
          acc[i][0] = _mm512_dpbf16_ps(acc[i][0], pi, v0);
          acc[i][1] = _mm512_dpbf16_ps(acc[i][1], pi, v1);
        }
      }
      for (int64_t i = 0; i < kDpRows; ++i) {
        _mm512_store_ps(o + (r0 + i) * D + 16 * c, acc[i][0]);
        _mm512_store_ps(o + (r0 + i) * D + 16 * c + 16, acc[i][1]);
      }
    }
}

// attend_block_tiles' block on AVX-512 BF16 dot products: the same packed K/V, blocks and
// softmax; padding rows past nq (to a multiple of 8) are computed on zero queries and dropped.
// P.V runs twice, on each probability's bf16 rounding and on what the rounding left (half the
// block's products again): bf16 P alone tipped near ties that float32 attention does not (a
// chat answer's first token at logprobs -1.88 against -1.90), where torch's bf16 SDPA and
// float32 agreed.
template <int NC>
void attend_block_dp(const uint16_t* q, int64_t q_row_stride, int64_t nq, int64_t first_pos,
                     int64_t L, const uint16_t* kp, const uint16_t* vp, float scale, uint16_t* out,
                     int64_t out_row_stride) {
  constexpr int64_t D = NC * 16, NP = D / 32;
  alignas(64) uint16_t qbuf[16 * D];
  alignas(64) float sbuf[16 * 32];
  alignas(64) uint16_t pbuf[16 * 32];
  alignas(64) uint16_t plo[16 * 32];
  alignas(64) float lacc[16 * 16];
  alignas(64) float o[16 * D];
  alignas(64) float alpha[16];
  float m[16];
  load_queries(q, q_row_stride, nq, D, qbuf);
  std::fill(o, o + 16 * D, 0.0f);
  std::fill(lacc, lacc + 16 * 16, 0.0f);
  std::fill(m, m + 16, -INFINITY);
  const int64_t rows = nq <= kDpRows ? kDpRows : 2 * kDpRows;
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t kend = std::min<int64_t>(L, first_pos + nq);  // keys the last row sees
  for (int64_t k0 = 0; k0 < kend; k0 += 32) {
    scores_dp<NP>(qbuf, rows, kp + (k0 / 16) * NP * 16 * 32, sbuf);
    if (softmax_block(sbuf, pbuf, lacc, m, alpha, nq, first_pos, k0, L, vscale, plo))
      rescale_rows(o, alpha, D);
    pv_dp<NC>(pbuf, rows, vp + (k0 / 32) * NC * 16 * 32, o);
    pv_dp<NC>(plo, rows, vp + (k0 / 32) * NC * 16 * 32, o);
  }
  finish_rows(o, lacc, nq, D, out, out_row_stride);
}

// The block function for head_dim D (32, 64, 128 or 256), on the tiles or dot products.
BlockFn extend_block(int64_t D, bool tiles) {
#ifdef KVRAY_AMX
  if (tiles)
    return D == 32    ? attend_block_tiles<2>
           : D == 64  ? attend_block_tiles<4>
           : D == 128 ? attend_block_tiles<8>
                      : attend_block_tiles<16>;
#endif
  (void)tiles;
  return D == 32    ? attend_block_dp<2>
         : D == 64  ? attend_block_dp<4>
         : D == 128 ? attend_block_dp<8>
                    : attend_block_dp<16>;
}
#endif  // __AVX512BF16__
}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor pt,
                           torch::Tensor lens, double scale, bool tiles) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [B,Hq,D], k/v [slots,Hkv,D]");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && pt.is_contiguous());
  // Each request's Hq x D queries contiguous; the rows may be a view into a wider projection.
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  const int64_t qs = q.stride(0);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type());
  TORCH_CHECK(pt.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), Lmax = pt.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && Hq % Hkv == 0, "need head_dim % 16 == 0, <= 256");
  auto out = torch::empty({B, Hq, D}, q.options());
  if (q.scalar_type() == torch::kBFloat16) {
#ifdef __AVX512BF16__
#ifdef KVRAY_AMX
    if (tiles &&
        try_decode_tiles(reinterpret_cast<const uint16_t*>(q.data_ptr()),
                         reinterpret_cast<const uint16_t*>(k.data_ptr()),
                         reinterpret_cast<const uint16_t*>(v.data_ptr()), pt.data_ptr<int64_t>(),
                         lens.data_ptr<int64_t>(), reinterpret_cast<uint16_t*>(out.data_ptr()), B,
                         Hq, Hkv, D, Lmax, qs, static_cast<float>(scale)))
      return out;
#endif
    (void)tiles;
    if (try_decode_bf16(reinterpret_cast<const uint16_t*>(q.data_ptr()),
                        reinterpret_cast<const uint16_t*>(k.data_ptr()),
                        reinterpret_cast<const uint16_t*>(v.data_ptr()), pt.data_ptr<int64_t>(),
                        lens.data_ptr<int64_t>(), reinterpret_cast<uint16_t*>(out.data_ptr()), B,
                        Hq, Hkv, D, Lmax, qs, static_cast<float>(scale)))
      return out;
#endif
    decode<uint16_t>(reinterpret_cast<const uint16_t*>(q.data_ptr()),
                     reinterpret_cast<const uint16_t*>(k.data_ptr()),
                     reinterpret_cast<const uint16_t*>(v.data_ptr()), pt.data_ptr<int64_t>(),
                     lens.data_ptr<int64_t>(), reinterpret_cast<uint16_t*>(out.data_ptr()), B, Hq,
                     Hkv, D, Lmax, qs, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "bfloat16 or float32 only");
    decode<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                  pt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, Hq,
                  Hkv, D, Lmax, qs, static_cast<float>(scale));
  }
  return out;
}

// q [T, Hq, D] bf16 (last dim contiguous), k/v [slots, Hkv, D] the layer's pool, out like q.
// Extend e: queries are rows qstart[e] .. qstart[e] + lq[e] - 1, its context's slots are
// slots[kstart[e] .. kstart[e + 1]) (the queries' own keys last). Writes those rows of out.
// On AMX tiles where the CPU and OS give them and `tiles` allows, else on AVX-512 BF16 dot
// products; false (nothing computed) on a CPU with neither, or another dtype or head size.
bool paged_extend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                  torch::Tensor kstart, torch::Tensor qstart, torch::Tensor lq, double scale,
                  torch::Tensor out, bool tiles) {
#ifdef __AVX512BF16__
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k.size(1), E = qstart.size(0);
  if (q.scalar_type() != torch::kBFloat16 || k.scalar_type() != torch::kBFloat16 ||
      (D != 32 && D != 64 && D != 128 && D != 256) || Hq % Hkv || q.stride(2) != 1 ||
      out.stride(2) != 1 || !k.is_contiguous() || !v.is_contiguous())
    return false;
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && kstart.scalar_type() == torch::kInt64);
#ifdef KVRAY_AMX
  tiles = tiles && kvray_amx::tiles_permitted();
#else
  tiles = false;
#endif
  const BlockFn block = extend_block(D, tiles);
  const int64_t G = Hq / Hkv, row = Hkv * D;
  const auto* kq = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kk = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* kv = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* ko = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ks = kstart.data_ptr<int64_t>();
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int64_t* ql = lq.data_ptr<int64_t>();
  // Packed K/V of every (extend, KV head): offsets in elements.
  std::vector<int64_t> koff(E * Hkv + 1, 0), voff(E * Hkv + 1, 0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t L = ks[e + 1] - ks[e];
      koff[e * Hkv + h + 1] = koff[e * Hkv + h] + (L + 31) / 32 * 32 * D;
      voff[e * Hkv + h + 1] = voff[e * Hkv + h] + (L + 31) / 32 * 32 * D;
    }
  std::vector<uint16_t> kp(koff.back()), vp(voff.back());
  at::parallel_for(0, E * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / Hkv, h = i % Hkv;
      pack_kv(kk, kv, sl + ks[e], ks[e + 1] - ks[e], h, row, D, kp.data() + koff[i],
              vp.data() + voff[i]);
    }
  });
  // Tasks: (extend, query head, block of 16 queries).
  std::vector<int64_t> tstart(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) tstart[e + 1] = tstart[e] + Hq * ((ql[e] + 15) / 16);
  const int64_t qrs = q.stride(0), qhs = q.stride(1), ors = out.stride(0), ohs = out.stride(1);
  at::parallel_for(0, tstart[E], 1, [&](int64_t begin, int64_t end) {
#ifdef KVRAY_AMX
    if (tiles) configure_full_tiles();
#endif
    int64_t e = std::upper_bound(tstart.begin(), tstart.end(), begin) - tstart.begin() - 1;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= tstart[e + 1]) ++e;
      const int64_t local = t - tstart[e], nqb = (ql[e] + 15) / 16;
      const int64_t hq = local / nqb, qb = local % nqb, h = hq / G;
      const int64_t L = ks[e + 1] - ks[e], q0 = qb * 16, nq = std::min<int64_t>(16, ql[e] - q0);
      const int64_t row0 = qs[e] + q0;
      block(kq + row0 * qrs + hq * qhs, qrs, nq, L - ql[e] + q0, L, kp.data() + koff[e * Hkv + h],
            vp.data() + voff[e * Hkv + h], static_cast<float>(scale), ko + row0 * ors + hq * ohs,
            ors);
    }
#ifdef KVRAY_AMX
    if (tiles) _tile_release();
#endif
  });
  return true;
#else
  (void)tiles;
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_extend", &paged_extend, "prefill attention over a paged KV pool", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("kstart"), py::arg("qstart"),
        py::arg("lq"), py::arg("scale"), py::arg("out"), py::arg("tiles") = true);
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV pool", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("pt"), py::arg("lens"), py::arg("scale"),
        py::arg("tiles") = true);
}
