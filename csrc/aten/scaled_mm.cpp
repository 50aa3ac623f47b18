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
#include <omp.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <thread>
#include <utility>
#include <vector>

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

// Where the product goes: fp32, or rounded once to nearest even into bf16 or fp16 (as
// `.to(dtype)` rounds), so that no second pass over the result is queued.
enum OutKind : int { kOutFloat = 0, kOutBFloat16 = 1, kOutHalf = 2 };

struct Output {
  void* data;
  int kind;  // OutKind
  int64_t n;

  void put_row(int64_t i, int64_t j0, const float* v, int64_t count) const {
    switch (kind) {
      case kOutBFloat16: {
        uint16_t* o = static_cast<uint16_t*>(data) + i * n + j0;
        for (int64_t j = 0; j < count; ++j) o[j] = bf16_bits(v[j]);
        break;
      }
      case kOutHalf: {
        c10::Half* o = static_cast<c10::Half*>(data) + i * n + j0;
        for (int64_t j = 0; j < count; ++j) o[j] = c10::Half(v[j]);
        break;
      }
      default:
        std::copy(v, v + count, static_cast<float*>(data) + i * n + j0);
    }
  }
};

// How a byte holds its values: looked up in a table of one value (FP8) or of a pair (FP4, low
// nibble first). (Decoding E4M3/E5M2 arithmetically instead measured 2x slower: 5.6 against
// 2.9 ms for an MXFP8 1024^3 product.)
enum Format : int { kTable = 1, kPairs = 2 };

struct Operand {  // rows of FP8/FP4 codes along K, with optional E8M0 scales per 32 of K
  const uint8_t* codes;
  const float* table;        // each code's value (FP4: each byte's pair)
  int format;                // Format
  const uint8_t* scales;     // E8M0 codes in cuBLAS's swizzled 128 x 4 tiles, or null
  const float* scale_table;  // each E8M0 code's value
  int64_t scale_tiles;       // tiles of 4 scales along K: ceil(ceil(K / 32) / 4)
  float safe = 0;            // safe_scale(), computed once per call

  // The scale of row r's kb-th block of 32 (torch.testing's to_blocked layout: per tile of
  // 128 rows x 4 blocks, rows r % 32 outermost, then r / 32 % 4, then kb % 4).
  float scale(int64_t r, int64_t kb) const {
    const int64_t tile = (r / 128) * scale_tiles + kb / 4;
    return scale_table[scales[tile * 512 + (r % 32) * 16 + (r % 128 / 32) * 4 + kb % 4]];
  }

  // The format's least nonzero magnitude: every value is a multiple of it.
  double least() const {
    float v = INFINITY;
    for (int i = 0; i < 256 * format; ++i) {
      const float x = std::fabs(table[i]);
      if (x > 0 && x < v) v = x;
    }
    return v;
  }

  // The least scale (a power of two) at and above which every nonzero value of the format
  // times it is a normal fp32 number, whose upper half is then its exact bf16 value.
  float safe_scale() const {
    const double v = least();
    return v == INFINITY ? 0.0f : static_cast<float>(FLT_MIN / v * 2.0);
  }

  // The least of the scales of `rows` rows (1 without scales).
  double min_scale(int64_t rows, int64_t k) const {
    if (!scales) return 1.0;
    double v = INFINITY;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t kb = 0; kb < (k + 31) / 32; ++kb) v = std::min<double>(v, scale(r, kb));  // NaN: skipped
    }
    return v;
  }
};

// Row r of `x` (cols values along K), times its blocks' scales, into bf16 bits or fp32;
// bf16 output reports whether every rounding was exact.
template <int kFormat, class Out>
__attribute__((optimize("O3", "fp-contract=off")))
inline bool dequantize_row(const Operand& x, int64_t r, int64_t cols, Out* o) {
  constexpr int kPerCode = kFormat == kPairs ? 2 : 1;
  const uint8_t* c = x.codes + r * (cols / kPerCode);
  const int64_t bc = x.scales ? 32 : std::max<int64_t>(cols, 1);
  uint32_t inexact = 0;
  // Blocks hold whole bytes (32 values, or the row); FP4 writes a byte's pair.
  for (int64_t j0 = 0; j0 < cols; j0 += bc) {
    const float s = x.scales ? x.scale(r, j0 / 32) : 1.0f;
    const int64_t b0 = j0 / kPerCode, b1 = std::min(j0 + bc, cols) / kPerCode;
    if constexpr (std::is_same_v<Out, uint16_t>) {
      if (s >= x.safe) {
        // A power of two (E8M0) times an FP8/FP4 value that stays normal: exact in bf16, so
        // its bf16 bits are the fp32 product's upper half. (Infinite products are infinities
        // in both; NaN scales take the general path, which keeps them NaN.)
        for (int64_t q = b0; q < b1; ++q) {
          for (int h = 0; h < kPerCode; ++h) {
            const float p = x.table[c[q] * kPerCode + h] * s;
            uint32_t u;
            std::memcpy(&u, &p, 4);
            o[q * kPerCode + h] = static_cast<uint16_t>(u >> 16);
          }
        }
        continue;
      }
    }
    for (int64_t q = b0; q < b1; ++q) {
      for (int h = 0; h < kPerCode; ++h) {
        const float p = x.table[c[q] * kPerCode + h] * s;
        if constexpr (std::is_same_v<Out, uint16_t>) {
          // BF16 GEMMs take bf16 subnormals as zeros (AVX512-BF16 and AMX): those count as
          // inexact too, however exactly bf16 holds them.
          const uint16_t b = bf16_bits(p);
          const float mag = std::fabs(p);
          inexact |= ((bf16_value(b) != p) | ((mag < FLT_MIN) & (mag > 0))) & (p == p);
          o[q * kPerCode + h] = b;
        } else {
          o[q * kPerCode + h] = p;
        }
      }
    }
  }
  return inexact == 0;
}

template <class Out>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3", "fp-contract=off")))
bool dequantize_rows(const Operand& x, int64_t cols, Out* out, int64_t r0, int64_t r1) {
  bool exact = true;
  for (int64_t r = r0; r < r1; ++r) {
    exact &= x.format == kPairs ? dequantize_row<kPairs>(x, r, cols, out + r * cols)
                                : dequantize_row<kTable>(x, r, cols, out + r * cols);
  }
  return exact;
}

// (rows, cols) values of `x` into a new fp32 tensor.
at::Tensor dequantize_float(const Operand& x, int64_t rows, int64_t cols) {
  at::Tensor t = at::empty({rows, cols}, at::kFloat);
  float* p = t.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { dequantize_rows<float>(x, cols, p, r0, r1); });
  return t;
}

// Hands out [0, total) in chunks to whichever thread of a team asks next: a thread that starts
// late (its core busy with the host's Python) takes fewer, rather than holding the others up.
struct WorkQueue {
  std::atomic<int64_t> next{0};
  template <class F>
  void run(int64_t total, int64_t chunk, F&& f) {
    for (int64_t s; (s = next.fetch_add(chunk, std::memory_order_relaxed)) < total;) {
      f(s, std::min(s + chunk, total));
    }
  }
};

// The kernels here run their phases (decoding, products) in one OpenMP region, with spinning
// barriers between them. With the host thread's OpenMP team and the executor's both alive,
// libgomp counts more threads than cores and lets a waiting team thread spin only briefly
// before it sleeps, and waking it took ~0.2 ms here: an MX 512^3 call with a region per
// phase took 0.69 ms where it took 0.29 ms without the host's team; one region with OpenMP's
// barrier 0.51 ms; with these barriers 0.31 ms.
inline int team_size() { return std::max(1, at::get_num_threads()); }

// One use: each of a team's `n` threads arrives once and waits, spinning, for the others.
struct SpinBarrier {
  std::atomic<int> arrived{0};
  void wait(int n) {
    arrived.fetch_add(1, std::memory_order_acq_rel);
    // Spins a few microseconds, then yields while it waits: when the team shares its cores
    // with other threads (the host's Python), the thread awaited may be the one preempted,
    // and a spinning waiter kept it off its core for milliseconds.
    for (int spins = 0; arrived.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 256) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }
};

// MKL's cblas_gemm_bf16bf16f32 (row-major, A not transposed, B given as its rows along K).
using GemmBf16 = void (*)(int, int, int, int, int, int, float, const void*, int, const void*, int,
                          float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// o[i, j] += (part[i, j] * rows[i * kblocks]) * cols[j] over an mi x nj tile (row strides
// os and ps): one K block's partial product of a result tile, scaled by its rows' and
// columns' block scales and added while both are in cache. Inlined into each caller, so it
// takes the caller's vector width.
__attribute__((always_inline))
inline void scale_accumulate_tile(float* o, int64_t os, const float* part, int64_t ps, int64_t mi,
                                  int64_t nj, const float* rows, int64_t kblocks, const float* cols) {
  for (int64_t i = 0; i < mi; ++i) {
    const float r = rows[i * kblocks];
    float* oi = o + i * os;
    const float* p = part + i * ps;
    for (int64_t j = 0; j < nj; ++j) oi[j] = oi[j] + (p[j] * r) * cols[j];
  }
}

// MX: both operands dequantized to bf16 (exact unless among bf16's subnormals), then one BF16
// GEMM accumulating in fp32, each thread its share of the rows; false if a value was inexact.
bool mx_bf16(const Operand& a, const Operand& b, int64_t m, int64_t n, int64_t k, GemmBf16 mm,
             const Output& out) {
  at::Tensor wide;
  float* f = static_cast<float*>(out.data);
  if (out.kind != kOutFloat) {
    wide = at::empty({m, n}, at::kFloat);
    f = wide.data_ptr<float>();
  }
  at::Tensor a16 = at::empty({m, k}, at::kBFloat16), b16 = at::empty({n, k}, at::kBFloat16);
  auto* ap = static_cast<uint16_t*>(a16.data_ptr());
  auto* bp = static_cast<uint16_t*>(b16.data_ptr());
  std::atomic<bool> exact{true};
  SpinBarrier decoded, done;
  WorkQueue decode, multiply;
#pragma omp parallel num_threads(team_size())
  {
    const int nt = omp_get_num_threads();
    decode.run(m + n, 32, [&](int64_t r0, int64_t r1) {  // rows of A, then of B
      const bool ok = (r0 >= m || dequantize_rows<uint16_t>(a, k, ap, r0, std::min(r1, m))) &&
                      (r1 <= m || dequantize_rows<uint16_t>(b, k, bp, std::max(r0, m) - m, r1 - m));
      if (!ok) exact = false;
    });
    decoded.wait(nt);
    if (exact.load()) {
      multiply.run(m, 128, [&](int64_t r0, int64_t r1) {
        mm(kRowMajor, kNoTrans, kTrans, int(r1 - r0), int(n), int(k), 1.0f, ap + r0 * k, int(k), bp,
           int(k), 0.0f, f + r0 * n, int(n));
        if (out.kind != kOutFloat) {
          for (int64_t i = r0; i < r1; ++i) out.put_row(i, 0, f + i * n, n);
        }
      });
    }
    done.wait(nt);
  }
  return exact.load();
}

// Blockwise through MKL: per 128-wide K block a GEMM of a 256 x 256 result tile (MKL runs
// single-threaded inside the parallel region) into a partial product that stays in cache for
// its rescaling. (Whole-result partials were written to memory and read back once per 128 of
// K, which bounded the kernel.) `mm` 0: fp32 GEMMs.
void blockwise_mkl(const Operand& a, const Operand& b, int64_t m, int64_t n, int64_t k, GemmBf16 mm,
                   const float* rows, const float* cols, float* o) {
  at::Tensor a16 = at::empty({m, k}, at::kBFloat16), b16 = at::empty({n, k}, at::kBFloat16);
  auto* a16p = static_cast<uint16_t*>(a16.data_ptr());
  auto* b16p = static_cast<uint16_t*>(b16.data_ptr());
  at::parallel_for(0, m + n, 16, [&](int64_t r0, int64_t r1) {
    if (r0 < m) dequantize_rows<uint16_t>(a, k, a16p, r0, std::min(r1, m));  // unscaled: exact
    if (r1 > m) dequantize_rows<uint16_t>(b, k, b16p, std::max(r0, m) - m, r1 - m);
  });
  at::Tensor af, bf;
  if (!mm) {
    af = a16.to(at::kFloat);
    bf = b16.to(at::kFloat);
  }
  constexpr int64_t kTile = 256;
  const int64_t kblocks = (k + 127) / 128;
  const int64_t tiles_i = (m + kTile - 1) / kTile, tiles_j = (n + kTile - 1) / kTile;
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
        scale_accumulate_tile(o + i0 * n + j0, n, pp, nj, mi, nj, rows + i0 * kblocks + kb, kblocks,
                              cols + kb * n + j0);
      }
    }
  });
}

// --- On AMX tiles: blockwise with its block scales applied inside the accumulation, as the
// hardware does, and MX ---
// MKL offers no GEMM that rescales per K block, and one MKL call per 128-wide K block of a
// result tile ran at a fraction of a full GEMM's rate (2048^3: 3.2x a bf16 matmul). Here a
// 32 x 32 result block accumulates each K block's product in four AMX tiles, then scales it
// by its rows' and columns' scales and adds it to the block's fp32 sum, which stays in L1.
// MX (operands scaled as they are decoded) is one block of all of K: inside the kernel's one
// OpenMP region it ran faster than MKL's single-threaded GEMM per share of rows (512^3:
// 0.36 against 0.49 ms, 2048^3: 13.0 against 16.4 ms).

// Asks Linux once for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
// oneDNN has usually asked already.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kBlock = 32;   // result rows and columns per block: 2 x 2 tiles of 16 x 16
constexpr int64_t kStep = 32;    // K per tile product (16 pairs of bf16)

// The bf16 bits of each code's value (FP8 and FP4 values are exact in bf16).
std::vector<uint16_t> bf16_table(const Operand& x) {
  std::vector<uint16_t> t(256 * x.format);
  for (size_t i = 0; i < t.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &x.table[i], 4);
    t[i] = static_cast<uint16_t>(u >> 16);
  }
  return t;
}

// Writes row r of an operand's values (K of them) as bf16 bits; false if one was inexact.
using RowDecoder = std::function<bool(int64_t, uint16_t*)>;

// Unscaled FP8/FP4 values (blockwise): looked up in `t16`, exact. (dequantize_row, whose
// exact path gives the same bits, measured 7% slower on blockwise 2048^3: 17.0 against
// 15.9 ms.)
RowDecoder table_rows(const Operand& x, const uint16_t* t16, int64_t k) {
  return [&x, t16, k](int64_t r, uint16_t* o) {
    if (x.format == kPairs) {
      const uint8_t* c = x.codes + r * (k / 2);
      for (int64_t q = 0; q < k / 2; ++q) {
        o[2 * q] = t16[2 * c[q]];
        o[2 * q + 1] = t16[2 * c[q] + 1];
      }
    } else {
      const uint8_t* c = x.codes + r * k;
      for (int64_t j = 0; j < k; ++j) o[j] = t16[c[j]];
    }
    return true;
  };
}

// MX values, times their E8M0 scales.
RowDecoder scaled_rows(const Operand& x, int64_t k) {
  return [&x, k](int64_t r, uint16_t* o) {
    return x.format == kPairs ? dequantize_row<kPairs>(x, r, k, o) : dequantize_row<kTable>(x, r, k, o);
  };
}

// Rows [r0, r1) of A (M, K) as bf16 bits, zero-padded to kp columns (and rows >= M all zero).
bool decode_rows(const RowDecoder& decode, int64_t m, int64_t k, int64_t kp, uint16_t* out,
                 int64_t r0, int64_t r1) {
  bool exact = true;
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* o = out + r * kp;
    if (r < m) exact &= decode(r, o);
    std::fill(o + (r < m ? k : 0), o + kp, uint16_t(0));
  }
  return exact;
}

// Panels [p0, p1) of B, given as its rows along K (N, K), in AMX's layout for bf16 pairs: per
// panel of 16 columns, per pair of k, 16 words (k even in the low half); zero beyond N and K.
// A panel's 16 rows are decoded first, then transposed as 32-bit words (pairs).
__attribute__((optimize("O3")))
bool pack_panels(const RowDecoder& decode, int64_t n, int64_t k, int64_t kp, uint32_t* out,
                 int64_t p0, int64_t p1) {
  const int64_t pairs = kp / 2;
  std::vector<uint32_t> rows(16 * pairs, 0);  // zero beyond k and n
  bool exact = true;
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t c = 0; c < 16; ++c) {
      uint16_t* row = reinterpret_cast<uint16_t*>(rows.data() + c * pairs);
      if (p * 16 + c < n) {
        exact &= decode(p * 16 + c, row);
      } else {
        std::fill(row, row + kp, uint16_t(0));
      }
    }
    uint32_t* panel = out + p * pairs * 16;
    for (int64_t q0 = 0; q0 < pairs; q0 += 64) {  // 64 pairs of 16 rows: 4 KiB in, 4 KiB out
      const int64_t q1 = std::min(q0 + 64, pairs);
      for (int64_t q = q0; q < q1; ++q) {
        for (int64_t c = 0; c < 16; ++c) panel[q * 16 + c] = rows[c * pairs + q];
      }
    }
  }
  return exact;
}

__attribute__((target("amx-tile,amx-bf16,avx512f"), optimize("O3", "fp-contract=off")))
void amx_block(const uint16_t* a16, int64_t kp, const uint32_t* bpack, int64_t i0,
                         int64_t j0, const float* rows, const float* cols, int64_t kblocks,
                         int64_t m, int64_t n, const Output& out) {
  // Without scales (MX, its operands scaled already): one block of all of K.
  const int64_t kblock = rows ? 128 : kp;
  alignas(64) float part[kBlock * kBlock];
  alignas(64) float acc[kBlock * kBlock] = {};
  const int64_t pairs = kp / 2;
  const uint16_t* a0 = a16 + i0 * kp;
  const uint16_t* a1 = a0 + 16 * kp;
  const uint32_t* b0 = bpack + (j0 / 16) * pairs * 16;
  const uint32_t* b1 = b0 + pairs * 16;
  const int64_t mi = std::min(kBlock, m - i0), nj = std::min(kBlock, n - j0);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t kend = std::min<int64_t>((kb + 1) * kblock, kp);
    for (int64_t k0 = kb * kblock; k0 < kend; k0 += kStep) {
      _tile_loadd(4, a0 + k0, kp * 2);
      _tile_loadd(5, a1 + k0, kp * 2);
      _tile_loadd(6, b0 + (k0 / 2) * 16, 64);
      _tile_loadd(7, b1 + (k0 / 2) * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, part, kBlock * 4);
    _tile_stored(1, part + 16, kBlock * 4);
    _tile_stored(2, part + 16 * kBlock, kBlock * 4);
    _tile_stored(3, part + 16 * kBlock + 16, kBlock * 4);
    if (!rows) {
      for (int64_t i = 0; i < mi; ++i) out.put_row(i0 + i, j0, part + i * kBlock, nj);
      return;
    }
    scale_accumulate_tile(acc, kBlock, part, kBlock, mi, nj, rows + i0 * kblocks + kb, kblocks,
                          cols + kb * n + j0);
  }
  for (int64_t i = 0; i < mi; ++i) out.put_row(i0 + i, j0, acc + i * kBlock, nj);
}

__attribute__((target("amx-tile,amx-bf16")))
void amx_blocks(const uint16_t* a16, int64_t kp, const uint32_t* bpack,
                const std::vector<std::pair<int64_t, int64_t>>& blocks, int64_t t0, int64_t t1,
                const float* rows, const float* cols, int64_t kblocks, int64_t m, int64_t n,
                const Output& out) {
  if (t0 >= t1) return;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  for (int64_t t = t0; t < t1; ++t) {
    amx_block(a16, kp, bpack, blocks[t].first, blocks[t].second, rows, cols, kblocks,
                        m, n, out);
  }
  _tile_release();
}

// A times B's rows (N, K) on AMX tiles. Blockwise: `rows` (M, K/128) and `cols` (K/128, N)
// fp32 block scales, as in blockwise_mkl; MX: both null, the decoders scaling. False (and
// `out` unwritten) if a decoded value was inexact in bf16.
bool amx_product(const RowDecoder& da, const RowDecoder& db, int64_t m, int64_t n, int64_t k,
                 const float* rows, const float* cols, const Output& out) {
  const int64_t mp = (m + kBlock - 1) / kBlock * kBlock, np = (n + kBlock - 1) / kBlock * kBlock;
  const int64_t kp = (k + kStep - 1) / kStep * kStep;
  const int64_t kblocks = rows ? (k + 127) / 128 : 1;
  at::Tensor a16 = at::empty({mp, kp}, at::kBFloat16);
  at::Tensor bpack = at::empty({np * kp / 2}, at::kInt);
  auto* ap = static_cast<uint16_t*>(a16.data_ptr());
  auto* bp = reinterpret_cast<uint32_t*>(bpack.data_ptr());
  // Blocks in an order that keeps a strip of B (about 1 MiB) in a core's L2 while the rows of
  // A pass by: strips of columns outermost, then rows, then the strip's columns.
  const int64_t strip = std::clamp<int64_t>((int64_t(1) << 20) / (kp * 2) / kBlock * kBlock, kBlock, np);
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t s0 = 0; s0 < np; s0 += strip)
    for (int64_t i0 = 0; i0 < mp; i0 += kBlock)
      for (int64_t j0 = s0; j0 < std::min(s0 + strip, np); j0 += kBlock) blocks.emplace_back(i0, j0);
  const int64_t nblocks = static_cast<int64_t>(blocks.size());
  SpinBarrier decoded, done;
  WorkQueue decode, multiply;
  std::atomic<bool> exact{true};
  const int64_t panels = np / 16;
#pragma omp parallel num_threads(team_size())
  {
    const int nt = omp_get_num_threads();
    decode.run(mp + panels * 2, 32, [&](int64_t r0, int64_t r1) {  // rows of A, then B's panels
      bool ok = true;
      if (r0 < mp) ok &= decode_rows(da, m, k, kp, ap, r0, std::min(r1, mp));
      if (r1 > mp) ok &= pack_panels(db, n, k, kp, bp, (std::max(r0, mp) - mp) / 2, (r1 - mp) / 2);
      if (!ok) exact = false;
    });
    decoded.wait(nt);
    if (exact.load()) {
      multiply.run(nblocks, 4, [&](int64_t t0, int64_t t1) {
        amx_blocks(ap, kp, bp, blocks, t0, t1, rows, cols, kblocks, m, n, out);
      });
    }
    done.wait(nt);
  }
  return exact.load();
}

}  // namespace

// The blockwise and MX product (M, K) x (K, N) -> (M, N), launched on the device queue by
// the Python side (torch_neuronx/kernels/scaled_mm.py) through compiled::launch_kernel, so it
// runs on the stream's executor and its OpenMP team like any device work. B comes as its N
// rows along K. MX (`a_scales`/`b_scales` given: E8M0 codes, swizzled as cuBLAS takes them,
// with their value table): dequantize, exact in bf16 unless among its subnormals, then one
// product accumulating in fp32 on AMX tiles or by MKL's BF16 GEMM, or in fp32 operands by an
// fp32 GEMM. Blockwise (`rows`, fp32
// (ceil(M / rows_per), K/128) with strides (rows_s0, rows_s1), and `cols`, (K/128,
// ceil(N / cols_per)) likewise): per 128-wide block of K the FP8 product (exact in bf16)
// accumulated in fp32, scaled by its rows' and columns' scales and added to the result, as
// the hardware does. `gemm`: MKL's BF16 GEMM, or 0 (then fp32 GEMMs); `amx`: the host
// has AMX tiles. `out_kind`: OutKind of `out`.
extern "C" void neuron_scaled_blocked_mm(
    int64_t a_codes, int64_t a_table, int64_t a_format, int64_t a_scales, int64_t b_codes,
    int64_t b_table, int64_t b_format, int64_t b_scales, int64_t scale_table, int64_t m,
    int64_t n, int64_t k, int64_t gemm, int64_t amx, int64_t rows, int64_t rows_s0,
    int64_t rows_s1, int64_t rows_per, int64_t cols, int64_t cols_s0, int64_t cols_s1,
    int64_t cols_per, int64_t out, int64_t out_kind) {
  auto ptr = [](int64_t w) { return reinterpret_cast<const void*>(w); };
  const auto* st = static_cast<const float*>(ptr(scale_table));
  const int64_t scale_tiles = ((k + 31) / 32 + 3) / 4;
  auto operand = [&](int64_t codes, int64_t table, int64_t format, int64_t scales) {
    Operand x{static_cast<const uint8_t*>(ptr(codes)), static_cast<const float*>(ptr(table)),
              static_cast<int>(format), static_cast<const uint8_t*>(ptr(scales)), st, scale_tiles};
    x.safe = x.safe_scale();
    return x;
  };
  const Operand a = operand(a_codes, a_table, a_format, a_scales);
  const Operand b = operand(b_codes, b_table, b_format, b_scales);
  const Output o{reinterpret_cast<void*>(out), static_cast<int>(out_kind), n};
  const auto mm = reinterpret_cast<GemmBf16>(gemm);
  // The slower paths compute in fp32, then round once into the output.
  auto via_fp32 = [&](auto&& compute) {
    if (o.kind == kOutFloat) {
      compute(static_cast<float*>(o.data));
      return;
    }
    at::Tensor wide = at::empty({m, n}, at::kFloat);
    float* f = wide.data_ptr<float>();
    compute(f);
    at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) o.put_row(i, 0, f + i * n, n);
    });
  };
  if (!rows) {  // MX
    // BF16 GEMMs flush subnormal products and sums to zero, where an fp32 GEMM keeps them.
    // All values are multiples of their operand's least nonzero magnitude times its least
    // scale, so every product and sum is a multiple of the product of the two: when that is a
    // normal number none of them can be subnormal.
    const bool normal = a.least() * a.min_scale(m, k) * b.least() * b.min_scale(n, k) >= FLT_MIN;
    const bool tiles = amx && amx_permitted();
    if (normal && tiles && amx_product(scaled_rows(a, k), scaled_rows(b, k), m, n, k, nullptr, nullptr, o)) {
      return;
    }
    if (normal && !tiles && mm && mx_bf16(a, b, m, n, k, mm, o)) return;
    via_fp32([&](float* f) {
      at::Tensor result = at::from_blob(f, {m, n}, at::kFloat);
      at::mm_out(result, dequantize_float(a, m, k), dequantize_float(b, n, k).t());
    });
    return;
  }
  // The block scales as given (strided; one per `rows_per` rows of A and `cols_per` columns
  // of B), spread to one per row (M, K/128) and per column (K/128, N).
  const auto* sr = static_cast<const float*>(ptr(rows));
  const auto* sc = static_cast<const float*>(ptr(cols));
  const int64_t kblocks = (k + 127) / 128;
  std::vector<float> re(m * kblocks), ce(kblocks * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t kb = 0; kb < kblocks; ++kb) re[i * kblocks + kb] = sr[(i / rows_per) * rows_s0 + kb * rows_s1];
  for (int64_t kb = 0; kb < kblocks; ++kb)
    for (int64_t j = 0; j < n; ++j) ce[kb * n + j] = sc[kb * cols_s0 + (j / cols_per) * cols_s1];
  const float* pr = re.data();
  const float* pc = ce.data();
  if (amx && amx_permitted()) {
    const std::vector<uint16_t> ta = bf16_table(a), tb = bf16_table(b);
    amx_product(table_rows(a, ta.data(), k), table_rows(b, tb.data(), k), m, n, k, pr, pc, o);
  } else {
    via_fp32([&](float* f) { blockwise_mkl(a, b, m, n, k, mm, pr, pc, f); });
  }
}

int64_t scaled_blocked_mm_entry() { return reinterpret_cast<int64_t>(&neuron_scaled_blocked_mm); }

}  // namespace neuron
