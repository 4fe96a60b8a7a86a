// Paged attention for CPUs with AVX2 and FMA (cpu_avx2.py): every request of a step, decodes
// and extends alike, attends over its whole context read in place through its slots, in one
// call per layer. Flash-style: keys in blocks of KB, an online softmax in float32, products
// summed in float32 (bfloat16 pools are widened on load, the output rounded to nearest even).
//
// Task: (request, KV heads, block of QB query positions); its rows are those positions times
// the G query heads sharing each KV head, so each block of K/V is read once for all of them.
// With enough tasks for the threads a task takes all of a slot's KV heads (its reads are then
// contiguous runs the hardware prefetchers follow), else one. Tasks are taken from a shared
// counter by torch's threads: a long prompt's late blocks (which see more keys) do not pile
// up on one thread. Scores are dot products of 8 keys at a time; the weighted sum of V runs
// two rows at a time, so each V value loaded serves both.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t KB = 32;                    // keys per block
constexpr int64_t QB = 16;                    // query positions per task
constexpr int64_t MAX_D = 256;                // head_dim bound (a multiple of 8)
constexpr int64_t MAX_G = 16;                 // query heads per KV head bound
constexpr int64_t MAX_ROWS = 2 * QB * MAX_G;  // rows of a task, all its heads'

using bf16 = uint16_t;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void store_row(float* dst, const float* src, int64_t D) { std::memcpy(dst, src, D * 4); }
inline void store_row(bf16* dst, const float* src, int64_t D) {
  for (int64_t d = 0; d < D; ++d) {  // round to nearest even, as c10::BFloat16 does
    uint32_t u;
    std::memcpy(&u, src + d, 4);
    dst[d] = std::isnan(src[d]) ? bf16(0x7FC0) : bf16((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
}
template <typename T>
inline void prefetch_row(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}
template <typename T>
inline void load_row(float* dst, const T* src, int64_t D) {
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
}

// e^x for 8 lanes, x <= 0 (scores less their running max; -inf for keys a row cannot see):
// x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes' expf), 2^n through
// the exponent bits. Lanes below -87 (e^x under float's normal range) give 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// The 8 dot products of q (D floats) with keys k[0..7], one per lane.
template <typename T>
inline __m256 dot8(const float* q, const T* const* k, int64_t D) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(k[j] + d), a[j]);
  }
  // Transpose-and-add: lane j of the result is the sum of a[j]'s lanes.
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// Two rows at once: o0 = o0 * a0 + sum_j p0[j] v[j], o1 likewise, j < n; each value of v
// is loaded once for both. Chunks of 32 floats keep 8 independent accumulators in registers
// (one chain per register would wait on the FMA latency at every key); a head_dim that is
// not a multiple of 32 ends in chunks of 8.
template <typename T>
inline void accumulate2(float* o0, float* o1, float a0, float a1, const float* p0, const float* p1,
                        const T* const* v, int64_t n, int64_t D) {
  const __m256 s0 = _mm256_set1_ps(a0), s1 = _mm256_set1_ps(a1);
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(o0 + d0), s0);
    __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(o0 + d0 + 8), s0);
    __m256 x2 = _mm256_mul_ps(_mm256_loadu_ps(o0 + d0 + 16), s0);
    __m256 x3 = _mm256_mul_ps(_mm256_loadu_ps(o0 + d0 + 24), s0);
    __m256 y0 = _mm256_mul_ps(_mm256_loadu_ps(o1 + d0), s1);
    __m256 y1 = _mm256_mul_ps(_mm256_loadu_ps(o1 + d0 + 8), s1);
    __m256 y2 = _mm256_mul_ps(_mm256_loadu_ps(o1 + d0 + 16), s1);
    __m256 y3 = _mm256_mul_ps(_mm256_loadu_ps(o1 + d0 + 24), s1);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 b0 = _mm256_set1_ps(p0[j]), b1 = _mm256_set1_ps(p1[j]);
      const T* vj = v[j] + d0;
      __m256 w = load8(vj);
      x0 = _mm256_fmadd_ps(b0, w, x0);
      y0 = _mm256_fmadd_ps(b1, w, y0);
      w = load8(vj + 8);
      x1 = _mm256_fmadd_ps(b0, w, x1);
      y1 = _mm256_fmadd_ps(b1, w, y1);
      w = load8(vj + 16);
      x2 = _mm256_fmadd_ps(b0, w, x2);
      y2 = _mm256_fmadd_ps(b1, w, y2);
      w = load8(vj + 24);
      x3 = _mm256_fmadd_ps(b0, w, x3);
      y3 = _mm256_fmadd_ps(b1, w, y3);
    }
    _mm256_storeu_ps(o0 + d0, x0);
    _mm256_storeu_ps(o0 + d0 + 8, x1);
    _mm256_storeu_ps(o0 + d0 + 16, x2);
    _mm256_storeu_ps(o0 + d0 + 24, x3);
    _mm256_storeu_ps(o1 + d0, y0);
    _mm256_storeu_ps(o1 + d0 + 8, y1);
    _mm256_storeu_ps(o1 + d0 + 16, y2);
    _mm256_storeu_ps(o1 + d0 + 24, y3);
  }
  for (; d0 < D; d0 += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(o0 + d0), s0);
    __m256 y = _mm256_mul_ps(_mm256_loadu_ps(o1 + d0), s1);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = load8(v[j] + d0);
      x = _mm256_fmadd_ps(_mm256_set1_ps(p0[j]), w, x);
      y = _mm256_fmadd_ps(_mm256_set1_ps(p1[j]), w, y);
    }
    _mm256_storeu_ps(o0 + d0, x);
    _mm256_storeu_ps(o1 + d0, y);
  }
}

struct Layout {
  int64_t Hq, Hkv, D, G, kv_row;         // kv_row: elements per pool slot (Hkv * D)
  int64_t q_row, q_head, o_row, o_head;  // strides of q and out
  float scale;
};

// One task: `nq` query positions from `q0` of a request with `lq` queries over `L` keys
// (slots `slots`), KV heads h0 .. h0 + nh - 1. Query position i (0-based in the request)
// sees keys 0 .. L - lq + i. Row r = (hh * nq + i) * G + g is query head (h0 + hh) * G + g
// at position i.
template <typename T>
void attend_block(const T* q, const T* k, const T* v, T* out, const int64_t* slots, int64_t L,
                  int64_t lq, int64_t q0, int64_t nq, int64_t h0, int64_t nh, int64_t qrow0,
                  const Layout& s) {
  const int64_t G = s.G, D = s.D, HR = nq * G, R = nh * HR;  // HR: rows per head
  // Each thread's rows of queries, outputs and scores (too large for the stack).
  thread_local std::vector<float> qbuf, obuf, sbuf;
  qbuf.resize(R * D);
  obuf.resize(R * D);
  sbuf.resize(R * KB + 8);
  float* qf = qbuf.data();
  float* o = obuf.data();
  // each row's scores, then probabilities, for a block (32-byte aligned)
  float* sc = sbuf.data() + (8 - reinterpret_cast<uintptr_t>(sbuf.data()) / 4 % 8) % 8;
  alignas(32) float zeros[KB] = {};
  alignas(32) float dummy[MAX_D] = {};  // the odd row's partner: written, never read
  float m[MAX_ROWS], l[MAX_ROWS], alpha[MAX_ROWS];
  int64_t last[MAX_ROWS];  // the last key each row sees
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = hh * HR + i * G + g;
        load_row(qf + r * D, q + (qrow0 + i) * s.q_row + ((h0 + hh) * G + g) * s.q_head, D);
        std::memset(o + r * D, 0, D * 4);
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
        last[r] = L - lq + q0 + i;
      }
  const int64_t keys = L - lq + q0 + nq;  // keys any row of this task sees
  const T* kp[KB + 8];
  const T* vp[KB + 8];
  const __m256 scale = _mm256_set1_ps(s.scale);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < keys; j0 += KB) {
    const int64_t nk = std::min(KB, keys - j0), nk8 = (nk + 7) / 8 * 8;
    // The next block's K/V rows are scattered over pages: without asking for them a block
    // ahead, each read waited on memory (a decode step of 128 requests x 5 positions read
    // its layer's K/V at 3.8 GB/s). A task's heads are adjacent in a slot, so it reads
    // nh * D contiguous elements of each.
    const int64_t next = std::min(KB, keys - j0 - KB);
    for (int64_t j = 0; j < next; ++j) {
      const int64_t off = slots[j0 + KB + j] * s.kv_row + h0 * D;
      prefetch_row(k + off, nh * D);
      prefetch_row(v + off, nh * D);
    }
    for (int64_t hh = 0; hh < nh; ++hh) {
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t off = slots[j0 + j] * s.kv_row + (h0 + hh) * D;
        kp[j] = k + off;
        vp[j] = v + off;
      }
      for (int64_t j = nk; j < nk8; ++j) kp[j] = kp[0];  // lanes masked below
      // Each row's probabilities for this block, zero past the keys it sees (nk8 of them:
      // the block's keys rounded up to whole vectors), and its running softmax's rescale.
      const int64_t r0 = hh * HR, r1 = r0 + HR;
      for (int64_t r = r0; r < r1; ++r) {
        float* p = sc + r * KB;
        const int64_t n = std::min(nk, last[r] - j0 + 1);  // keys of this block row r sees
        if (n <= 0) {
          std::memset(p, 0, nk8 * 4);
          alpha[r] = 1.0f;
          continue;
        }
        __m256 mx = neg_inf;
        const int64_t n8 = (n + 7) / 8 * 8;
        for (int64_t j = 0; j < n8; j += 8) {
          __m256 x = _mm256_mul_ps(dot8(qf + r * D, kp + j, D), scale);
          if (n - j < 8) {
            const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256 keep =
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - j)), idx));
            x = _mm256_blendv_ps(neg_inf, x, keep);
          }
          _mm256_store_ps(p + j, x);
          mx = _mm256_max_ps(mx, x);
        }
        const float m_new = std::max(m[r], hmax8(mx));
        alpha[r] = std::exp(m[r] - m_new);  // 0 for the first block (m = -inf)
        const __m256 mv = _mm256_set1_ps(m_new);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < n8; j += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(p + j), mv));
          _mm256_store_ps(p + j, e);
          sum = _mm256_add_ps(sum, e);
        }
        if (n8 < nk8) std::memset(p + n8, 0, (nk8 - n8) * 4);
        l[r] = l[r] * alpha[r] + hsum8(sum);
        m[r] = m_new;
      }
      // Rows in pairs over the keys either sees (the other's probabilities are 0 past its
      // own keys).
      int64_t r = r0;
      for (; r + 1 < r1; r += 2) {
        const int64_t n = std::min(nk, std::max(last[r], last[r + 1]) - j0 + 1);
        if (n > 0)
          accumulate2(o + r * D, o + (r + 1) * D, alpha[r], alpha[r + 1], sc + r * KB,
                      sc + (r + 1) * KB, vp, n, D);
      }
      if (r < r1) {  // an odd last row, paired with a dummy row of zero weights
        const int64_t n = std::min(nk, last[r] - j0 + 1);
        if (n > 0) accumulate2(o + r * D, dummy, alpha[r], 0.0f, sc + r * KB, zeros, vp, n, D);
      }
    }
  }
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = hh * HR + i * G + g;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; ++d) o[r * D + d] *= inv;
        store_row(out + (qrow0 + i) * s.o_row + ((h0 + hh) * G + g) * s.o_head, o + r * D, D);
      }
}

// KV heads per task: all of a slot's (its K/V rows are then read as one contiguous run, which
// the hardware prefetchers follow) when there are enough tasks for the threads anyway, at
// most MAX_ROWS rows and a divisor of Hkv; else one (a few long requests still spread over
// the threads by head).
int64_t heads_per_task(const int64_t* ql, int64_t E, const Layout& s) {
  int64_t blocks = 0;
  for (int64_t e = 0; e < E; ++e) blocks += (ql[e] + QB - 1) / QB;
  if (blocks < 4 * at::get_num_threads()) return 1;
  int64_t nh = s.Hkv;
  while (nh > 1 && (nh * QB * s.G > MAX_ROWS || s.Hkv % nh)) --nh;
  return nh;
}

template <typename T>
void attend_all(const T* q, const T* k, const T* v, T* out, const int64_t* sl, const int64_t* ks,
                const int64_t* qs, const int64_t* ql, int64_t E, const Layout& s) {
  const int64_t nh = heads_per_task(ql, E, s), groups = s.Hkv / nh;
  std::vector<int64_t> tstart(E + 1, 0);  // tasks of request e: tstart[e] .. tstart[e + 1]
  for (int64_t e = 0; e < E; ++e) tstart[e + 1] = tstart[e] + groups * ((ql[e] + QB - 1) / QB);
  const int64_t tasks = tstart[E];
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t e = std::upper_bound(tstart.begin(), tstart.end(), t) - tstart.begin() - 1;
      const int64_t local = t - tstart[e], nqb = (ql[e] + QB - 1) / QB;
      const int64_t h0 = local / nqb * nh, q0 = (local % nqb) * QB;
      attend_block(q, k, v, out, sl + ks[e], ks[e + 1] - ks[e], ql[e], q0, std::min(QB, ql[e] - q0),
                   h0, nh, qs[e] + q0, s);
    }
  });
}

// q [T, Hq, D] (head_dim contiguous), k/v [slots, Hkv, D] the layer's pool (contiguous),
// out [T, Hq, D] like q. Request e: queries are rows qstart[e] .. qstart[e] + lq[e] - 1 of
// q, its context's slots are slots[kstart[e] .. kstart[e + 1]) (its queries' own keys
// last). Writes those rows of out. False (nothing computed) for a dtype other than float32
// or bfloat16, a head_dim that is not a multiple of 8 up to 256, or more than 16 query
// heads per KV head.
bool paged_attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                  torch::Tensor kstart, torch::Tensor qstart, torch::Tensor lq, double scale,
                  torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3,
              "q/out [T,Hq,D], k/v [slots,Hkv,D]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && kstart.scalar_type() == torch::kInt64 &&
              qstart.scalar_type() == torch::kInt64 && lq.scalar_type() == torch::kInt64);
  TORCH_CHECK(slots.is_contiguous() && kstart.is_contiguous() && qstart.is_contiguous() &&
              lq.is_contiguous());
  const auto dt = q.scalar_type();
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k.size(1), E = qstart.size(0);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == D && out.sizes() == q.sizes(),
              "k/v [slots,Hkv,D] alike, out like q");
  TORCH_CHECK(kstart.numel() == E + 1 && lq.numel() == E, "kstart [E+1], qstart/lq [E]");
  if ((dt != torch::kFloat32 && dt != torch::kBFloat16) || k.scalar_type() != dt ||
      v.scalar_type() != dt || out.scalar_type() != dt || D % 8 || D > MAX_D || Hq % Hkv ||
      Hq / Hkv > MAX_G || q.stride(2) != 1 || out.stride(2) != 1 || !k.is_contiguous() ||
      !v.is_contiguous())
    return false;
  const Layout s{Hq,          Hkv,           D,
                 Hq / Hkv,    Hkv * D,       q.stride(0),
                 q.stride(1), out.stride(0), out.stride(1),
                 float(scale)};
  if (dt == torch::kFloat32) {
    attend_all(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
               slots.data_ptr<int64_t>(), kstart.data_ptr<int64_t>(), qstart.data_ptr<int64_t>(),
               lq.data_ptr<int64_t>(), E, s);
  } else {
    attend_all(reinterpret_cast<const bf16*>(q.data_ptr()),
               reinterpret_cast<const bf16*>(k.data_ptr()),
               reinterpret_cast<const bf16*>(v.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()),
               slots.data_ptr<int64_t>(), kstart.data_ptr<int64_t>(), qstart.data_ptr<int64_t>(),
               lq.data_ptr<int64_t>(), E, s);
  }
  return true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attend", &paged_attend, "attention of every request over a paged KV pool",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("kstart"),
        py::arg("qstart"), py::arg("lq"), py::arg("scale"), py::arg("out"));
}
