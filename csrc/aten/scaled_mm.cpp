// torch._scaled_mm's tensorwise FP8 x FP8 product as CPU computes it where oneDNN runs it
// (an AMX-int8 host: mkldnn_scaled_mm), but fast. oneDNN has no optimised FP8 matmul there
// and runs its reference kernel, which gives every k its own scale group:
//     res = 0; for k: res += ((a[i,k] * b[k,j]) * scale_a) * scale_b      (fp32, in order)
// at about 0.1 GFLOPS. The same roundings in the same order, blocked so that a tile of
// results stays in cache and vectorised over j, give bit-identical results about a thousand
// times faster. Why C++: the sum is sequential in k, so no BLAS call can compute it, and a
// Python loop over k costs several passes over the result per k.
// Built with -ffp-contract=off: a fused multiply-add would skip the roundings the reference
// kernel makes (its product times a scale, then the sum).
//
// Also here: the blockwise and MX forms' product (neuron_scaled_blocked_mm), which Python
// launches on the device queue.
#include "aten.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>
#include <type_traits>
#include <utility>

namespace neuron {
namespace {

constexpr int64_t kRows = 32;  // a tile of kRows x kCols fp32 results (16 KiB) stays in L1
constexpr int64_t kCols = 128;

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3", "fp-contract=off")))
void tile(const float* a, const float* b, float* out, int64_t i0, int64_t i1, int64_t j0,
          int64_t j1, int64_t K, int64_t N, float sa, float sb) {
  float acc[kRows][kCols] = {};
  const int64_t w = j1 - j0;
  for (int64_t k = 0; k < K; ++k) {
    const float* brow = b + k * N + j0;
    for (int64_t i = i0; i < i1; ++i) {
      const float p = a[i * K + k];
      float* r = acc[i - i0];
      for (int64_t j = 0; j < w; ++j) {
        float t = p * brow[j];  // exact: two FP8 significands need at most 8 bits
        t = t * sa;
        t = t * sb;
        r[j] = r[j] + t;
      }
    }
  }
  for (int64_t i = i0; i < i1; ++i) {
    std::copy(acc[i - i0], acc[i - i0] + w, out + i * N + j0);
  }
}

}  // namespace

at::Tensor scaled_mm_sequential(const at::Tensor& a, const at::Tensor& b, double scale_a,
                                double scale_b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) &&
                  a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat,
              "scaled_mm_sequential: expects fp32 matrices (M, K) and (K, N), got ", a.sizes(),
              " ", a.scalar_type(), " and ", b.sizes(), " ", b.scalar_type());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::Tensor out = at::empty({M, N}, a.options());
  const float sa = static_cast<float>(scale_a), sb = static_cast<float>(scale_b);
  const float* pa = ac.const_data_ptr<float>();
  const float* pb = bc.const_data_ptr<float>();
  float* po = out.mutable_data_ptr<float>();
  const int64_t row_tiles = (M + kRows - 1) / kRows, col_tiles = (N + kCols - 1) / kCols;
  at::parallel_for(0, row_tiles * col_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i0 = (t / col_tiles) * kRows, j0 = (t % col_tiles) * kCols;
      tile(pa, pb, po, i0, std::min(i0 + kRows, M), j0, std::min(j0 + kCols, N), K, N, sa, sb);
    }
  });
  return out;
}

namespace {

// Round-to-nearest-even fp32 -> bf16 bits (NaN stays NaN), branch-free so that it vectorises.
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}

inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// One row of codes (one value per byte, or two: FP4's low nibble first) looked up in `table`,
// times its block's scale; bf16 output (uint16_t bits) reports whether a rounding was
// inexact, fp32 output rounds the product once.
// How a byte holds its values: looked up in a table of one value (FP8) or of a pair (FP4, low
// nibble first). (Decoding E4M3/E5M2 arithmetically instead measured 2x slower: 5.6 against
// 2.9 ms for an MXFP8 1024^3 product.)
enum Format : int { kTable = 1, kPairs = 2 };

template <int kFormat, class Out>
__attribute__((optimize("O3", "fp-contract=off")))
inline bool dequantize_row(const uint8_t* c, const float* table, const float* srow, int64_t bc,
                           Out* o, int64_t cols) {
  constexpr int kPerCode = kFormat == kPairs ? 2 : 1;
  uint32_t inexact = 0;
  auto put = [&](int64_t j, float p) {
    if constexpr (std::is_same_v<Out, uint16_t>) {
      const uint16_t b = bf16_bits(p);
      inexact |= (bf16_value(b) != p) & (p == p);
      o[j] = b;
    } else {
      o[j] = p;
    }
  };
  // Blocks hold whole bytes (bc is a multiple of 32 or the row); FP4 writes a byte's pair.
  for (int64_t j0 = 0; j0 < cols; j0 += bc) {
    const float s = srow ? srow[j0 / bc] : 1.0f;
    const int64_t b0 = j0 / kPerCode, b1 = std::min(j0 + bc, cols) / kPerCode;
    for (int64_t q = b0; q < b1; ++q) {
      for (int h = 0; h < kPerCode; ++h) put(q * kPerCode + h, table[c[q] * kPerCode + h] * s);
    }
  }
  return inexact == 0;
}

struct Operand {  // rows of FP8/FP4 codes along K, with optional per-row blocks of scales
  const uint8_t* codes;
  const float* table;
  int format;              // Format
  const float* scales;     // (rows, scale_cols) or null
  int64_t scale_cols, bc;  // bc: values per scale along K
};

template <class Out>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3", "fp-contract=off")))
bool dequantize_rows(const Operand& x, int64_t cols, Out* out, int64_t r0, int64_t r1) {
  const int64_t code_cols = x.format == kPairs ? cols / 2 : cols;
  const int64_t bc = x.scales ? x.bc : std::max<int64_t>(1, cols);
  bool exact = true;
  for (int64_t r = r0; r < r1; ++r) {
    const float* srow = x.scales ? x.scales + r * x.scale_cols : nullptr;
    const uint8_t* c = x.codes + r * code_cols;
    Out* o = out + r * cols;
    exact &= x.format == kPairs ? dequantize_row<kPairs>(c, x.table, srow, bc, o, cols)
                                : dequantize_row<kTable>(c, x.table, srow, bc, o, cols);
  }
  return exact;
}

// (rows, cols) values of `x` into a new bf16 (bits) or fp32 tensor; whether all were exact.
template <class Out>
std::pair<at::Tensor, bool> dequantize(const Operand& x, int64_t rows, int64_t cols) {
  at::Tensor t = at::empty({rows, cols}, at::dtype(std::is_same_v<Out, float> ? at::kFloat : at::kBFloat16));
  Out* p = static_cast<Out*>(t.data_ptr());
  std::atomic<bool> exact{true};
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    if (!dequantize_rows<Out>(x, cols, p, r0, r1)) exact = false;
  });
  return {t, exact.load()};
}

// MKL's cblas_gemm_bf16bf16f32 (row-major, A not transposed, B given as its rows along K).
using GemmBf16 = void (*)(int, int, int, int, int, int, float, const void*, int, const void*, int,
                          float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// out[i0:i0+mi, j0:j0+nj] += (part * rows[i, kb]) * cols[kb, j]: one K block's partial product
// of a result tile, scaled and added while both are in cache.
__attribute__((optimize("O3", "fp-contract=off")))
void scale_accumulate_tile(float* out, int64_t n, const float* part, int64_t i0, int64_t mi,
                           int64_t j0, int64_t nj, const float* rows, int64_t kblocks, int64_t kb,
                           const float* cols) {
  for (int64_t i = 0; i < mi; ++i) {
    const float r = rows[(i0 + i) * kblocks + kb];
    float* o = out + (i0 + i) * n + j0;
    const float* p = part + i * nj;
    const float* c = cols + kb * n + j0;
    for (int64_t j = 0; j < nj; ++j) o[j] = o[j] + (p[j] * r) * c[j];
  }
}

}  // namespace

// The blockwise and MX product (M, K) x (K, N) -> fp32 (M, N), launched on the device queue by
// the Python side (torch_neuronx/kernels/scaled_mm.py) through compiled::launch_kernel, so it
// runs on the stream's executor and its OpenMP team like any device work. B comes as its N
// rows along K. MX (`a_scales`/`b_scales` given, E8M0 values as fp32 per `bc` elements):
// dequantize, exact in bf16 unless among its subnormals, then one BF16 GEMM accumulating in
// fp32, or fp32 operands and an fp32 GEMM. Blockwise (`rows` (M, K/128) and `cols`
// (K/128, N) given): per 128-wide block of K the FP8 product (exact in bf16) accumulated in
// fp32, scaled by its rows' and columns' scales and added to the result, as the hardware
// does. `gemm`: MKL's BF16 GEMM, or 0 (then fp32 GEMMs).
extern "C" void neuron_scaled_blocked_mm(
    int64_t a_codes, int64_t a_table, int64_t a_format, int64_t a_scales, int64_t a_scale_cols,
    int64_t a_bc, int64_t b_codes, int64_t b_table, int64_t b_format, int64_t b_scales,
    int64_t b_scale_cols, int64_t b_bc, int64_t m, int64_t n, int64_t k, int64_t gemm,
    int64_t rows, int64_t cols, int64_t out) {
  auto ptr = [](int64_t w) { return reinterpret_cast<const void*>(w); };
  const Operand a{static_cast<const uint8_t*>(ptr(a_codes)), static_cast<const float*>(ptr(a_table)),
                  static_cast<int>(a_format), static_cast<const float*>(ptr(a_scales)), a_scale_cols,
                  a_bc};
  const Operand b{static_cast<const uint8_t*>(ptr(b_codes)), static_cast<const float*>(ptr(b_table)),
                  static_cast<int>(b_format), static_cast<const float*>(ptr(b_scales)), b_scale_cols,
                  b_bc};
  auto* o = reinterpret_cast<float*>(out);
  const auto mm = reinterpret_cast<GemmBf16>(gemm);
  at::Tensor result = at::from_blob(o, {m, n}, at::kFloat);
  if (!rows) {  // MX
    if (mm) {
      auto [a16, a_exact] = dequantize<uint16_t>(a, m, k);
      auto [b16, b_exact] = a_exact ? dequantize<uint16_t>(b, n, k) : std::make_pair(at::Tensor(), false);
      if (a_exact && b_exact) {
        mm(kRowMajor, kNoTrans, kTrans, int(m), int(n), int(k), 1.0f, a16.data_ptr(), int(k),
           b16.data_ptr(), int(k), 0.0f, o, int(n));
        return;
      }
    }
    at::mm_out(result, dequantize<float>(a, m, k).first, dequantize<float>(b, n, k).first.t());
    return;
  }
  // Blockwise: unscaled FP8 values are exact in bf16.
  const auto* pr = static_cast<const float*>(ptr(rows));
  const auto* pc = static_cast<const float*>(ptr(cols));
  at::Tensor a16 = dequantize<uint16_t>(a, m, k).first, b16 = dequantize<uint16_t>(b, n, k).first;
  at::Tensor af, bf;
  if (!mm) {
    af = a16.to(at::kFloat);
    bf = b16.to(at::kFloat);
  }
  // Result tiles of kTile x kTile, one per thread at a time: per K block a GEMM of the tile
  // (MKL runs single-threaded inside the parallel region) into a partial product that stays in
  // cache for its rescaling. Whole-result partials were written to memory and read back once
  // per 128 of K, which bounded the kernel.
  constexpr int64_t kTile = 256;
  const int64_t kblocks = (k + 127) / 128;
  const int64_t tiles_i = (m + kTile - 1) / kTile, tiles_j = (n + kTile - 1) / kTile;
  const auto* a16p = static_cast<const uint16_t*>(a16.data_ptr());
  const auto* b16p = static_cast<const uint16_t*>(b16.data_ptr());
  at::parallel_for(0, tiles_i * tiles_j, 1, [&](int64_t t0, int64_t t1) {
    at::Tensor part = at::empty({kTile * kTile}, at::kFloat);
    float* pp = part.data_ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i0 = (t / tiles_j) * kTile, j0 = (t % tiles_j) * kTile;
      const int64_t mi = std::min(kTile, m - i0), nj = std::min(kTile, n - j0);
      for (int64_t i = 0; i < mi; ++i) std::fill_n(o + (i0 + i) * n + j0, nj, 0.0f);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        const int64_t k0 = kb * 128, kw = std::min<int64_t>(128, k - k0);
        if (mm) {
          mm(kRowMajor, kNoTrans, kTrans, int(mi), int(nj), int(kw), 1.0f, a16p + i0 * k + k0, int(k),
             b16p + j0 * k + k0, int(k), 0.0f, pp, int(nj));
        } else {
          at::Tensor p = at::from_blob(pp, {mi, nj}, at::kFloat);
          at::mm_out(p, af.narrow(0, i0, mi).narrow(1, k0, kw), bf.narrow(0, j0, nj).narrow(1, k0, kw).t());
        }
        scale_accumulate_tile(o, n, pp, i0, mi, j0, nj, pr, kblocks, kb, pc);
      }
    }
  });
}

int64_t scaled_blocked_mm_entry() { return reinterpret_cast<int64_t>(&neuron_scaled_blocked_mm); }

}  // namespace neuron
