// Linear products of decode-sized batches on the AMX tile unit, bf16 only.
//
//   pack_tiles(w)                     W [N, K] -> the B tiles' layout (below), once per weight
//   linear_tiles(x, tiles, n, bias)   x [M, K] -> x W^T (+ bias) [M, N], bf16
//   silu_mul_tiles(x, tiles, i, table) x [M, K] -> silu(gate) * up [M, I] for W = [gate | up]
//                                     [2 I, K], without the [M, 2 I] product in between
//
// oneDNN's packed product streams the weights slowly when there are few rows to multiply
// (0.03-0.37 TFLOP/s at 1-8 rows here); this kernel reads each weight tile once per call
// and splits the output columns evenly over the threads. Each output is one float32
// accumulator over K in order, on TDPBF16PS, rounded to bf16 once (with the bias added in
// float32 first), whatever M is: a row's result never depends on the other rows (oneDNN's
// does above 32 rows), and for up to 32 rows it is bit for bit what oneDNN's product gives,
// as tests/test_packed_linear.py checks. Which row counts come here is `packed.tile_rows`.

#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVRAY_AMX 1
#include "amx_tiles.h"
#include "bf16_round.h"
#endif

namespace {

using bf16 = uint16_t;
constexpr int64_t kBlockRows = 32;  // two A tiles of 16 rows

#ifdef KVRAY_AMX
using kvray_amx::configure_full_tiles;
using kvray_amx::tiles_permitted;

// The tiles: 0-3 sums (float32 16 x 16: rows 0-15 / 16-31 by columns 0-15 / 16-31 of a
// 32-column block), 4-5 A (16 rows x 32 bf16 of K), 6-7 B (16 K pairs x 16 columns x 2).

// n <= 32 float32 sums (+ bias) -> bf16, rounded to nearest even.
inline void store_row(const float* sums, const float* bias, bf16* dst, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const auto mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(mask, sums + j);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + j));
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    _mm256_mask_storeu_epi16(dst + j, mask, h);
  }
}

// sums [32][32] = rows a (row stride as elements; 32 of them, or 16 unless `two`) times
// one 32-column block of tiles w (K / 32 blocks of K), one float32 sum per output over K in
// order. Rows 16-31 of sums are left as they were unless `two`.
inline void block_sums(const bf16* a, int64_t as, const bf16* w, int64_t KB, bool two,
                       float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < KB; ++k) {
    _tile_loadd(4, a + 32 * k, as * 2);
    _tile_loadd(6, w + k * 1024, 64);
    _tile_loadd(7, w + k * 1024 + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + 16 * as + 32 * k, as * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 128);
  _tile_stored(1, sums + 16, 128);
  if (two) {
    _tile_stored(2, sums + 512, 128);
    _tile_stored(3, sums + 528, 128);
  }
}

// The next column block's weights (K / 32 x 2 KB, contiguous at w): two lines per 4 KB
// start the L2's streamer on them while this block computes; tile loads that miss stall
// the tile unit in turn. 6-13% shorter products at 1-32 rows (the embedded model's
// layers, 8.0 against 8.5 ms at one row: 27 GB/s of weights).
inline void prefetch_block(const bf16* w, int64_t KB) {
  const char* c = reinterpret_cast<const char*>(w);
  for (int64_t o = 0; o < KB * 2048; o += 4096) {
    _mm_prefetch(c + o, _MM_HINT_T1);
    _mm_prefetch(c + o + 64, _MM_HINT_T1);
  }
}

// x's rows as the A tiles read them: whole 32-row blocks in place, the last block's rows
// copied and zero padded to 32 (each A tile reads 16 full rows).
struct RowBlocks {
  const bf16* x;
  int64_t xs, K, full;
  std::vector<bf16> pad;
  RowBlocks(const torch::Tensor& t) {
    x = reinterpret_cast<const bf16*>(t.data_ptr());
    xs = t.stride(0);
    K = t.size(1);
    const int64_t M = t.size(0), tail = M % kBlockRows;
    full = M - tail;
    pad.assign(tail ? kBlockRows * K : 0, 0);
    for (int64_t r = 0; r < tail; ++r) std::memcpy(&pad[r * K], x + (full + r) * xs, K * 2);
  }
  const bf16* rows(int64_t r0) const { return r0 < full ? x + r0 * xs : pad.data(); }
  int64_t stride(int64_t r0) const { return r0 < full ? xs : K; }
};

#endif  // KVRAY_AMX

}  // namespace

#ifdef KVRAY_AMX
bool available() { return tiles_permitted(); }

// W [N, K] (K a multiple of 32) -> tiles [ceil(N / 32), K / 32, 2, 16, 16, 2]:
// tiles[b][k][t][r][c][e] = W[32 b + 16 t + c][32 k + 2 r + e], columns past N zero. Per
// 32-column block, its K blocks in order: a call for few rows reads the weights once,
// front to back per block.
torch::Tensor pack_tiles(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "a 2-D bf16 weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 32 == 0, "pack_tiles: K must be a multiple of 32, got ", K);
  const int64_t NB = (N + 31) / 32, KB = K / 32;
  auto out = torch::zeros({NB, KB, 2, 16, 16, 2}, w.options());
  const auto* W = reinterpret_cast<const bf16*>(w.data_ptr());
  auto* T = reinterpret_cast<bf16*>(out.data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t k = 0; k < KB; ++k)
        for (int64_t t = 0; t < 2; ++t)
          for (int64_t c = 0; c < 16; ++c) {
            const int64_t col = 32 * b + 16 * t + c;
            if (col >= N) continue;
            const bf16* src = W + col * K + 32 * k;
            bf16* dst = T + (((b * KB + k) * 2 + t) * 16) * 32 + 2 * c;
            for (int64_t r = 0; r < 16; ++r) {
              dst[r * 32] = src[2 * r];
              dst[r * 32 + 1] = src[2 * r + 1];
            }
          }
  });
  return out;
}

torch::Tensor linear_tiles(torch::Tensor x, torch::Tensor tiles, int64_t N,
                           std::optional<torch::Tensor> bias) {
  TORCH_CHECK(tiles_permitted(), "the AMX tile registers are not available");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x: 2-D bf16");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = tiles.size(0), KB = tiles.size(1);
  TORCH_CHECK(KB * 32 == K && NB == (N + 31) / 32, "tiles do not match x / N");
  torch::Tensor bias32;
  if (bias.has_value()) bias32 = bias->to(torch::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const int64_t MB = (M + kBlockRows - 1) / kBlockRows;
  const RowBlocks xb(x);
  const auto* T = reinterpret_cast<const bf16*>(tiles.data_ptr());
  const float* B = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  auto* C = reinterpret_cast<bf16*>(out.data_ptr());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), NB));
#pragma omp parallel num_threads(threads)
  {
    configure_full_tiles();
    alignas(64) float sums[32 * 32];
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per = (NB + nt - 1) / nt;
    const int64_t b0 = std::min(NB, per * id), b1 = std::min(NB, b0 + per);
    // Per column block: its weights (K / 32 x 2 KB) are read once and stay in L1 / L2
    // while every 32-row block of x passes over them.
    for (int64_t b = b0; b < b1; ++b) {
      const bf16* w = T + b * KB * 1024;
      const int64_t c0 = 32 * b, cols = std::min<int64_t>(32, N - c0);
      if (b + 1 < b1) prefetch_block(w + KB * 1024, KB);
      for (int64_t mb = 0; mb < MB; ++mb) {
        const int64_t r0 = mb * kBlockRows, rows = std::min<int64_t>(kBlockRows, M - r0);
        block_sums(xb.rows(r0), xb.stride(r0), w, KB, rows > 16, sums);
        for (int64_t r = 0; r < rows; ++r)
          store_row(sums + 32 * r, B != nullptr ? B + c0 : nullptr, C + (r0 + r) * N + c0, cols);
      }
    }
    _tile_release();
  }
  return out;
}

// silu(gate) * up for the [gate | up] product x W^T (W [2 I, K], I a multiple of 32, no
// bias), bit for bit what silu_mul (fused_ops.cpp) gives on linear_tiles' product: gate and
// up rounded to bf16 as linear_tiles rounds them, silu(gate) looked up in `table` (that
// kernel's, 65536 floats by the gate's bits), the product rounded as silu_mul rounds it
// (bf16_round.h).
// Per 32-column block of gate, its block of up comes from the same rows of x.
torch::Tensor silu_mul_tiles(torch::Tensor x, torch::Tensor tiles, int64_t I, torch::Tensor table) {
  TORCH_CHECK(tiles_permitted(), "the AMX tile registers are not available");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x: 2-D bf16");
  TORCH_CHECK(
      table.scalar_type() == torch::kFloat && table.numel() == 65536 && table.is_contiguous(),
      "table: 65536 float32");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = tiles.size(0), KB = tiles.size(1);
  TORCH_CHECK(I % 32 == 0 && NB * 32 == 2 * I && KB * 32 == K, "tiles do not match x / I");
  auto out = torch::empty({M, I}, x.options());
  if (M == 0) return out;
  const int64_t MB = (M + kBlockRows - 1) / kBlockRows, GB = I / 32;
  const RowBlocks xb(x);
  const auto* T = reinterpret_cast<const bf16*>(tiles.data_ptr());
  const float* silu = table.data_ptr<float>();
  auto* C = reinterpret_cast<bf16*>(out.data_ptr());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), GB));
#pragma omp parallel num_threads(threads)
  {
    configure_full_tiles();
    alignas(64) float gate[32 * 32], up[32 * 32];
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per = (GB + nt - 1) / nt;
    const int64_t b0 = std::min(GB, per * id), b1 = std::min(GB, b0 + per);
    for (int64_t b = b0; b < b1; ++b) {
      const bf16* wg = T + b * KB * 1024;
      const bf16* wu = T + (GB + b) * KB * 1024;
      if (b + 1 < b1) {
        prefetch_block(wg + KB * 1024, KB);
        prefetch_block(wu + KB * 1024, KB);
      }
      for (int64_t mb = 0; mb < MB; ++mb) {
        const int64_t r0 = mb * kBlockRows, rows = std::min<int64_t>(kBlockRows, M - r0);
        block_sums(xb.rows(r0), xb.stride(r0), wg, KB, rows > 16, gate);
        block_sums(xb.rows(r0), xb.stride(r0), wu, KB, rows > 16, up);
        for (int64_t r = 0; r < rows; ++r) {
          bf16* dst = C + (r0 + r) * I + 32 * b;
          for (int64_t j = 0; j < 32; j += 16) {
            const __m256i g =
                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(gate + 32 * r + j)));
            const __m256i u =
                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(up + 32 * r + j)));
            const __m512 s = _mm512_i32gather_ps(_mm512_cvtepu16_epi32(g), silu, 4);
            const __m512 uf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u), 16));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                                kvray_bf16::to_bf16(_mm512_mul_ps(s, uf)));
          }
        }
      }
    }
    _tile_release();
  }
  return out;
}

#else   // built for a CPU without AMX: nothing to offer
bool available() { return false; }
torch::Tensor pack_tiles(torch::Tensor w) { TORCH_CHECK(false, "no AMX on this CPU"); }
torch::Tensor linear_tiles(torch::Tensor, torch::Tensor, int64_t, std::optional<torch::Tensor>) {
  TORCH_CHECK(false, "no AMX on this CPU");
}
torch::Tensor silu_mul_tiles(torch::Tensor, torch::Tensor, int64_t, torch::Tensor) {
  TORCH_CHECK(false, "no AMX on this CPU");
}
#endif  // KVRAY_AMX

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this process may use the AMX tiles");
  m.def("pack_tiles", &pack_tiles, "a bf16 weight in the B tiles' layout");
  m.def("linear_tiles", &linear_tiles, "x W^T (+ bias) on AMX tiles, each row on its own");
  m.def("silu_mul_tiles", &silu_mul_tiles, "silu(gate) * up of x [gate | up]^T on AMX tiles");
}
