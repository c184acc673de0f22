// x times a ggml-quantized base (Q8_0 / Q4_0 / Q4_1 column blocks), plus each row's 1-bit delta:
//   y[m] = x[m] · dequant(W) + α_s ⊙ (x[m] · S_s),   s = slots[m]; s <= 0: the base only.
// W: `blocks.QuantizedKernel` column blocks: qs [K/32, 32|16, N] (q8_0 int8; q4 bytes holding
// weight j in the low nibble and j + 16 in the high one), d (and m for q4_1) f16 [K/32, N].
// Bank row s - first_slot holds slot s (first_slot 1: one variant's bits read in place); S_s in
// the group-local bit-plane layout (`pallas_kernels/bits.py`); α_s one f32 per column.
// x and y f32. act 1 (int8 activations): the base product's x quantized per row and 32-block
// as ggml's Q8_0 with an f32 scale (`QuantizeBlock`), integer block sums (`BlockI8`).
//
// Why: a decode step reads every weight once for a handful of rows; the blocks are 0.56-1.06
// bytes a weight against 4 for f32, so turning them into numbers costs as much as reading them.
// Each block is read once per pass of up to 16 rows: per 8 columns its values are widened to
// f32 in registers (AVX2: vpmovsx/zxbd + vcvtdq2ps; q4_0's nibble − 8 exactly by xor 0x88,
// sign extension and shifts) and FMA'd into the per-block partial sums P of up to 8 rows
// (R rows x C vectors in registers, R·C ≈ 8 independent chains), then y += d·P (+ m·Σ_block x
// for q4_1, ggml's factored order). Threads take column ranges of at least kMinCols first (no
// partials), then runs of whole blocks along K (their own [M, N] partials, added at the end).
// A slot present adds α_s ⊙ (x·S_s) after the task's blocks, reading its bit plane once:
// x·S = 2·x·B − Σx, where 2·x·B is three lookups per packed byte (8 rows of K) and 8 columns
// into 8-entry tables of subset sums of the byte's x values (vpermps; AVX-512: two into 16-entry
// tables per 16 columns; tables and lookups in `native/lut_delta.h`, shared with the f32
// kernel's `LutDelta`). More than 16 rows (prefill chunks):
// passes of 16 rows, each reading the blocks again; the work there is bound by the FMAs
// (8 per weight per pass), not the re-reads (bench/results/kernels/quant_kernel.md). With
// int8 activations and AVX-512 VNNI, more than 8 rows of a pass take `BaseVnniStrips`: each
// block's 64-column strip is transposed for vpdpbusd once and read from L1 by every tile of
// 4 rows (bench/results/kernels/quant_strips.md). With int8 activations and AMX-INT8, more
// than 16 rows take `BaseAmx` in passes of up to kAmxPassRows rows (tile multiplies on each
// block transposed once per pass), 6-16 rows `BaseAmxFew` (bench/results/kernels/quant_amx.md).
//
// int8 activations (act 1), as llama.cpp's CPU dot products but vectorised over columns (N is
// contiguous here): per block, q8_0 pairs of K rows widened to int16 and vpmaddwd'd against a
// broadcast pair of x's int8s; q4 nibbles interleaved per column pair of K rows and
// vpmaddubsw'd (int16 sums per half block, no saturation), int32 per block; then one f32
// step per block and column. No VNNI on the AVX2 machines this was written for.
//
// Numerics: per block Σ x·q in f32 (q exact small integers), times d (f16 widened exactly),
// + m·Σx for q4_1 (so q4_1's rounding scales with |d·q| + |m|, not |d·q + m|); the delta as
// the f32 kernel's lookups, α·(2·x·B − Σx) (a non-finite α reaches only its slot's rows).
// int8 activations: Σ q_x·q_w exact in int32, y += (d_w·d_x)·Σ (+ m_w·(d_x·Σq_x)) in f32; the
// delta term keeps f32 x.
// f32 sums in another order than `reference.quant_matmul_reference`: agrees to f32 rounding.
// Backend: AVX2 + FMA + F16C intrinsics (-march=native); with AVX-512F the f32-activation base
// tiles take 16 columns a vector (`Tile512`, bit-identical to the 8-column `Tile`; the delta
// lookups and the int8 paths stay 256-bit); without them plain scalar loops (the portable
// build: correctness, not speed).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <numeric>
#include <vector>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// pallas_kernels/native, on the include path (pallas_kernels/native/build.py)
#include "lut_delta.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QROWS_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__)
#define QROWS_AVX512 1
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QROWS_DPBUSD 1
#if defined(__AVX512VBMI__)
#define QROWS_VNNI 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define QROWS_AMX 1
#endif
#endif
#endif
#endif

namespace ffi = xla::ffi;

namespace {

using bitdelta_native::Pool;
namespace lut = bitdelta_native::lut;

enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerPass = 16;
constexpr int kMaxTileRows = 8;
// Rows above which the VNNI int8 path walks 64-column strips over a transposed copy of each
// block (`BaseVnniStrips`) instead of transposing the block again for every tile of 4 rows.
// At 8 rows (two tiles) the VBMI per-tile transpose (6 byte permutes a quad) cost the same or
// less than a strip's copy (16 unpacks and shuffles, and the stores); from 16 rows, and at
// every row count for q8_0, the strips were faster (bench/results/kernels/quant_strips.md).
#ifndef BITDELTA_QROWS_STRIP_ROWS
#define BITDELTA_QROWS_STRIP_ROWS 8
#endif
constexpr int64_t kStripRows = BITDELTA_QROWS_STRIP_ROWS;
// Rows from which int8 activations take AMX tiles in passes of up to kAmxPassRows (`BaseAmx`)
// where the CPU has AMX-INT8 and Linux grants the tile state: more than one 16-row pass
// (bench/results/kernels/quant_amx.md).
#ifndef BITDELTA_QROWS_AMX_ROWS
#define BITDELTA_QROWS_AMX_ROWS 17
#endif
constexpr int64_t kAmxRows = BITDELTA_QROWS_AMX_ROWS;
// Rows a pass takes on the AMX path: each block's strips are transposed once for all of them.
#ifndef BITDELTA_QROWS_AMX_PASS_ROWS
#define BITDELTA_QROWS_AMX_PASS_ROWS 512
#endif
constexpr int64_t kAmxPassRows = BITDELTA_QROWS_AMX_PASS_ROWS;
// Rows from which a pass of at most 16 (decode batches) takes AMX tiles (`BaseAmxFew`).
#ifndef BITDELTA_QROWS_AMX_FEW_ROWS
#define BITDELTA_QROWS_AMX_FEW_ROWS 6
#endif
constexpr int64_t kAmxFewRows = BITDELTA_QROWS_AMX_FEW_ROWS;

#if QROWS_AMX
// the tile state, granted by Linux (asked once per process), unless BITDELTA_AMX=0
bool AmxGranted() {
  static const bool ok = [] {
    if (const char* env = std::getenv("BITDELTA_AMX"); env && std::string(env) == "0") return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#endif

// whether this build has the AMX paths and this process may use them
inline bool AmxOn() {
#if QROWS_AMX
  return AmxGranted();
#else
  return false;
#endif
}

// whether int8-activation calls of `rows` rows take `BaseAmx` (passes of up to kAmxPassRows)
inline bool UseAmx(int64_t rows, bool int8_act) {
  return int8_act && rows >= kAmxRows && AmxOn();
}

// Columns a task takes at least before the work is split over K as well. On 2 threads (K = N =
// 4096, 1536 x 576, 576 x 1536; 1 and 8 rows) column and K tasks timed the same within noise;
// columns need no partials to add up.
#ifndef BITDELTA_QROWS_MIN_COLS
#define BITDELTA_QROWS_MIN_COLS 256
#endif
constexpr int64_t kMinCols = BITDELTA_QROWS_MIN_COLS;

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while (!(m & 0x400));
    u = sign | uint32_t(112 - e) << 23 | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Group {
  int64_t slot;
  std::vector<int64_t> rows;  // within the pass
};

// One pass: up to kRowsPerPass rows (kAmxPassRows on the AMX path).
struct Pass {
  const float* x;        // [M, K]
  const float* sx;       // [M, nb]: Σ x over each block (Q4_1 and the deltas)
  int64_t M;
  const std::vector<Group>* slots;  // the slots present (s > 0) with their rows
  // int8 activations (act 1): x per row and 32-block as ggml's Q8_0, with an f32 scale
  const int8_t* xq;     // [M, K] q = round-half-even(x / d), |q| <= 127
  const int16_t* x16;   // [M, K] the same q as int16 (q8_0's madd_epi16 pairs)
  const float* xd;      // [M, nb] d = max|x| / 127
  const int32_t* xqs;   // [M, nb] Σ q (q4_0's −8 offset, q4_1's m·d·Σq: ggml's Q8_1 sum)
};

struct Args {
  int64_t K, N, nb, qrows;  // qrows: 32 (Q8_0) or 16 (nibbles)
  Format fmt;
  const uint8_t* qs;   // [nb, qrows, N]
  const uint16_t* d;   // [nb, N] f16
  const uint16_t* m;   // [nb, N] f16 (Q4_1)
  const uint8_t* bits;  // [S, KP, N]
  const float* scale;   // [S, N]
  int64_t KP, G, first;
};

// the weight of block b, in-block row j (0..31), column n, without d (and m): q, or q − 8
inline float qvalue(const Args& a, int64_t b, int j, int64_t n) {
  if (a.fmt == kQ8_0) return float(int8_t(a.qs[(b * 32 + j) * a.N + n]));
  const uint8_t byte = a.qs[(b * 16 + (j & 15)) * a.N + n];
  const int v = j < 16 ? byte & 15 : byte >> 4;
  return float(a.fmt == kQ4_0 ? v - 8 : v);
}

// acc[r, n0:n1] += x[r, blocks b0:b1] · dequant(W)[..., n0:n1], one column at a time
void BaseScalar(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1, int64_t n0,
                int64_t n1) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t n = n0; n < n1; ++n) {
      const float d = half_to_float(a.d[b * a.N + n]);
      const float mm = a.fmt == kQ4_1 ? half_to_float(a.m[b * a.N + n]) : 0.f;
      for (int64_t r = 0; r < p.M; ++r) {
        const float* x = p.x + r * a.K + b * kBlock;
        float s = 0.f;
        for (int j = 0; j < 32; ++j) s += x[j] * qvalue(a, b, j, n);
        float& y = acc[r * a.N + n];
        y += d * s;
        if (a.fmt == kQ4_1) y += mm * p.sx[r * a.nb + b];
      }
    }
}

// acc[r] += α_s ⊙ (x[r, k0:k1] · S_s[k0:k1, n0:n1]) for every slot's rows, one bit at a time
[[maybe_unused]] void DeltaScalar(const Args& a, const Pass& p, float* acc, int64_t k0,
                                  int64_t k1, int64_t n0, int64_t n1) {
  const int64_t P = a.G / 8;
  for (const Group& g : *p.slots) {
    const uint8_t* bits = a.bits + (g.slot - a.first) * a.KP * a.N;
    const float* al = a.scale + (g.slot - a.first) * a.N;
    for (int64_t r : g.rows) {
      const float* x = p.x + r * a.K;
      for (int64_t n = n0; n < n1; ++n) {
        float s = 0.f;
        for (int64_t k = k0; k < k1; ++k) {
          const int64_t r_in = k % a.G, br = k / a.G * P + r_in % P;
          s += (bits[br * a.N + n] >> (r_in / P)) & 1 ? x[k] : -x[k];
        }
        acc[r * a.N + n] += al[n] * s;
      }
    }
  }
}

// x quantized per row and 32-block (ggml's quantize_row_q8_0 with an f32 scale): d = max|x|/127,
// q = x · (1/d) rounded to nearest, ties to even (ggml's reference rounds ties away; its AVX2
// path to even); an all-zero block has d = 0 and q = 0. x must be finite. The same scalar code
// in every build, so every build computes the same q.
// one 32-block: q (and q16), d, Σq; and sx, Σ x in order (the f32 paths' and the deltas' sum)
inline void QuantizeBlock(const float* xb, int8_t* q, int16_t* q16, float* d, int32_t* qsum) {
#if QROWS_AVX512
  // the scalar loop's operations on 16 lanes: max |x| (exact), the same f32 product x·(1/d),
  // rounded to nearest even (vrndscaleps as nearbyint), then exact integer steps
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
  const __m512 idv = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i v0 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(
      _mm512_mul_ps(x0, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
  const __m512i v1 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(
      _mm512_mul_ps(x1, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(v0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(v1));
  if (q16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16), _mm512_cvtepi32_epi16(v0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + 16), _mm512_cvtepi32_epi16(v1));
  }
  *d = dd;
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
#else
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
  int32_t s = 0;
  for (int j = 0; j < kBlock; ++j) {
    const int v = std::clamp(int(std::nearbyint(xb[j] * id)), -127, 127);
    q[j] = int8_t(v);
    if (q16) q16[j] = int16_t(v);
    s += v;
  }
  *d = dd;
  *qsum = s;
#endif
}

// x's per-block sums sx [M, nb] (with sx; each in order j = 0..31, every build) and, with q, x
// quantized per row and 32-block: blocks i0..i1 of the flattened [M, nb]. The sums of 8 blocks
// at a time are 8 independent chains (one chain of 32 dependent adds per block was the
// slowest part of this function).
void PrepareActivations(const float* x, int64_t K, int64_t i0, int64_t i1, float* sx, int8_t* q,
                        int16_t* q16, float* d, int32_t* qsum) {
  const int64_t nb = K / kBlock;
  auto at = [&](int64_t i) { return x + (i / nb) * K + (i % nb) * kBlock; };
  if (sx) {
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) {
      const float* xs[8];
      float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int u = 0; u < 8; ++u) xs[u] = at(i + u);
      for (int j = 0; j < kBlock; ++j)
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) s[u] += xs[u][j];
      for (int u = 0; u < 8; ++u) sx[i + u] = s[u];
    }
    for (; i < i1; ++i) {
      const float* xb = at(i);
      float s = 0.f;
      for (int j = 0; j < kBlock; ++j) s += xb[j];
      sx[i] = s;
    }
  }
  if (q)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t off = (i / nb) * K + (i % nb) * kBlock;
      QuantizeBlock(x + off, q + off, q16 ? q16 + off : nullptr, d + i, qsum + i);
    }
}

// the stored integer of block b, in-block row j, column n: q8_0's q, q4's unsigned nibble
inline int32_t qint(const Args& a, int64_t b, int j, int64_t n) {
  if (a.fmt == kQ8_0) return int8_t(a.qs[(b * 32 + j) * a.N + n]);
  const uint8_t byte = a.qs[(b * 16 + (j & 15)) * a.N + n];
  return j < 16 ? byte & 15 : byte >> 4;
}

// the int8-activation block product's f32 step, shared by every path: y += (d_w·d_x)·Σ q_x·q_w
// (q4_0: Σ q_x·(nibble − 8) = Σ q_x·nibble − 8·Σ q_x), + m_w·(d_x·Σ q_x) for q4_1
inline float BlockI8(Format fmt, float y, int32_t isum, float dw, float mw, float dx, int32_t qsum) {
  if (fmt == kQ4_0) isum -= 8 * qsum;
  y += (dw * dx) * float(isum);  // |isum| <= 32·127·128 < 2^24: exact in f32
  if (fmt == kQ4_1) y += mw * (dx * float(qsum));
  return y;
}

// acc[r, n0:n1] += the int8-activation product of blocks b0:b1, one column at a time
void BaseI8Scalar(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1, int64_t n0,
                  int64_t n1) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t n = n0; n < n1; ++n) {
      const float dw = half_to_float(a.d[b * a.N + n]);
      const float mw = a.fmt == kQ4_1 ? half_to_float(a.m[b * a.N + n]) : 0.f;
      for (int64_t r = 0; r < p.M; ++r) {
        const int8_t* xq = p.xq + r * a.K + b * kBlock;
        int32_t s = 0;
        for (int j = 0; j < 32; ++j) s += int32_t(xq[j]) * qint(a, b, j, n);
        float& y = acc[r * a.N + n];
        y = BlockI8(a.fmt, y, s, dw, mw, p.xd[r * a.nb + b], p.xqs[r * a.nb + b]);
      }
    }
}

#if QROWS_AVX2
// the first cache line from column n of each byte row of block b + 1, if b + 1 < b1: the next
// block's streams start while block b is worked on
inline void PrefetchNextBlock(const Args& a, int64_t b, int64_t b1, int64_t n) {
  if (b + 1 >= b1) return;
  for (int64_t j = 0; j < a.qrows; ++j)
    _mm_prefetch(reinterpret_cast<const char*>(a.qs + ((b + 1) * a.qrows + j) * a.N + n),
                 _MM_HINT_T0);
}

// P[i][c] (8 columns each) = Σ_j x[row i, block b, j] · q[b, j, n + 8c], then
// acc[row i, n + 8c] += d·P (+ m·Σx). R rows from `row0`, C vectors of 8 columns.
template <Format F, int R, int C>
inline void Tile(const Args& a, const Pass& p, float* acc, int64_t b, int64_t row0, int64_t n) {
  const int64_t N = a.N;
  __m256 s[R][C];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[i][c] = _mm256_setzero_ps();
  const float* xb = p.x + row0 * a.K + b * kBlock;
  const uint8_t* q = a.qs + b * a.qrows * N + n;
  if constexpr (F == kQ8_0) {
#pragma GCC unroll 4
    for (int j = 0; j < 32; ++j) {
      __m256 w[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        w[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j * N + 8 * c))));
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_broadcast_ss(xb + i * a.K + j);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) s[i][c] = _mm256_fmadd_ps(xv, w[c], s[i][c]);
      }
    }
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
      __m256 lo[C], hi[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j * N + 8 * c));
        if constexpr (F == kQ4_0) {
          // nibble ^ 8, sign-extended, is nibble − 8
          const __m256i v = _mm256_cvtepi8_epi32(_mm_xor_si128(raw, _mm_set1_epi8(char(0x88))));
          lo[c] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 28), 28));
          hi[c] = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 4));
        } else {
          const __m256i v = _mm256_cvtepu8_epi32(raw);
          lo[c] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
          hi[c] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256 x0 = _mm256_broadcast_ss(xb + i * a.K + j);
        const __m256 x1 = _mm256_broadcast_ss(xb + i * a.K + j + 16);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          s[i][c] = _mm256_fmadd_ps(x1, hi[c], _mm256_fmadd_ps(x0, lo[c], s[i][c]));
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    const __m256 dv = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.d + b * N + n + 8 * c)));
    __m256 mv = _mm256_setzero_ps();
    if constexpr (F == kQ4_1)
      mv = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.m + b * N + n + 8 * c)));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      float* y = acc + (row0 + i) * N + n + 8 * c;
      __m256 v = _mm256_fmadd_ps(dv, s[i][c], _mm256_loadu_ps(y));
      if constexpr (F == kQ4_1)
        v = _mm256_fmadd_ps(mv, _mm256_set1_ps(p.sx[(row0 + i) * a.nb + b]), v);
      _mm256_storeu_ps(y, v);
    }
  }
}

#if QROWS_AVX512
// `Tile` with 16 columns a vector (AVX-512F): per lane the same widening and the same FMA chain
// in the same order, so each column's result is bit-identical to the AVX2 tile's; half the
// instructions per weight.
template <Format F, int R, int C>
inline void Tile512(const Args& a, const Pass& p, float* acc, int64_t b, int64_t row0, int64_t n) {
  const int64_t N = a.N;
  __m512 s[R][C];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[i][c] = _mm512_setzero_ps();
  const float* xb = p.x + row0 * a.K + b * kBlock;
  const uint8_t* q = a.qs + b * a.qrows * N + n;
  if constexpr (F == kQ8_0) {
#pragma GCC unroll 4
    for (int j = 0; j < 32; ++j) {
      __m512 w[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        w[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * N + 16 * c))));
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512 xv = _mm512_set1_ps(xb[i * a.K + j]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) s[i][c] = _mm512_fmadd_ps(xv, w[c], s[i][c]);
      }
    }
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
      __m512 lo[C], hi[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * N + 16 * c));
        if constexpr (F == kQ4_0) {
          const __m512i v = _mm512_cvtepi8_epi32(_mm_xor_si128(raw, _mm_set1_epi8(char(0x88))));
          lo[c] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28));
          hi[c] = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 4));
        } else {
          const __m512i v = _mm512_cvtepu8_epi32(raw);
          lo[c] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
          hi[c] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512 x0 = _mm512_set1_ps(xb[i * a.K + j]);
        const __m512 x1 = _mm512_set1_ps(xb[i * a.K + j + 16]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          s[i][c] = _mm512_fmadd_ps(x1, hi[c], _mm512_fmadd_ps(x0, lo[c], s[i][c]));
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    const __m512 dv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.d + b * N + n + 16 * c)));
    __m512 mv = _mm512_setzero_ps();
    if constexpr (F == kQ4_1)
      mv = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.m + b * N + n + 16 * c)));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      float* y = acc + (row0 + i) * N + n + 16 * c;
      __m512 v = _mm512_fmadd_ps(dv, s[i][c], _mm512_loadu_ps(y));
      if constexpr (F == kQ4_1)
        v = _mm512_fmadd_ps(mv, _mm512_set1_ps(p.sx[(row0 + i) * a.nb + b]), v);
      _mm512_storeu_ps(y, v);
    }
  }
}
#endif

// columns n0..n1 (a multiple of 8 apart) of block b for rows row0..row0+R: 16-column vectors
// where AVX-512 is built in, then 8-column ones
template <Format F, int R>
void TileRow(const Args& a, const Pass& p, float* acc, int64_t b, int64_t row0, int64_t n0,
             int64_t n1) {
  int64_t n = n0;
#if QROWS_AVX512
  // Q8_0 at 1-2 rows keeps the AVX2 tiles: its 16-lane tiles took 1.1-2.0x their time there on
  // an AMD EPYC (Zen 4 runs 512-bit ops as two halves; a byte a weight is widened per lane),
  // 0.6-0.9x at 8-16 rows (bench/results/kernels/quant_kernel.md)
  if constexpr (F != kQ8_0 || R > 2) {
    constexpr int C16 = R <= 2 ? 4 : R <= 4 ? 2 : 1;  // R·C accumulators + C (q4: 2C) weights
    for (; n + 16 * C16 <= n1; n += 16 * C16) Tile512<F, R, C16>(a, p, acc, b, row0, n);
    for (; n + 16 <= n1; n += 16) Tile512<F, R, 1>(a, p, acc, b, row0, n);
  }
#endif
  constexpr int C = R == 1 ? 4 : R == 2 ? 4 : R <= 4 ? 2 : 1;
  for (; n + 8 * C <= n1; n += 8 * C) Tile<F, R, C>(a, p, acc, b, row0, n);
  for (; n < n1; n += 8) Tile<F, R, 1>(a, p, acc, b, row0, n);
}

template <Format F>
void Base(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1, int64_t n0,
          int64_t n1) {
  const int64_t n8 = n0 + (n1 - n0) / 8 * 8;
  for (int64_t b = b0; b < b1; ++b) {
    PrefetchNextBlock(a, b, b1, n0);
    for (int64_t r = 0; r < p.M; r += kMaxTileRows) {
      switch (std::min<int64_t>(kMaxTileRows, p.M - r)) {
        case 1: TileRow<F, 1>(a, p, acc, b, r, n0, n8); break;
        case 2: TileRow<F, 2>(a, p, acc, b, r, n0, n8); break;
        case 3: TileRow<F, 3>(a, p, acc, b, r, n0, n8); break;
        case 4: TileRow<F, 4>(a, p, acc, b, r, n0, n8); break;
        case 5: TileRow<F, 5>(a, p, acc, b, r, n0, n8); break;
        case 6: TileRow<F, 6>(a, p, acc, b, r, n0, n8); break;
        case 7: TileRow<F, 7>(a, p, acc, b, r, n0, n8); break;
        default: TileRow<F, 8>(a, p, acc, b, r, n0, n8); break;
      }
    }
  }
  if (n8 < n1) BaseScalar(a, p, acc, b0, b1, n8, n1);
}

// acc[r] += α_s ⊙ (x[r, k0:k1] · S_s[k0:k1, n0:n1]) for the rows of every slot present; k0 on a
// group boundary. Per packed byte row each row gets three tables of 2·Σx over the set bits of
// fields 0-2, 3-5 and 6-7 (`lut_delta.h`), looked up for 8 columns at once; byte row after byte
// row, the sums in memory.
[[maybe_unused]] void Delta(const Args& a, const Pass& p, float* acc, int64_t k0, int64_t k1, int64_t n0,
           int64_t n1) {
  constexpr int kRd = 4;  // rows per pass over the bits
  const int64_t N = a.N, K = a.K, G = a.G, P = G / 8, nc = n1 - n0;
  const int64_t n8 = n0 + nc / 8 * 8;
  thread_local std::vector<float> dsum;
  if (int64_t(dsum.size()) < kRd * nc) dsum.resize(kRd * nc);
  __m256 fmask[3];
  lut::FieldMasks(fmask);
  for (const Group& g : *p.slots) {
    const uint8_t* bits = a.bits + (g.slot - a.first) * a.KP * N;
    const float* al = a.scale + (g.slot - a.first) * N;
    for (size_t r0 = 0; r0 < g.rows.size(); r0 += kRd) {
      const int nr = int(std::min<size_t>(kRd, g.rows.size() - r0));
      const int64_t* rows = g.rows.data() + r0;
      const float* xr[kRd];
      for (int i = 0; i < nr; ++i) xr[i] = p.x + rows[i] * K;
      float* d = dsum.data();
      std::fill(d, d + nr * nc, 0.f);
      for (int64_t gk = k0; gk < k1; gk += G)
        for (int64_t pp = 0; pp < P; ++pp) {
          const uint8_t* br = bits + (gk / G * P + pp) * N;
          __m256 t[kRd][3];
          for (int i = 0; i < nr; ++i) lut::FieldTables(xr[i], gk, P, pp, k1, fmask, t[i]);
          for (int64_t n = n0; n < n8; n += 8) {
            __m256i i0, i1, i2;
            lut::FieldIndex(br + n, &i0, &i1, &i2);
            for (int i = 0; i < nr; ++i) {
              float* dp = d + i * nc + (n - n0);
              _mm256_storeu_ps(dp, _mm256_add_ps(_mm256_loadu_ps(dp),
                                                 lut::FieldLookup(i0, i1, i2, t[i])));
            }
          }
          lut::SetBitsRows(br + n8, n1 - n8, xr, nr, gk, P, pp, k1, d + (n8 - n0), nc);
        }
      for (int i = 0; i < nr; ++i) {
        const int64_t r = rows[i];
        float total = 0.f;  // Σ x[r, k0:k1] from the blocks' sums
        for (int64_t b = k0 / kBlock; b < k1 / kBlock; ++b) total += p.sx[r * a.nb + b];
        lut::AddScaled(acc + r * N + n0, al + n0, d + i * nc, total, nc);
      }
    }
  }
}

#if QROWS_AVX512
// `Delta` with 16-entry tables (AVX-512F `vpermps` on zmm, `lut_delta.h`): per packed byte two
// lookups (bits 0-3 and 4-7) for 16 columns at once, instead of three for 8. The tables (2·Σx
// over each subset of a nibble's 4 K rows, per byte row and row) are built once per K range;
// the columns go in blocks of kDeltaCols, each block's sums for up to 4 rows staying in L1 while
// every byte row of the range is added in (its bytes read as a contiguous run, byte row after
// byte row: walking one 64-column tile down all byte rows, sums in registers, was 2x slower: a
// stride-N read per byte row). Sums in another order than `Delta`: agrees to f32 rounding.
constexpr int64_t kDeltaCols = 512;

void Delta512(const Args& a, const Pass& p, float* acc, int64_t k0, int64_t k1, int64_t n0,
              int64_t n1) {
  constexpr int kRd = 4;
  const int64_t N = a.N, K = a.K, G = a.G, P = G / 8;
  const int64_t n16 = n0 + (n1 - n0) / 16 * 16;
  const int64_t nbr = (k1 - k0 + G - 1) / G * P;  // byte rows of [k0, k1): consecutive
  thread_local std::vector<float> tab, dsum;
  if (int64_t(tab.size()) < nbr * kRd * 32) tab.resize(nbr * kRd * 32);
  if (int64_t(dsum.size()) < kRd * kDeltaCols) dsum.resize(kRd * kDeltaCols);
  for (const Group& g : *p.slots) {
    const uint8_t* bits = a.bits + ((g.slot - a.first) * a.KP + k0 / G * P) * N;
    const float* al = a.scale + (g.slot - a.first) * N;
    for (size_t r0 = 0; r0 < g.rows.size(); r0 += kRd) {
      const int nr = int(std::min<size_t>(kRd, g.rows.size() - r0));
      const int64_t* rows = g.rows.data() + r0;
      for (int64_t gk = k0, b = 0; gk < k1; gk += G)
        for (int64_t pp = 0; pp < P; ++pp, ++b)
          for (int i = 0; i < nr; ++i) {
            __m512 lo, hi;
            lut::NibbleTables(p.x + rows[i] * K, gk, P, pp, k1, &lo, &hi);
            _mm512_storeu_ps(tab.data() + (b * kRd + i) * 32, lo);
            _mm512_storeu_ps(tab.data() + (b * kRd + i) * 32 + 16, hi);
          }
      float total[kRd];  // Σ x[r, k0:k1] from the blocks' sums
      for (int i = 0; i < nr; ++i) {
        total[i] = 0.f;
        for (int64_t b = k0 / kBlock; b < k1 / kBlock; ++b) total[i] += p.sx[rows[i] * a.nb + b];
      }
      for (int64_t c0 = n0; c0 < n16; c0 += kDeltaCols) {
        const int64_t c1 = std::min(c0 + kDeltaCols, n16), nc = c1 - c0;
        float* d = dsum.data();
        std::fill(d, d + kRd * kDeltaCols, 0.f);
        for (int64_t b = 0; b < nbr; ++b) {
          const float* t = tab.data() + b * kRd * 32;
          __m512 tl[kRd], th[kRd];
          for (int i = 0; i < nr; ++i) {
            tl[i] = _mm512_loadu_ps(t + i * 32);
            th[i] = _mm512_loadu_ps(t + i * 32 + 16);
          }
          lut::NibbleRows(bits + b * N + c0, nc, tl, th, nr, d, kDeltaCols);
        }
        for (int i = 0; i < nr; ++i) {
          const __m512 tot = _mm512_set1_ps(total[i]);
          float* y = acc + rows[i] * N;
          for (int64_t n = c0; n < c0 + nc; n += 16)
            _mm512_storeu_ps(y + n, _mm512_fmadd_ps(
                _mm512_loadu_ps(al + n),
                _mm512_sub_ps(_mm512_loadu_ps(d + i * kDeltaCols + (n - c0)), tot),
                _mm512_loadu_ps(y + n)));
        }
      }
    }
  }
  if (n16 < n1) DeltaScalar(a, p, acc, k0, k1, n16, n1);  // the columns past the last 16
}
#endif

// int8 activations, the f32 step of 8 columns: y[0:8] = BlockI8(...) on int32 sums v
template <Format F>
inline void StoreI8(const Args& a, const Pass& p, float* y, __m256i v, int64_t b, int64_t row,
                    int64_t n) {
  const int64_t i = row * a.nb + b;
  const float dx = p.xd[i];
  const int32_t qsum = p.xqs[i];
  if constexpr (F == kQ4_0) v = _mm256_sub_epi32(v, _mm256_set1_epi32(8 * qsum));
  const __m256 dw = _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.d + b * a.N + n)));
  __m256 out = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(v),
                               _mm256_loadu_ps(y));
  if constexpr (F == kQ4_1) {
    const __m256 mw = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.m + b * a.N + n)));
    out = _mm256_fmadd_ps(mw, _mm256_set1_ps(dx * float(qsum)), out);
  }
  _mm256_storeu_ps(y, out);
}

// q8_0, int8 activations: 16·C columns from n, R rows from row0. Per pair of K rows the two
// weight rows are widened to int16 and interleaved per column (vpunpck{l,h}wd), and one
// vpmaddwd against the broadcast pair (q_x[2t], q_x[2t+1]) adds both products into the column's
// int32 sum: 16 multiply-adds an instruction. |sum| <= 32·128·127. One row takes 64 columns:
// a whole cache line of each of the block's 32 rows at once (N a multiple of 4096 maps all 32
// lines to one L1 set: a line read in 16-byte pieces is fetched from L2 each time).
template <int R, int C>
inline void TileQ8I8(const Args& a, const Pass& p, float* acc, int64_t b, int64_t row0,
                     int64_t n) {
  const int64_t N = a.N, K = a.K;
  __m256i s[R][C][2];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) s[i][c][0] = s[i][c][1] = _mm256_setzero_si256();
  const uint8_t* q = a.qs + b * 32 * N + n;
  const int16_t* xb = p.x16 + row0 * K + b * kBlock;
#pragma GCC unroll 2
  for (int t = 0; t < 16; ++t) {
    __m256i lo[C], hi[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256i w0 = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * t * N + 16 * c)));
      const __m256i w1 = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (2 * t + 1) * N + 16 * c)));
      lo[c] = _mm256_unpacklo_epi16(w0, w1);  // columns [0-3 | 8-11]
      hi[c] = _mm256_unpackhi_epi16(w0, w1);  // columns [4-7 | 12-15]
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, xb + i * K + 2 * t, 4);
      const __m256i xv = _mm256_set1_epi32(pair);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        s[i][c][0] = _mm256_add_epi32(s[i][c][0], _mm256_madd_epi16(lo[c], xv));
        s[i][c][1] = _mm256_add_epi32(s[i][c][1], _mm256_madd_epi16(hi[c], xv));
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      float* y = acc + (row0 + i) * N + n + 16 * c;
      StoreI8<kQ8_0>(a, p, y, _mm256_permute2x128_si256(s[i][c][0], s[i][c][1], 0x20), b,
                     row0 + i, n + 16 * c);
      StoreI8<kQ8_0>(a, p, y + 8, _mm256_permute2x128_si256(s[i][c][0], s[i][c][1], 0x31), b,
                     row0 + i, n + 16 * c + 8);
    }
}

// q4_0 / q4_1, int8 activations: 32 columns from n, R rows from row0. Per pair of byte rows
// (2t, 2t+1) the low nibbles (K rows 2t, 2t+1) and the high ones (16 + 2t, 17 + 2t) are
// interleaved per column (vpunpck{l,h}bw) and vpmaddubsw multiplies them (unsigned 0..15)
// by the broadcast int8 pair of x: one int16 per column, 32 multiply-adds an instruction. The
// int16 sums of each half block stay below 8·2·15·127 = 30480 (no saturation); at the block's
// end the two halves are added in int32 (vpmaddwd by ones). q4_0's −8 is −8·Σq_x (`BlockI8`).
template <Format F, int R>
inline void TileQ4I8(const Args& a, const Pass& p, float* acc, int64_t b, int64_t row0,
                     int64_t n) {
  const int64_t N = a.N, K = a.K;
  // [i][0]: columns [0-7 | 16-23], [i][1]: [8-15 | 24-31] (vpunpck works within 128-bit lanes)
  __m256i sl[R][2], sh[R][2];
#pragma GCC unroll 2
  for (int i = 0; i < R; ++i)
    sl[i][0] = sl[i][1] = sh[i][0] = sh[i][1] = _mm256_setzero_si256();
  const uint8_t* q = a.qs + b * 16 * N + n;
  const int8_t* xb = p.xq + row0 * K + b * kBlock;
  const __m256i m4 = _mm256_set1_epi8(15);
#pragma GCC unroll 2
  for (int t = 0; t < 8; ++t) {
    const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * t * N));
    const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (2 * t + 1) * N));
    const __m256i l0 = _mm256_and_si256(r0, m4), l1 = _mm256_and_si256(r1, m4);
    const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), m4);
    const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), m4);
    const __m256i la = _mm256_unpacklo_epi8(l0, l1), lb = _mm256_unpackhi_epi8(l0, l1);
    const __m256i ha = _mm256_unpacklo_epi8(h0, h1), hb = _mm256_unpackhi_epi8(h0, h1);
#pragma GCC unroll 2
    for (int i = 0; i < R; ++i) {
      int16_t xl, xh;
      std::memcpy(&xl, xb + i * K + 2 * t, 2);
      std::memcpy(&xh, xb + i * K + 16 + 2 * t, 2);
      const __m256i vl = _mm256_set1_epi16(xl), vh = _mm256_set1_epi16(xh);
      sl[i][0] = _mm256_add_epi16(sl[i][0], _mm256_maddubs_epi16(la, vl));
      sl[i][1] = _mm256_add_epi16(sl[i][1], _mm256_maddubs_epi16(lb, vl));
      sh[i][0] = _mm256_add_epi16(sh[i][0], _mm256_maddubs_epi16(ha, vh));
      sh[i][1] = _mm256_add_epi16(sh[i][1], _mm256_maddubs_epi16(hb, vh));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 2
  for (int i = 0; i < R; ++i) {
    const __m256i p0 = _mm256_madd_epi16(_mm256_unpacklo_epi16(sl[i][0], sh[i][0]), ones);
    const __m256i p1 = _mm256_madd_epi16(_mm256_unpackhi_epi16(sl[i][0], sh[i][0]), ones);
    const __m256i p2 = _mm256_madd_epi16(_mm256_unpacklo_epi16(sl[i][1], sh[i][1]), ones);
    const __m256i p3 = _mm256_madd_epi16(_mm256_unpackhi_epi16(sl[i][1], sh[i][1]), ones);
    // p0: [0-3 | 16-19], p1: [4-7 | 20-23], p2: [8-11 | 24-27], p3: [12-15 | 28-31]
    float* y = acc + (row0 + i) * N + n;
    const int64_t r = row0 + i;
    StoreI8<F>(a, p, y, _mm256_permute2x128_si256(p0, p1, 0x20), b, r, n);
    StoreI8<F>(a, p, y + 8, _mm256_permute2x128_si256(p2, p3, 0x20), b, r, n + 8);
    StoreI8<F>(a, p, y + 16, _mm256_permute2x128_si256(p0, p1, 0x31), b, r, n + 16);
    StoreI8<F>(a, p, y + 24, _mm256_permute2x128_si256(p2, p3, 0x31), b, r, n + 24);
  }
}

#if QROWS_DPBUSD
// int8 activations with vpdpbusd (AVX-512 VNNI: 4 unsigned x 4 signed bytes into each int32
// lane, 64 multiply-adds an instruction). Integer sums are exact and the f32 step `StoreI8x16`
// is `StoreI8` lane for lane, so every path gives the same bits.

// the 16-column f32 step: `StoreI8`'s operations on 16 lanes
template <Format F>
inline void StoreI8x16(const Args& a, const Pass& p, float* y, __m512i v, int64_t b, int64_t row,
                       int64_t n) {
  const int64_t i = row * a.nb + b;
  const float dx = p.xd[i];
  const int32_t qsum = p.xqs[i];
  if constexpr (F == kQ4_0) v = _mm512_sub_epi32(v, _mm512_set1_epi32(8 * qsum));
  if constexpr (F == kQ8_0) v = _mm512_sub_epi32(v, _mm512_set1_epi32(128 * qsum));
  const __m512 dw = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.d + b * a.N + n)));
  __m512 out = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(v),
                               _mm512_loadu_ps(y));
  if constexpr (F == kQ4_1) {
    const __m512 mw = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.m + b * a.N + n)));
    out = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx * float(qsum)), out);
  }
  _mm512_storeu_ps(y, out);
}

// A block's 64-column strip in vpdpbusd's order, made once and read by every row tile of the
// pass: [quad t][column vector c] (q8_0: made unsigned), q4 as [quad t][low, high][c]
struct StripBuf {
  __m512i w[32];
};

// rows r..r+3 (N bytes apart from q) x 64 columns -> out[g]: columns 16g..16g+15, 4 rows a
// lane (as `Quads64`, without VBMI's byte permutes): byte and word unpacks interleave the rows
// within each 128-bit lane (lane j of u[k]: columns 16j+4k..16j+4k+3), then a 4 x 4 transpose
// of 128-bit lanes puts the columns in order
inline void QuadsUnpack64(const uint8_t* q, int64_t N, __m512i out[4]) {
  const __m512i r0 = _mm512_loadu_si512(q), r1 = _mm512_loadu_si512(q + N);
  const __m512i r2 = _mm512_loadu_si512(q + 2 * N), r3 = _mm512_loadu_si512(q + 3 * N);
  const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1), hi01 = _mm512_unpackhi_epi8(r0, r1);
  const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3), hi23 = _mm512_unpackhi_epi8(r2, r3);
  const __m512i u0 = _mm512_unpacklo_epi16(lo01, lo23), u1 = _mm512_unpackhi_epi16(lo01, lo23);
  const __m512i u2 = _mm512_unpacklo_epi16(hi01, hi23), u3 = _mm512_unpackhi_epi16(hi01, hi23);
  const __m512i t0 = _mm512_shuffle_i32x4(u0, u1, 0x44), t1 = _mm512_shuffle_i32x4(u0, u1, 0xEE);
  const __m512i t2 = _mm512_shuffle_i32x4(u2, u3, 0x44), t3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);
  out[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
  out[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
  out[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
  out[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}

template <Format F>
inline void FillStrip(const Args& a, int64_t b, int64_t n, StripBuf& s) {
  const uint8_t* q = a.qs + b * a.qrows * a.N + n;
  const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(char(0x80));
  if constexpr (F == kQ8_0) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      QuadsUnpack64(q + 4 * t * a.N, a.N, s.w + 4 * t);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) s.w[4 * t + c] = _mm512_xor_si512(s.w[4 * t + c], flip);
    }
  } else {
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      __m512i w[4];
      QuadsUnpack64(q + 4 * t * a.N, a.N, w);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        s.w[8 * t + c] = _mm512_and_si512(w[c], m4);
        s.w[8 * t + 4 + c] = _mm512_and_si512(_mm512_srli_epi16(w[c], 4), m4);
      }
    }
  }
}

// rows row0..row0+R x the strip's 64 columns of block b: Σ q_x·q_w in int32 per (row, column)
// (exact: the same sums as every int8 path), then the f32 step `StoreI8x16`
template <Format F, int R>
inline void TileStrip(const Args& a, const Pass& p, const StripBuf& w, float* acc, int64_t b,
                      int64_t row0, int64_t n) {
  const int64_t K = a.K, N = a.N;
  __m512i s[R][4];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) s[i][c] = _mm512_setzero_si512();
  const int8_t* xb = p.xq + row0 * K + b * kBlock;
  if constexpr (F == kQ8_0) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t)
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        int32_t quad;
        std::memcpy(&quad, xb + i * K + 4 * t, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) s[i][c] = _mm512_dpbusd_epi32(s[i][c], w.w[4 * t + c], xv);
      }
  } else {
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t)
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        int32_t ql, qh;
        std::memcpy(&ql, xb + i * K + 4 * t, 4);
        std::memcpy(&qh, xb + i * K + 16 + 4 * t, 4);
        const __m512i xl = _mm512_set1_epi32(ql), xh = _mm512_set1_epi32(qh);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c)
          s[i][c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[i][c], w.w[8 * t + c], xl),
                                        w.w[8 * t + 4 + c], xh);
      }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      StoreI8x16<F>(a, p, acc + (row0 + i) * N + n + 16 * c, s[i][c], b, row0 + i, n + 16 * c);
}

// int8 activations with vpdpbusd (AVX-512 VNNI), more than kStripRows rows: 64-column strips,
// each walking down blocks b0:b1; a block's strip is transposed once (`FillStrip`, 2 KiB) and
// every tile of 4 rows reads it from L1, where the per-tile paths (`BaseVnni`, `BaseI8`) widen
// or transpose it again for each tile (blocks outer, as theirs: walking a strip down the
// blocks instead read rows N bytes apart and was slower at N = 8192). Each (row, column) adds
// the blocks' f32 steps in block order: the same bits. `TileStrip`'s loops are `TileVnni`'s
// on a buffer: sharing them through helpers gave the same bits at 1.02-1.10x the time.
// Returns where its whole strips end (the caller's per-tile path takes the columns after).
template <Format F>
int64_t BaseVnniStrips(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1,
                       int64_t n0, int64_t n1) {
  const int64_t n64 = n0 + (n1 - n0) / 64 * 64;
  StripBuf buf;
  for (int64_t b = b0; b < b1; ++b) {
    PrefetchNextBlock(a, b, b1, n0);
    for (int64_t n = n0; n < n64; n += 64) {
      FillStrip<F>(a, b, n, buf);
      int64_t r = 0;
      for (; r + 4 <= p.M; r += 4) TileStrip<F, 4>(a, p, buf, acc, b, r, n);
      switch (p.M - r) {
        case 1: TileStrip<F, 1>(a, p, buf, acc, b, r, n); break;
        case 2: TileStrip<F, 2>(a, p, buf, acc, b, r, n); break;
        case 3: TileStrip<F, 3>(a, p, buf, acc, b, r, n); break;
        default: break;
      }
    }
  }
  return n64;
}

#if QROWS_AMX
// int8 activations with AMX-INT8 (Sapphire Rapids on), passes of more than 16 rows (prefill
// chunks): one tile multiply takes 16 rows x 32 int8s of x (one block) times 8 quad rows x 64
// bytes of weights (16 columns x 4 consecutive K rows a row, vpdpbusd's order) into 16 x 16
// int32 sums: 8192 multiply-adds an instruction. Weights go signed where that makes the sum
// final: q8_0 as stored and q4_0 as nibble − 8 (tdpbssd); q4_1's nibbles unsigned (tdpbsud; its
// m·Σx is the f32 step's). Per 64-column strip every block is transposed once (`FillAmx`) for
// all the pass's rows (up to kAmxPassRows), x's block tiles are loaded straight from its int8
// copy (K bytes a row), and the f32 step (`StoreI8x16`'s operations per lane, in block order)
// runs on 16 rows x 16 columns held in registers across the blocks: the sums pass through
// memory once (a tile store) and y is loaded and stored once per strip, not per block (with y
// in memory per block the stores bound it at 0.6x the VNNI strips; in registers 0.4-0.5x at 128
// rows). Integer sums are exact: the same bits as every other int8 path. Passes of 6-16 rows
// (decode batches) take `BaseAmxFew`: 0.59-0.93x the VNNI paths' time there on the 1B and
// SmolLM2 shapes (two outliers of 40); below 6 rows the VNNI paths are as fast or faster
// (bench/results/kernels/quant_amx.md).
// Tile state needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+),
// asked once per process; refused, the VNNI paths run.

// ldtilecfg's 64 bytes, palette 1: tiles 0-1 sums (16 x 16 int32), 2-3 x (16 rows x 32 int8),
// 4-5 weights (8 quad rows x 64 bytes); two of each, so one block's product is taken while the
// other's sums are stored
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 2; ++t) { rows[t] = 16; colsb[t] = 64; }
    for (int t = 2; t < 4; ++t) { rows[t] = 16; colsb[t] = 32; }
    for (int t = 4; t < 6; ++t) { rows[t] = 8; colsb[t] = 64; }
  }
};

// block b's 64 columns from n as 4 weight tiles: w[4r + c] is quad row r of column tile c
// (q8_0: byte rows 4r..4r+3; q4: rows 0-3 the low nibbles of byte rows 4r.., i.e. K rows
// 4r.., rows 4-7 the high ones, K rows 16 + 4r..); tile c is w + c with a 256-byte stride
template <Format F>
inline void FillAmx(const Args& a, int64_t b, int64_t n, __m512i* w) {
  const uint8_t* q = a.qs + b * a.qrows * a.N + n;
  if constexpr (F == kQ8_0) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) QuadsUnpack64(q + 4 * t * a.N, a.N, w + 4 * t);
  } else {
    const __m512i m4 = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      __m512i u[4];
      QuadsUnpack64(q + 4 * t * a.N, a.N, u);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m512i lo = _mm512_and_si512(u[c], m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(u[c], 4), m4);
        if constexpr (F == kQ4_0) {
          lo = _mm512_sub_epi8(lo, eight);
          hi = _mm512_sub_epi8(hi, eight);
        }
        w[4 * t + c] = lo;
        w[16 + 4 * t + c] = hi;
      }
    }
  }
}

// sums tile 0 (1) = x tile 2 (3) · weight tile 4 (5), stored to `out` (the tile intrinsics
// take literal tile numbers)
#define QROWS_AMX_PRODUCT(C, X, W)                               \
  template <Format F>                                            \
  inline void AmxProduct##C(int32_t* out) {                      \
    _tile_zero(C);                                               \
    if constexpr (F == kQ4_1) _tile_dpbsud(C, X, W);             \
    else _tile_dpbssd(C, X, W);                                  \
    _tile_stored(C, out, 64);                                    \
  }
QROWS_AMX_PRODUCT(0, 2, 4)
QROWS_AMX_PRODUCT(1, 3, 5)
#undef QROWS_AMX_PRODUCT

// y[i] (16 columns of row i) = `StoreI8x16`'s f32 step on sums row i, dw given widened;
// dx[i] / dq[i]: row i's d_x and d_x·Σq_x for the block (rows past R are padding: skipped)
template <Format F>
inline void StepAmx(__m512 y[16], const int32_t* sums, __m512 dw, __m512 mw, const float* dx,
                    const float* dq, int R) {
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i >= R) break;
    const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * i));
    y[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[i])), v, y[i]);
    if constexpr (F == kQ4_1) y[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dq[i]), y[i]);
  }
}

// the pass's rows over blocks b0:b1 and the whole 64-column strips of n0:n1; returns where they
// end. Per strip: every block's weights are transposed once into a buffer (`FillAmx`, 2 KiB a
// block, L2); then per 16-row tile and 16 columns the f32 sums stay in 16 registers while the
// blocks add in one after another (block b + 1's product is taken before block b's f32 step).
// x's int8 copy has rows up to the next multiple of 16 (their sums are computed, not used).
template <Format F>
int64_t BaseAmx(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1, int64_t n0,
                int64_t n1) {
  const int64_t n64 = n0 + (n1 - n0) / 64 * 64, N = a.N, K = a.K, nb = b1 - b0;
  if (n64 == n0 || nb == 0) return n0;
  thread_local std::vector<__m512i> pack;  // [block][32 vectors]
  thread_local std::vector<float> scales;  // [row tile][block][dx 16 | dq 16 (q4_1)]
  if (int64_t(pack.size()) < 32 * nb) pack.resize(32 * nb);
  const int64_t tiles = (p.M + 15) / 16;
  if (int64_t(scales.size()) < tiles * nb * 32) scales.resize(tiles * nb * 32);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      float* s = scales.data() + (t * nb + b) * 32;
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = 16 * t + i, k = r * a.nb + b0 + b;
        s[i] = r < p.M ? p.xd[k] : 0.f;
        if constexpr (F == kQ4_1) s[16 + i] = r < p.M ? p.xd[k] * float(p.xqs[k]) : 0.f;
      }
    }
  const TileConfig cfg;
  _tile_loadconfig(&cfg);
  alignas(64) int32_t sums[2][16 * 16];
  for (int64_t n = n0; n < n64; n += 64) {
    for (int64_t b = b0; b < b1; ++b) {
      PrefetchNextBlock(a, b, b1, n);
      FillAmx<F>(a, b, n, pack.data() + 32 * (b - b0));
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = 16 * t;
      const int R = int(std::min<int64_t>(16, p.M - r0));
      const int8_t* xt = p.xq + r0 * K;
      const float* st = scales.data() + t * nb * 32;
      for (int c = 0; c < 4; ++c) {
        const int64_t col = n + 16 * c;
        __m512 y[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          y[i] = i < R ? _mm512_loadu_ps(acc + (r0 + i) * N + col) : _mm512_setzero_ps();
        const __m512i* wc = pack.data() + c;
        auto dw_of = [&](int64_t b) {
          return _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.d + b * N + col)));
        };
        auto mw_of = [&](int64_t b) {
          if constexpr (F == kQ4_1)
            return _mm512_cvtph_ps(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.m + b * N + col)));
          else
            return _mm512_setzero_ps();
        };
        // block pairs through tiles (0, 2, 4) and (1, 3, 5)
        _tile_loadd(2, xt + b0 * kBlock, K);
        _tile_loadd(4, wc, 256);
        AmxProduct0<F>(sums[0]);
        for (int64_t b = b0 + 1; b < b1 + 1; ++b) {
          const int64_t i = b - b0;
          if (b < b1) {
            if (i & 1) {
              _tile_loadd(3, xt + b * kBlock, K);
              _tile_loadd(5, wc + 32 * i, 256);
              AmxProduct1<F>(sums[1]);
            } else {
              _tile_loadd(2, xt + b * kBlock, K);
              _tile_loadd(4, wc + 32 * i, 256);
              AmxProduct0<F>(sums[0]);
            }
          }
          const float* sp = st + (i - 1) * 32;
          StepAmx<F>(y, sums[(i - 1) & 1], dw_of(b - 1), mw_of(b - 1), sp, sp + 16, R);
        }
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          if (i < R) _mm512_storeu_ps(acc + (r0 + i) * N + col, y[i]);
      }
    }
  }
  _tile_release();
  return n64;
}

// passes of kAmxFewRows..16 rows (decode batches): x's block is one tile of M rows for all the
// strips; each 64-column strip is transposed and taken as 4 column tiles at once (tiles 0-3
// sums, 4 x, 5-6 weights), and the f32 step adds into y in memory. With one row tile there is
// nothing to share a transposed strip with, so `BaseAmx`'s buffer of every block's strips
// (and its y in registers, one column tile at a time) would cost more than it saves.
struct alignas(64) TileConfigFew {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfigFew(int m) {
    for (int t = 0; t < 4; ++t) { rows[t] = uint8_t(m); colsb[t] = 64; }
    rows[4] = uint8_t(m); colsb[4] = 32;
    for (int t = 5; t < 7; ++t) { rows[t] = 8; colsb[t] = 64; }
  }
};

template <Format F>
int64_t BaseAmxFew(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1, int64_t n0,
                   int64_t n1) {
  const int64_t n64 = n0 + (n1 - n0) / 64 * 64, N = a.N;
  if (n64 == n0) return n0;
  const TileConfigFew cfg(int(p.M));
  _tile_loadconfig(&cfg);
  alignas(64) __m512i w[32];
  alignas(64) int32_t sums[4][16][16];
  for (int64_t b = b0; b < b1; ++b) {
    PrefetchNextBlock(a, b, b1, n0);
    _tile_loadd(4, p.xq + b * kBlock, a.K);
    for (int64_t n = n0; n < n64; n += 64) {
      FillAmx<F>(a, b, n, w);
#define QROWS_FEW_PRODUCT(C, W)                                         \
  _tile_zero(C);                                                        \
  _tile_loadd(W, w + C, 256);                                           \
  if constexpr (F == kQ4_1) _tile_dpbsud(C, 4, W); else _tile_dpbssd(C, 4, W)
      QROWS_FEW_PRODUCT(0, 5);
      QROWS_FEW_PRODUCT(1, 6);
      QROWS_FEW_PRODUCT(2, 5);
      QROWS_FEW_PRODUCT(3, 6);
#undef QROWS_FEW_PRODUCT
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
      __m512 dw[4], mw[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        dw[c] = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.d + b * N + n + 16 * c)));
        if constexpr (F == kQ4_1)
          mw[c] = _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.m + b * N + n + 16 * c)));
      }
      for (int64_t i = 0; i < p.M; ++i) {
        const int64_t k = i * a.nb + b;
        const __m512 dx = _mm512_set1_ps(p.xd[k]);
        float* y = acc + i * N + n;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(sums[c][i]));
          __m512 out = _mm512_fmadd_ps(_mm512_mul_ps(dw[c], dx), v, _mm512_loadu_ps(y + 16 * c));
          if constexpr (F == kQ4_1)
            out = _mm512_fmadd_ps(mw[c], _mm512_set1_ps(p.xd[k] * float(p.xqs[k])), out);
          _mm512_storeu_ps(y + 16 * c, out);
        }
      }
    }
  }
  _tile_release();
  return n64;
}
#endif


#endif

#if QROWS_VNNI
// int8 activations with AVX-512 VNNI: vpdpbusd multiplies 4 unsigned bytes by 4 signed ones
// per 32-bit lane and adds them into the lane, 64 multiply-adds an instruction (vpmaddubsw's
// 32, without the int16 step). It wants 4 consecutive K rows of one column in a lane; the
// blocks hold a column's K rows N bytes apart, so per quad of byte rows two byte permutes
// (vpermt2b, AVX512-VBMI) turn 4 rows x 64 columns into 4 vectors of 16 columns x 4 rows, and
// q4's nibbles split into 2 (K rows 4t..4t+3 and 16+4t..): 2 vpdpbusd per 16 columns per row
// against the broadcast 4 int8s of x. q8_0's signed bytes are made unsigned (xor 0x80: q + 128)
// and 128·Σq_x taken off. Integer sums are exact, so results equal the AVX2 int8 tiles' bit for
// bit (the f32 step `StoreI8x16` is `StoreI8` lane for lane).

// byte permutes of the quad transpose: pair[h] takes columns 32h..32h+31 of two rows as
// (row a, row b) byte pairs; quad[g] takes pairs 16g..16g+15 of two pair vectors as quads;
// one16 turns 4 rows x 16 columns side by side into quads (built once per `BaseVnni` call)
struct QuadIdx {
  __m512i pair[2], quad[2], one16;
  QuadIdx() {
    alignas(64) uint8_t t[4][64];
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 32; ++c)
        for (int i = 0; i < 2; ++i) t[h][2 * c + i] = uint8_t(i * 64 + 32 * h + c);
    for (int g = 0; g < 2; ++g)
      for (int c = 0; c < 16; ++c)
        for (int i = 0; i < 4; ++i)
          t[2 + g][4 * c + i] = uint8_t((i >> 1) * 64 + 32 * g + 2 * c + (i & 1));
    for (int k = 0; k < 2; ++k) {
      pair[k] = _mm512_load_si512(t[k]);
      quad[k] = _mm512_load_si512(t[2 + k]);
    }
    alignas(64) uint8_t u[64];
    for (int c = 0; c < 16; ++c)
      for (int i = 0; i < 4; ++i) u[4 * c + i] = uint8_t(16 * i + c);
    one16 = _mm512_load_si512(u);
  }
};

// rows r..r+3 (N bytes apart from q) x 64 columns -> out[g]: columns 16g..16g+15, 4 rows a lane
inline void Quads64(const uint8_t* q, int64_t N, const QuadIdx& ix, __m512i out[4]) {
  const __m512i r0 = _mm512_loadu_si512(q), r1 = _mm512_loadu_si512(q + N);
  const __m512i r2 = _mm512_loadu_si512(q + 2 * N), r3 = _mm512_loadu_si512(q + 3 * N);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m512i u = _mm512_permutex2var_epi8(r0, ix.pair[h], r1);
    const __m512i v = _mm512_permutex2var_epi8(r2, ix.pair[h], r3);
    out[2 * h] = _mm512_permutex2var_epi8(u, ix.quad[0], v);
    out[2 * h + 1] = _mm512_permutex2var_epi8(u, ix.quad[1], v);
  }
}

// 16 columns: the four 16-byte rows side by side, then one vpermb (`QuadIdx::one16`)
inline __m512i Quads16(const uint8_t* q, int64_t N, const __m512i& idx) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + N)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * N)), 2);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 3 * N)), 3);
  return _mm512_permutexvar_epi8(idx, v);
}

// block b, columns n..n + 16·C (C = 4: 64, one cache line of each byte row; C = 1: 16), rows
// row0..row0 + R: Σ q_x·q_w in int32 per (row, column), then the f32 step
template <Format F, int R, int C>
inline void TileVnni(const Args& a, const Pass& p, const QuadIdx& ix, float* acc, int64_t b,
                     int64_t row0, int64_t n) {
  const int64_t N = a.N, K = a.K;
  __m512i s[R][C];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) s[i][c] = _mm512_setzero_si512();
  const uint8_t* q = a.qs + b * a.qrows * N + n;
  const int8_t* xb = p.xq + row0 * K + b * kBlock;
  const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(char(0x80));
  constexpr int kQuads = F == kQ8_0 ? 8 : 4;
#pragma GCC unroll 2
  for (int t = 0; t < kQuads; ++t) {
    __m512i w[C];
    if constexpr (C == 4) Quads64(q + 4 * t * N, N, ix, w);
    else w[0] = Quads16(q + 4 * t * N, N, ix.one16);
    if constexpr (F == kQ8_0) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) w[c] = _mm512_xor_si512(w[c], flip);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        int32_t quad;
        std::memcpy(&quad, xb + i * K + 4 * t, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) s[i][c] = _mm512_dpbusd_epi32(s[i][c], w[c], xv);
      }
    } else {
      __m512i hi[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(w[c], 4), m4);
        w[c] = _mm512_and_si512(w[c], m4);
      }
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        int32_t ql, qh;
        std::memcpy(&ql, xb + i * K + 4 * t, 4);
        std::memcpy(&qh, xb + i * K + 16 + 4 * t, 4);
        const __m512i xl = _mm512_set1_epi32(ql), xh = _mm512_set1_epi32(qh);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c)
          s[i][c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[i][c], w[c], xl), hi[c], xh);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
      StoreI8x16<F>(a, p, acc + (row0 + i) * N + n + 16 * c, s[i][c], b, row0 + i, n + 16 * c);
}

// every row of block b over columns n..n + 16·C, in tiles of up to 4 rows
template <Format F, int C>
inline void RowsVnni(const Args& a, const Pass& p, const QuadIdx& ix, float* acc, int64_t b,
                     int64_t n) {
  for (int64_t r = 0; r < p.M; r += 4) {
    switch (std::min<int64_t>(4, p.M - r)) {
      case 1: TileVnni<F, 1, C>(a, p, ix, acc, b, r, n); break;
      case 2: TileVnni<F, 2, C>(a, p, ix, acc, b, r, n); break;
      case 3: TileVnni<F, 3, C>(a, p, ix, acc, b, r, n); break;
      default: TileVnni<F, 4, C>(a, p, ix, acc, b, r, n); break;
    }
  }
}

// int8 activations over blocks b0:b1, columns n0:n1 with the VNNI tiles (see `BaseI8`)
template <Format F>
void BaseVnni(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1, int64_t n0,
              int64_t n1) {
  const int64_t n64 = n0 + (n1 - n0) / 64 * 64, n16 = n0 + (n1 - n0) / 16 * 16;
  const QuadIdx ix;
  for (int64_t b = b0; b < b1; ++b) {
    PrefetchNextBlock(a, b, b1, n0);
    int64_t n = n0;
    for (; n < n64; n += 64) RowsVnni<F, 4>(a, p, ix, acc, b, n);
    for (; n < n16; n += 16) RowsVnni<F, 1>(a, p, ix, acc, b, n);
  }
  if (n16 < n1) BaseI8Scalar(a, p, acc, b0, b1, n16, n1);
}
#endif

// columns n..n + 16·C of block b, every row (q8_0): one row 64 columns, more in tiles of 4 rows
// x 16 columns (measured faster at 8 rows than 2 x 32)
template <int C>
inline void RowsQ8I8(const Args& a, const Pass& p, float* acc, int64_t b, int64_t n) {
  if constexpr (C == 4) {
    TileQ8I8<1, 4>(a, p, acc, b, 0, n);
  } else {
    for (int64_t r = 0; r < p.M; r += 4) {
      switch (std::min<int64_t>(4, p.M - r)) {
        case 1: TileQ8I8<1, 1>(a, p, acc, b, r, n); break;
        case 2: TileQ8I8<2, 1>(a, p, acc, b, r, n); break;
        case 3: TileQ8I8<3, 1>(a, p, acc, b, r, n); break;
        default: TileQ8I8<4, 1>(a, p, acc, b, r, n); break;
      }
    }
  }
}

// int8 activations over blocks b0:b1, columns n0:n1: per block, per tile of columns, the rows
// in tiles (q4: 2 rows x 32 columns), the tile's bytes read again (from L1 / L2) for each
template <Format F>
void BaseI8(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1, int64_t n0,
            int64_t n1) {
  const int64_t cols = F == kQ8_0 && p.M == 1 ? 64 : 32;
  const int64_t nv = n0 + (n1 - n0) / cols * cols;
  const int64_t n32 = n0 + (n1 - n0) / 32 * 32;
  for (int64_t b = b0; b < b1; ++b) {
    PrefetchNextBlock(a, b, b1, n0);
    int64_t n = n0;
    if constexpr (F == kQ8_0) {
      if (cols == 64)
        for (; n < nv; n += 64) RowsQ8I8<4>(a, p, acc, b, n);
      for (; n < n32; n += 16) RowsQ8I8<1>(a, p, acc, b, n);
    } else {
      for (; n < n32; n += 32) {
        int64_t r = 0;
        for (; r + 2 <= p.M; r += 2) TileQ4I8<F, 2>(a, p, acc, b, r, n);
        if (r < p.M) TileQ4I8<F, 1>(a, p, acc, b, r, n);
      }
    }
  }
  if (n32 < n1) BaseI8Scalar(a, p, acc, b0, b1, n32, n1);
}

void RunTask(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1, int64_t n0,
             int64_t n1) {
  if (p.xq) {
    int64_t ns = n0;  // columns n0:ns done by strips
#if QROWS_AMX
    if (UseAmx(p.M, true)) {
      switch (a.fmt) {
        case kQ8_0: ns = BaseAmx<kQ8_0>(a, p, acc, b0, b1, n0, n1); break;
        case kQ4_0: ns = BaseAmx<kQ4_0>(a, p, acc, b0, b1, n0, n1); break;
        default: ns = BaseAmx<kQ4_1>(a, p, acc, b0, b1, n0, n1); break;
      }
    } else if (p.M >= kAmxFewRows && AmxOn()) {
      switch (a.fmt) {
        case kQ8_0: ns = BaseAmxFew<kQ8_0>(a, p, acc, b0, b1, n0, n1); break;
        case kQ4_0: ns = BaseAmxFew<kQ4_0>(a, p, acc, b0, b1, n0, n1); break;
        default: ns = BaseAmxFew<kQ4_1>(a, p, acc, b0, b1, n0, n1); break;
      }
    }
#endif
#if QROWS_DPBUSD
    if (ns == n0 && p.M > kStripRows) {
      switch (a.fmt) {
        case kQ8_0: ns = BaseVnniStrips<kQ8_0>(a, p, acc, b0, b1, n0, n1); break;
        case kQ4_0: ns = BaseVnniStrips<kQ4_0>(a, p, acc, b0, b1, n0, n1); break;
        default: ns = BaseVnniStrips<kQ4_1>(a, p, acc, b0, b1, n0, n1); break;
      }
    }
#endif
    if (ns < n1) {
#if QROWS_VNNI
      switch (a.fmt) {
        case kQ8_0: BaseVnni<kQ8_0>(a, p, acc, b0, b1, ns, n1); break;
        case kQ4_0: BaseVnni<kQ4_0>(a, p, acc, b0, b1, ns, n1); break;
        default: BaseVnni<kQ4_1>(a, p, acc, b0, b1, ns, n1); break;
      }
#else
      switch (a.fmt) {
        case kQ8_0: BaseI8<kQ8_0>(a, p, acc, b0, b1, ns, n1); break;
        case kQ4_0: BaseI8<kQ4_0>(a, p, acc, b0, b1, ns, n1); break;
        default: BaseI8<kQ4_1>(a, p, acc, b0, b1, ns, n1); break;
      }
#endif
    }
  } else {
    switch (a.fmt) {
      case kQ8_0: Base<kQ8_0>(a, p, acc, b0, b1, n0, n1); break;
      case kQ4_0: Base<kQ4_0>(a, p, acc, b0, b1, n0, n1); break;
      default: Base<kQ4_1>(a, p, acc, b0, b1, n0, n1); break;
    }
  }
#if QROWS_AVX512
  if (!p.slots->empty()) Delta512(a, p, acc, b0 * kBlock, b1 * kBlock, n0, n1);
#else
  if (!p.slots->empty()) Delta(a, p, acc, b0 * kBlock, b1 * kBlock, n0, n1);
#endif
}
#else
void RunTask(const Args& a, const Pass& p, float* acc, int64_t b0, int64_t b1, int64_t n0,
             int64_t n1) {
  if (p.xq) BaseI8Scalar(a, p, acc, b0, b1, n0, n1);
  else BaseScalar(a, p, acc, b0, b1, n0, n1);
  if (!p.slots->empty()) DeltaScalar(a, p, acc, b0 * kBlock, b1 * kBlock, n0, n1);
}
#endif

// One product of a call: its weights (and slot bank), its bank's slot count and its output.
struct Product {
  Args a;
  float* y;  // [M, a.N]
  int64_t S;
};

// The products x · W_p (+ deltas) of one x: x's block sums and int8 copy made once, then every
// product's tasks in one pool run. Every product splits its columns and K exactly as a call of
// its own would (the same sums: a fused q/k/v call gives the bits of three calls). The products
// share K, the format and the slot ids.
ffi::Error RunMany(const std::vector<Product>& prods, const float* x, const int32_t* slots,
                   int64_t M, bool int8_act) {
  if (prods.empty() || M == 0) return ffi::Error::Success();
  const Args& a0 = prods[0].a;
  const int64_t K = a0.K, nb = a0.nb;
  for (const Product& pr : prods)
    for (int64_t r = 0; slots && r < M; ++r)
      if (slots[r] > 0 && (slots[r] < pr.a.first || slots[r] - pr.a.first >= pr.S))
        return ffi::Error::InvalidArgument("quant_rows: a slot id is past the bank");
  // x's block sums and int8 copy, made once per call (over the pool when there are many)
  thread_local std::vector<float> sx, xd;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<int16_t> x16;
  thread_local std::vector<int32_t> xqs;
  const bool q16 = int8_act && a0.fmt == kQ8_0;
  // Σx per block: q4_1's m·Σx with f32 x, and every delta term (x·S = 2·x·B − Σx)
  bool need_sx = !int8_act;
  for (int64_t r = 0; slots && !need_sx && r < M; ++r) need_sx = slots[r] > 0;
  if (int64_t(sx.size()) < M * nb) sx.resize(M * nb);
  const bool amx = UseAmx(M, int8_act);
  const int64_t pass_rows = amx ? kAmxPassRows : kRowsPerPass;
  if (int8_act) {
    // AMX loads x in tiles of 16 rows: room for the last tile's rows past M
    const int64_t xq_rows = amx ? (M + 15) / 16 * 16 : M;
    if (int64_t(xq.size()) < xq_rows * K) xq.resize(xq_rows * K);
    if (q16 && int64_t(x16.size()) < M * K) x16.resize(M * K);
    if (int64_t(xd.size()) < M * nb) xd.resize(M * nb);
    if (int64_t(xqs.size()) < M * nb) xqs.resize(M * nb);
  }
  Pool& pool = Pool::get();
  {
    const int64_t units = M * nb;
    // this thread's buffers, by pointer: in the pool's workers the names are their own
    float* const psx = need_sx ? sx.data() : nullptr;
    int8_t* const pq = int8_act ? xq.data() : nullptr;
    int16_t* const pq16 = q16 ? x16.data() : nullptr;
    float* const pd = int8_act ? xd.data() : nullptr;
    int32_t* const pqs = int8_act ? xqs.data() : nullptr;
    auto prep = [=](int64_t i0, int64_t i1) {
      PrepareActivations(x, K, i0, i1, psx, pq, pq16, pd, pqs);
    };
    const int n = M * K < (int64_t(1) << 15) ? 1 : pool.size();
    if (n == 1) {
      prep(0, units);
    } else {
      const int64_t per = (units + n - 1) / n;
      pool.run([&](int t) { prep(std::min(units, t * per), std::min(units, (t + 1) * per)); }, n);
    }
  }
  // a product's split of one pass: column ranges of at least kMinCols (multiples of 64), then
  // K ranges of whole blocks and, with deltas, whole bit groups (split as for a pass of at
  // most kRowsPerPass rows: the same sums on every path)
  struct Split { int64_t nn, ncol, nk, kper, part, first_task, first_part; };
  thread_local std::vector<float> scratch;  // the partials of K tasks 1.., product after product
  std::vector<Split> splits(prods.size());
  for (int64_t r0 = 0; r0 < M; r0 += pass_rows) {
    const int64_t rows = std::min(pass_rows, M - r0);
    std::vector<Group> groups;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = slots ? slots[r0 + r] : 0;
      if (s <= 0) continue;
      auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.slot == s; });
      if (it == groups.end()) groups.push_back({s, {r}});
      else it->rows.push_back(r);
    }
    const Pass p{x + r0 * K, need_sx ? sx.data() + r0 * nb : nullptr, rows, &groups,
                 int8_act ? xq.data() + r0 * K : nullptr,
                 q16 ? x16.data() + r0 * K : nullptr,
                 int8_act ? xd.data() + r0 * nb : nullptr,
                 int8_act ? xqs.data() + r0 * nb : nullptr};
    int64_t tasks = 0, parts_total = 0;
    for (size_t i = 0; i < prods.size(); ++i) {
      const Args& a = prods[i].a;
      const int64_t N = a.N;
      const int threads =
          std::min(rows, kRowsPerPass) * K * N < (int64_t(1) << 16) ? 1 : pool.size();
      int64_t nn = std::max<int64_t>(1, std::min<int64_t>(threads, N / kMinCols));
      int64_t ncol = (N + nn - 1) / nn;
      ncol = (ncol + 63) / 64 * 64;
      nn = (N + ncol - 1) / ncol;
      const int64_t unit = groups.empty() ? 1 : std::lcm(kBlock, a.G) / kBlock;  // in blocks
      const int64_t units = (nb + unit - 1) / unit;
      int64_t nk = std::max<int64_t>(1, std::min<int64_t>(threads / nn, units));
      const int64_t kper = (units + nk - 1) / nk * unit;  // blocks per K task
      nk = (nb + kper - 1) / kper;
      splits[i] = {nn, ncol, nk, kper, rows * N, tasks, parts_total};
      tasks += nk * nn;
      parts_total += (nk - 1) * rows * N;
    }
    if (int64_t(scratch.size()) < parts_total) scratch.resize(parts_total);
    float* parts = scratch.data();
    pool.run([&](int t) {
      size_t i = 0;
      while (i + 1 < prods.size() && t >= splits[i + 1].first_task) ++i;
      const Split& sp = splits[i];
      const Args& a = prods[i].a;
      const int64_t local = t - sp.first_task;
      const int64_t kc = local / sp.nn, nc = local % sp.nn;
      const int64_t b0 = kc * sp.kper, b1 = std::min(nb, b0 + sp.kper);
      const int64_t n0 = nc * sp.ncol, n1 = std::min(a.N, n0 + sp.ncol);
      float* acc = kc == 0 ? prods[i].y + r0 * a.N : parts + sp.first_part + (kc - 1) * sp.part;
      for (int64_t r = 0; r < rows; ++r) std::fill(acc + r * a.N + n0, acc + r * a.N + n1, 0.f);
      RunTask(a, p, acc, b0, b1, n0, n1);
    }, int(tasks));
    for (size_t i = 0; i < prods.size(); ++i) {
      const Split& sp = splits[i];
      float* yp = prods[i].y + r0 * prods[i].a.N;
      for (int64_t c = 1; c < sp.nk; ++c) {
        const float* q = parts + sp.first_part + (c - 1) * sp.part;
        for (int64_t j = 0; j < sp.part; ++j) yp[j] += q[j];
      }
    }
  }
  return ffi::Error::Success();
}

// One product's operands checked against x [M, K] and turned into its Args (and slot count).
ffi::Error Weights(const ffi::AnyBuffer& qs, const ffi::Buffer<ffi::F16>& d,
                   const ffi::Buffer<ffi::F16>& m, const ffi::Buffer<ffi::U8>& bits,
                   const ffi::Buffer<ffi::F32>& scale, int64_t M, int64_t K, int64_t slots_n,
                   int64_t format, int64_t group_k, int64_t first_slot, int64_t delta,
                   Args* out, int64_t* S_out) {
  auto qd = qs.dimensions();
  auto dd = d.dimensions();
  if (format < kQ8_0 || format > kQ4_1)
    return ffi::Error::InvalidArgument("quant_rows: format must be 0 (q8_0), 1 (q4_0) or 2 (q4_1)");
  const Format fmt = Format(format);
  const int64_t qrows = fmt == kQ8_0 ? 32 : 16;
  if (qd.size() != 3 || qd[1] != qrows || qd[0] * kBlock != K || dd.size() != 2 ||
      dd[0] != qd[0] || dd[1] != qd[2])
    return ffi::Error::InvalidArgument("quant_rows: expected x[M,K], qs[K/32,32|16,N], d[K/32,N]");
  const int64_t N = qd[2], nb = qd[0];
  if (qs.element_type() != (fmt == kQ8_0 ? ffi::DataType::S8 : ffi::DataType::U8))
    return ffi::Error::InvalidArgument("quant_rows: qs is int8 for q8_0, uint8 for q4_0/q4_1");
  if (fmt == kQ4_1 && (m.dimensions().size() != 2 || m.dimensions()[0] != nb ||
                       m.dimensions()[1] != N))
    return ffi::Error::InvalidArgument("quant_rows: q4_1 needs m[K/32,N]");
  int64_t S = 0, KP = 0;
  if (delta) {
    auto bd = bits.dimensions();
    auto sd = scale.dimensions();
    if (bd.size() != 3 || bd[2] != N || bd[1] * 8 < K || sd.size() != 2 || sd[0] != bd[0] ||
        sd[1] != N || slots_n != M)
      return ffi::Error::InvalidArgument(
          "quant_rows: expected bits[S,KP,N], scale[S,N] and slots[M] matching x and W");
    if (first_slot < 0 || first_slot > 1)
      return ffi::Error::InvalidArgument("quant_rows: first_slot must be 0 or 1");
    if (group_k <= 0 || group_k % 8 || bd[1] % (group_k / 8))
      return ffi::Error::InvalidArgument("quant_rows: group_k must be a multiple of 8 dividing 8*KP");
    S = bd[0];
    KP = bd[1];
  }
  *out = Args{K, N, nb, qrows, fmt,
              static_cast<const uint8_t*>(qs.untyped_data()),
              reinterpret_cast<const uint16_t*>(d.untyped_data()),
              reinterpret_cast<const uint16_t*>(m.untyped_data()),
              bits.typed_data(), scale.typed_data(), KP, delta ? group_k : 8, first_slot};
  *S_out = S;
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qs, ffi::Buffer<ffi::F16> d,
                ffi::Buffer<ffi::F16> m, ffi::Buffer<ffi::U8> bits, ffi::Buffer<ffi::F32> scale,
                ffi::Buffer<ffi::S32> slots, ffi::ResultBuffer<ffi::F32> y, int64_t format,
                int64_t group_k, int64_t first_slot, int64_t delta, int64_t act) {
  auto xd = x.dimensions();
  if (xd.size() != 2)
    return ffi::Error::InvalidArgument("quant_rows: expected x[M,K], qs[K/32,32|16,N], d[K/32,N]");
  if (act < 0 || act > 1)
    return ffi::Error::InvalidArgument("quant_rows: act must be 0 (f32) or 1 (int8)");
  const int64_t M = xd[0];
  Args a;
  int64_t S;
  const int64_t slots_n = slots.dimensions().size() == 1 ? slots.dimensions()[0] : -1;
  ffi::Error err = Weights(qs, d, m, bits, scale, M, xd[1], slots_n, format, group_k,
                           first_slot, delta, &a, &S);
  if (err.failure()) return err;
  return RunMany({{a, y->typed_data(), S}}, x.typed_data(), delta ? slots.typed_data() : nullptr,
                 M, act == 1);
}

// Several products of one x in one call (q/k/v, gate/up): after x and the slot ids, five
// operands per product (qs, d, m, bits, scale) and one result each; the products share the
// format, group_k, first_slot, delta and act. Each product's sums are those of its own call.
ffi::Error ManyImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots, ffi::RemainingArgs ops,
                    ffi::RemainingRets ys, int64_t format, int64_t group_k, int64_t first_slot,
                    int64_t delta, int64_t act) {
  auto xd = x.dimensions();
  if (xd.size() != 2)
    return ffi::Error::InvalidArgument("quant_rows_many: expected x[M,K]");
  if (act < 0 || act > 1)
    return ffi::Error::InvalidArgument("quant_rows_many: act must be 0 (f32) or 1 (int8)");
  const size_t P = ys.size();
  if (P == 0 || ops.size() != 5 * P)
    return ffi::Error::InvalidArgument(
        "quant_rows_many: expected 5 operands (qs, d, m, bits, scale) per result");
  const int64_t M = xd[0], K = xd[1];
  const int64_t slots_n = slots.dimensions().size() == 1 ? slots.dimensions()[0] : -1;
  std::vector<Product> prods(P);
  for (size_t i = 0; i < P; ++i) {
    auto qs = ops.get<ffi::AnyBuffer>(5 * i);
    auto d = ops.get<ffi::Buffer<ffi::F16>>(5 * i + 1);
    auto m = ops.get<ffi::Buffer<ffi::F16>>(5 * i + 2);
    auto bits = ops.get<ffi::Buffer<ffi::U8>>(5 * i + 3);
    auto scale = ops.get<ffi::Buffer<ffi::F32>>(5 * i + 4);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!qs.has_value() || !d.has_value() || !m.has_value() || !bits.has_value() ||
        !scale.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument(
          "quant_rows_many: operands per product are qs (s8|u8), d, m (f16), bits (u8), scale "
          "(f32); results f32");
    ffi::Error err = Weights(*qs, *d, *m, *bits, *scale, M, K, slots_n, format, group_k,
                             first_slot, delta, &prods[i].a, &prods[i].S);
    if (err.failure()) return err;
    auto yd = (*y)->dimensions();
    if (yd.size() != 2 || yd[0] != M || yd[1] != prods[i].a.N)
      return ffi::Error::InvalidArgument("quant_rows_many: result i must be [M, N_i]");
    prods[i].y = (*y)->typed_data();
  }
  return RunMany(prods, x.typed_data(), delta ? slots.typed_data() : nullptr, M, act == 1);
}

}  // namespace

// whether int8 activations take the AMX tiles in this build and process: 1 yes; 0 the build has
// no AMX path (the CPU or the compiler lacks AMX-INT8); -1 turned off by BITDELTA_AMX=0; -2
// Linux refused the tile state
extern "C" int BitdeltaQuantRowsAmx() {
#if QROWS_AMX
  if (AmxGranted()) return 1;
  const char* env = std::getenv("BITDELTA_AMX");
  return env && std::string(env) == "0" ? -1 : -2;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaQuantRows, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // qs [K/32, 32|16, N] s8 | u8
                                  .Arg<ffi::Buffer<ffi::F16>>()  // d [K/32, N]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // m [K/32, N] (q4_1) or d
                                  .Arg<ffi::Buffer<ffi::U8>>()   // bits [S, KP, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [S, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [M]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group_k")
                                  .Attr<int64_t>("first_slot")
                                  .Attr<int64_t>("delta")
                                  .Attr<int64_t>("act"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaQuantRowsMany, ManyImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [M]
                                  .RemainingArgs()               // (qs, d, m, bits, scale) each
                                  .RemainingRets()               // y_i [M, N_i] f32
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group_k")
                                  .Attr<int64_t>("first_slot")
                                  .Attr<int64_t>("delta")
                                  .Attr<int64_t>("act"));
