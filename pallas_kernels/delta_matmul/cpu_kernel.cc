// CPU kernel for delta_matmul's delta term, called from XLA through jax.ffi (see cpu.py).
//
//   out[m, n] = base[m, n] + alpha[s, n] * (x[m] . S_s[:, n]),  s = slots[m];
//   rows with s < 0 or s >= S get out = base (base only).
//
// Rows are grouped by slot (one counting sort), so each slot present reads its bits once per
// block of rows; slots no row uses are never read. Per slot, by its row count:
//
// * LUT (few rows, decode). x.S = 2 x.B - rowsum(x) with B in {0, 1} the stored bit planes. A
//   packed byte row r holds bits for 8 rows of K (k = g*G + j*P + p, j = bit). Per row of x and
//   byte row r: two 16-entry tables (T-MAC / LUT-GEMM style), T_lo[i] = sum over the set bits
//   j < 4 of i of x[k_j], T_hi the same for bits 4..7. Then for 16 columns at once
//     acc += vpermps(bytes, T_lo) + vpermps(bytes >> 4, T_hi)
//   (vpermps reads the low 4 index bits): 8 rows of K cost 2 permutes and 2 adds per 16
//   columns, the bits never leave registers. A table is built once per row (4 masked adds per
//   half with AVX-512) and reused over all column tiles; rowsum(x) = sum of the T[15] entries.
//   With AVX2 a 16-entry lookup is two 8-entry vpermps and a blend on bit 3, for 8 columns.
// * Expand-then-FMA (many rows, prefill). Per panel of kPanel columns, S (+-1.0 f32, [K, kPanel])
//   is written once into a scratch buffer that stays in L2, then a register-blocked FMA
//   micro-kernel (kMr rows x kPanel columns of accumulators) runs every row of the slot over it.
//   One extra small-GEMM pass: its cost no longer grows with table building per row.
//
// The row count at which a slot switches to expand-then-FMA is the attribute expand_rows (<= 0:
// kExpandRowsDefault). Work is split into tasks (row blocks or column ranges of one slot) run by
// a persistent thread pool when the call is big enough; alpha and base are applied in the tile
// epilogues. A portable path (scalar lookups, plain loops over the expanded panel) runs where
// neither AVX-512 nor AVX2 exists.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BD_AVX2 1
#endif

#include "pool.h"  // pallas_kernels/native, on the include path (native/build.py)
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 4;        // LUT: rows of x per block (shares each loaded byte row)
constexpr int kTileCols = 64;      // LUT: columns per tile (4 zmm accumulators per row)
constexpr int kPrefetchRows = 16;  // LUT: byte rows are N bytes apart, prefetch ahead
constexpr int kPanel = 64;         // expand: columns per expanded panel
constexpr int kMr = 6;             // expand: rows per FMA micro-kernel call
// Rows of one slot from which expand-then-FMA beats the LUT (bench/results/kernels/cpu_delta.md). With
// AVX-512 the LUT's 2 permutes + 2 adds per 16 columns x 8 rows of K beat 8 FMAs at every row
// count measured (1-512), so expand-then-FMA only runs when asked for.
#ifdef BD_AVX512
constexpr int64_t kExpandRowsDefault = int64_t(1) << 40;
#else
constexpr int64_t kExpandRowsDefault = 48;
#endif
// Merged calls: a slot with this many rows gets its own W_base + alpha * S panel; fewer, the LUT.
constexpr int64_t kMergeRowsDefault = 8;
// Vector operations (about cycles) below which one thread does everything: waking the pool
// costs ~5-10 us.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 16;

struct Problem {
  const float* x;        // [M, K]
  const uint8_t* bits;   // [S, R, N], R = K_pad / 8
  const float* scale;    // [S, C]
  const float* base;     // [M, N]
  float* out;            // [M, N] (may alias base)
  const float* w;        // [K, N] W_base, merged calls only (else null)
  int64_t M, K, N, R, G, C, S;
};

// --- thread pool: the process's one pool (pallas_kernels/native/pool.h) ------------------------

using bitdelta_native::Pool;

// --- LUT strategy --------------------------------------------------------------------------------

// The 8 x values behind byte row r (0 for padded rows k >= K).
inline void ByteRowValues(const Problem& p, const float* x, int64_t r, float xs[8]) {
  const int64_t P = p.G / 8, k0 = (r / P) * p.G + r % P;
  for (int j = 0; j < 8; ++j) {
    const int64_t k = k0 + j * P;
    xs[j] = k < p.K ? x[k] : 0.0f;
  }
}

// Tables for `nrows` rows: tab[(m * R + r) * 32 + {0..15 lo, 16..31 hi}]; rowsum from T[15]s.
void BuildTables(const Problem& p, const int32_t* rows, int nrows, float* tab, float* rowsum) {
  for (int m = 0; m < nrows; ++m) {
    const float* x = p.x + int64_t(rows[m]) * p.K;
    float rs = 0.0f;
    for (int64_t r = 0; r < p.R; ++r) {
      float xs[8];
      ByteRowValues(p, x, r, xs);
      float* t = tab + (int64_t(m) * p.R + r) * 32;
#ifdef BD_AVX512
      const __mmask16 bit[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};  // entries i with bit j set
      for (int h = 0; h < 2; ++h) {
        __m512 v = _mm512_setzero_ps();
        for (int j = 0; j < 4; ++j)
          v = _mm512_mask_add_ps(v, bit[j], v, _mm512_set1_ps(xs[4 * h + j]));
        _mm512_storeu_ps(t + 16 * h, v);
      }
#else
      for (int h = 0; h < 2; ++h) {  // T[i] = T[i without its top bit] + x of that bit
        float* th = t + 16 * h;
        th[0] = 0.0f;
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < (1 << j); ++i) th[(1 << j) + i] = th[i] + xs[4 * h + j];
      }
#endif
      rs += t[15] + t[31];
    }
    rowsum[m] = rs;
  }
}

#ifdef BD_AVX512
template <int MB>
void Tile(const Problem& p, const uint8_t* bits_s, const float* scale_s, const int32_t* rows,
          const float* tab, const float* rowsum, int64_t n0) {
  const int64_t ncols = std::min<int64_t>(p.N - n0, kTileCols);
  __mmask16 lm[4];
  for (int q = 0; q < 4; ++q) {
    const int64_t left = ncols - 16 * q;
    lm[q] = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
  }
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int q = 0; q < 4; ++q) acc[m][q] = _mm512_setzero_ps();
  const uint8_t* b = bits_s + n0;
  for (int64_t r = 0; r < p.R; ++r, b += p.N) {
    if (r + kPrefetchRows < p.R)
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchRows * p.N), _MM_HINT_T0);
    __m512i lo[4], hi[4];
    for (int q = 0; q < 4; ++q) {
      lo[q] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lm[q], b + 16 * q));
      hi[q] = _mm512_srli_epi32(lo[q], 4);
    }
    for (int m = 0; m < MB; ++m) {
      const float* t = tab + (int64_t(m) * p.R + r) * 32;
      const __m512 tlo = _mm512_loadu_ps(t), thi = _mm512_loadu_ps(t + 16);
      for (int q = 0; q < 4; ++q)
        acc[m][q] = _mm512_add_ps(
          acc[m][q], _mm512_add_ps(_mm512_permutexvar_ps(lo[q], tlo),
                                   _mm512_permutexvar_ps(hi[q], thi)));
    }
  }
  for (int q = 0; q < 4; ++q) {
    if (!lm[q]) break;
    const int64_t c = n0 + 16 * q;
    const __m512 alpha = p.C == 1 ? _mm512_set1_ps(scale_s[0])
                                  : _mm512_maskz_loadu_ps(lm[q], scale_s + c);
    for (int m = 0; m < MB; ++m) {
      const int64_t o = int64_t(rows[m]) * p.N + c;
      const __m512 d = _mm512_sub_ps(_mm512_add_ps(acc[m][q], acc[m][q]),
                                     _mm512_set1_ps(rowsum[m]));
      const __m512 y = _mm512_fmadd_ps(alpha, d, _mm512_maskz_loadu_ps(lm[q], p.base + o));
      _mm512_mask_storeu_ps(p.out + o, lm[q], y);
    }
  }
}
#endif

#ifdef BD_AVX2
// 16-entry table lookup for 8 lanes: t0 = entries 0..7, t1 = entries 8..15; ``sel`` carries
// index bit 3 in each lane's sign bit.
static inline __m256 Lookup16(__m256i idx, __m256i sel, __m256 t0, __m256 t1) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, idx), _mm256_permutevar8x32_ps(t1, idx),
                          _mm256_castsi256_ps(sel));
}

// Columns [n0, n0 + 16) (2 ymm accumulators per row).
template <int MB>
void Tile2(const Problem& p, const uint8_t* bits_s, const float* scale_s, const int32_t* rows,
           const float* tab, const float* rowsum, int64_t n0) {
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const uint8_t* b = bits_s + n0;
  for (int64_t r = 0; r < p.R; ++r, b += p.N) {
    if (r + kPrefetchRows < p.R)
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchRows * p.N), _MM_HINT_T0);
    __m256i lo[2], hi[2], slo[2], shi[2];
    for (int q = 0; q < 2; ++q) {
      lo[q] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * q)));
      hi[q] = _mm256_srli_epi32(lo[q], 4);
      slo[q] = _mm256_slli_epi32(lo[q], 28);  // bit 3 -> sign
      shi[q] = _mm256_slli_epi32(lo[q], 24);  // bit 7 -> sign
    }
    for (int m = 0; m < MB; ++m) {
      const float* t = tab + (int64_t(m) * p.R + r) * 32;
      const __m256 l0 = _mm256_loadu_ps(t), l1 = _mm256_loadu_ps(t + 8);
      const __m256 h0 = _mm256_loadu_ps(t + 16), h1 = _mm256_loadu_ps(t + 24);
      for (int q = 0; q < 2; ++q)
        acc[m][q] = _mm256_add_ps(acc[m][q], _mm256_add_ps(Lookup16(lo[q], slo[q], l0, l1),
                                                           Lookup16(hi[q], shi[q], h0, h1)));
    }
  }
  for (int q = 0; q < 2; ++q) {
    const int64_t c = n0 + 8 * q;
    const __m256 alpha = p.C == 1 ? _mm256_set1_ps(scale_s[0]) : _mm256_loadu_ps(scale_s + c);
    for (int m = 0; m < MB; ++m) {
      const int64_t o = int64_t(rows[m]) * p.N + c;
      const __m256 d = _mm256_sub_ps(_mm256_add_ps(acc[m][q], acc[m][q]),
                                     _mm256_set1_ps(rowsum[m]));
      _mm256_storeu_ps(p.out + o, _mm256_fmadd_ps(alpha, d, _mm256_loadu_ps(p.base + o)));
    }
  }
}
#endif

// Portable tile: two scalar table lookups per byte, over columns [n0, n0 + ncols).
void TileGeneric(const Problem& p, const uint8_t* bits_s, const float* scale_s,
                 const int32_t* rows, int nrows, const float* tab, const float* rowsum,
                 int64_t n0, int64_t ncols) {
  float acc[kMaxRows][kTileCols] = {};
  for (int64_t r = 0; r < p.R; ++r) {
    const uint8_t* b = bits_s + r * p.N + n0;
    for (int m = 0; m < nrows; ++m) {
      const float* t = tab + (int64_t(m) * p.R + r) * 32;
      for (int64_t c = 0; c < ncols; ++c) acc[m][c] += t[b[c] & 15] + t[16 + (b[c] >> 4)];
    }
  }
  for (int m = 0; m < nrows; ++m)
    for (int64_t c = 0; c < ncols; ++c) {
      const int64_t n = n0 + c, o = int64_t(rows[m]) * p.N + n;
      const float alpha = p.C == 1 ? scale_s[0] : scale_s[n];
      p.out[o] = p.base[o] + alpha * (2.0f * acc[m][c] - rowsum[m]);
    }
}

void LutTile(const Problem& p, const uint8_t* bits_s, const float* scale_s, const int32_t* rows,
             int nrows, const float* tab, const float* rowsum, int64_t n0) {
#ifdef BD_AVX512
  switch (nrows) {
    case 1: return Tile<1>(p, bits_s, scale_s, rows, tab, rowsum, n0);
    case 2: return Tile<2>(p, bits_s, scale_s, rows, tab, rowsum, n0);
    case 3: return Tile<3>(p, bits_s, scale_s, rows, tab, rowsum, n0);
    default: return Tile<4>(p, bits_s, scale_s, rows, tab, rowsum, n0);
  }
#elif defined(BD_AVX2)
  const int64_t ncols = std::min<int64_t>(p.N - n0, kTileCols);
  const int64_t full = ncols / 16 * 16;  // 16-column chunks; the rest (N % 16) portably
  for (int64_t c = 0; c < full; c += 16) {
    switch (nrows) {
      case 1: Tile2<1>(p, bits_s, scale_s, rows, tab, rowsum, n0 + c); break;
      case 2: Tile2<2>(p, bits_s, scale_s, rows, tab, rowsum, n0 + c); break;
      case 3: Tile2<3>(p, bits_s, scale_s, rows, tab, rowsum, n0 + c); break;
      default: Tile2<4>(p, bits_s, scale_s, rows, tab, rowsum, n0 + c); break;
    }
  }
  if (full < ncols)
    TileGeneric(p, bits_s, scale_s, rows, nrows, tab, rowsum, n0 + full, ncols - full);
#else
  TileGeneric(p, bits_s, scale_s, rows, nrows, tab, rowsum, n0,
              std::min<int64_t>(p.N - n0, kTileCols));
#endif
}

// Rows [rows, rows + nrows) of slot s over columns [c0, c1) (multiples of kTileCols but c1).
void RunLut(const Problem& p, int64_t s, const int32_t* rows, int64_t nrows, int64_t c0,
            int64_t c1) {
  thread_local std::vector<float> tab;
  tab.resize(size_t(kMaxRows) * p.R * 32);
  float rowsum[kMaxRows];
  const uint8_t* bits_s = p.bits + s * p.R * p.N;
  const float* scale_s = p.scale + s * p.C;
  for (int64_t r0 = 0; r0 < nrows; r0 += kMaxRows) {
    const int nb = int(std::min<int64_t>(kMaxRows, nrows - r0));
    BuildTables(p, rows + r0, nb, tab.data(), rowsum);
    for (int64_t n0 = c0; n0 < c1; n0 += kTileCols)
      LutTile(p, bits_s, scale_s, rows + r0, nb, tab.data(), rowsum, n0);
  }
}

// --- expand-then-FMA strategy -------------------------------------------------------------------

// panel[k * kPanel + c] = S[k, n0 + c] (+-1.0) for k < K, c < ncols (columns past N: unused);
// with `merged`, W_base[k, n0 + c] + alpha[n0 + c] * S[k, n0 + c] instead.
void ExpandPanel(const Problem& p, const uint8_t* bits_s, const float* scale_s, bool merged,
                 int64_t n0, int64_t ncols, float* panel) {
  const int64_t P = p.G / 8;
  for (int64_t r = 0; r < p.R; ++r) {
    const uint8_t* b = bits_s + r * p.N + n0;
    const int64_t k0 = (r / P) * p.G + r % P;
#ifdef BD_AVX512
    for (int64_t c = 0; c < ncols; c += 16) {
      const int64_t left = ncols - c;
      const __mmask16 lm = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lm, b + c));
      const __m512 plus = !merged ? _mm512_set1_ps(1.0f)
                          : p.C == 1 ? _mm512_set1_ps(scale_s[0])
                                     : _mm512_maskz_loadu_ps(lm, scale_s + n0 + c);
      const __m512 minus = _mm512_sub_ps(_mm512_setzero_ps(), plus);
      for (int j = 0; j < 8; ++j) {
        const int64_t k = k0 + j * P;
        if (k >= p.K) break;
        const __mmask16 set = _mm512_test_epi32_mask(v, _mm512_set1_epi32(1 << j));
        __m512 e = _mm512_mask_blend_ps(set, minus, plus);
        if (merged) e = _mm512_add_ps(_mm512_maskz_loadu_ps(lm, p.w + k * p.N + n0 + c), e);
        _mm512_storeu_ps(panel + k * kPanel + c, e);
      }
    }
#else
    for (int j = 0; j < 8; ++j) {
      const int64_t k = k0 + j * P;
      if (k >= p.K) break;
      float* dst = panel + k * kPanel;
      for (int64_t c = 0; c < ncols; ++c) {
        const float a = !merged ? 1.0f : p.C == 1 ? scale_s[0] : scale_s[n0 + c];
        dst[c] = ((b[c] >> j) & 1 ? a : -a) + (merged ? p.w[k * p.N + n0 + c] : 0.0f);
      }
    }
#endif
  }
}

#ifdef BD_AVX512
// acc[m][q] = x[rows[m]] . w[:, 16q : 16q + 16] (rows of w `ld` floats apart, 64 readable);
// MR x 4 zmm accumulators. Epilogue: out = base + alpha * acc, or out = acc if scale_s is null.
template <int MR>
void FmaBlock(const Problem& p, const float* w, int64_t ld, const float* scale_s,
              const int32_t* rows, int64_t n0, int64_t ncols) {
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = p.x + int64_t(rows[m]) * p.K;
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < 4; ++q) acc[m][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.K; ++k, w += ld) {
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    const __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(xr[m][k]);
      acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xb, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xb, w3, acc[m][3]);
    }
  }
  for (int q = 0; q < 4; ++q) {
    const int64_t left = ncols - 16 * q;
    if (left <= 0) break;
    const __mmask16 lm = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const int64_t c = n0 + 16 * q;
    if (!scale_s) {
      for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(p.out + rows[m] * p.N + c, lm, acc[m][q]);
      continue;
    }
    const __m512 alpha = p.C == 1 ? _mm512_set1_ps(scale_s[0])
                                  : _mm512_maskz_loadu_ps(lm, scale_s + c);
    for (int m = 0; m < MR; ++m) {
      const int64_t o = int64_t(rows[m]) * p.N + c;
      const __m512 y = _mm512_fmadd_ps(alpha, acc[m][q], _mm512_maskz_loadu_ps(lm, p.base + o));
      _mm512_mask_storeu_ps(p.out + o, lm, y);
    }
  }
}
#endif

// Portable (and AVX2: the compiler vectorises the column loop) block of up to kMr rows.
void FmaBlockGeneric(const Problem& p, const float* panel, int64_t ld, const float* scale_s,
                     const int32_t* rows, int nrows, int64_t n0, int64_t ncols) {
  for (int m = 0; m < nrows; ++m) {
    const float* x = p.x + int64_t(rows[m]) * p.K;
    float acc[kPanel] = {};
    for (int64_t k = 0; k < p.K; ++k) {
      const float xk = x[k];
      const float* w = panel + k * ld;
      for (int c = 0; c < kPanel; ++c) acc[c] += xk * w[c];
    }
    for (int64_t c = 0; c < ncols; ++c) {
      const int64_t n = n0 + c, o = int64_t(rows[m]) * p.N + n;
      if (!scale_s) {
        p.out[o] = acc[c];
      } else {
        const float alpha = p.C == 1 ? scale_s[0] : scale_s[n];
        p.out[o] = p.base[o] + alpha * acc[c];
      }
    }
  }
}

// Rows [rows, rows + nrows) over a panel, kMr rows at a time.
void FmaRows(const Problem& p, const float* w, int64_t ld, const float* scale_s,
             const int32_t* rows, int64_t nrows, int64_t n0, int64_t ncols) {
  for (int64_t r0 = 0; r0 < nrows; r0 += kMr) {
    const int nb = int(std::min<int64_t>(kMr, nrows - r0));
    const int32_t* rr = rows + r0;
#ifdef BD_AVX512
    switch (nb) {
      case 1: FmaBlock<1>(p, w, ld, scale_s, rr, n0, ncols); break;
      case 2: FmaBlock<2>(p, w, ld, scale_s, rr, n0, ncols); break;
      case 3: FmaBlock<3>(p, w, ld, scale_s, rr, n0, ncols); break;
      case 4: FmaBlock<4>(p, w, ld, scale_s, rr, n0, ncols); break;
      case 5: FmaBlock<5>(p, w, ld, scale_s, rr, n0, ncols); break;
      default: FmaBlock<6>(p, w, ld, scale_s, rr, n0, ncols); break;
    }
#else
    FmaBlockGeneric(p, w, ld, scale_s, rr, nb, n0, ncols);
#endif
  }
}

// Rows [rows, rows + nrows) of slot s over columns [c0, c1) (multiples of kPanel but c1).
void RunExpand(const Problem& p, int64_t s, const int32_t* rows, int64_t nrows, int64_t c0,
               int64_t c1) {
  static_assert(kMr <= 6, "FmaBlock instances go up to 6 rows");
  thread_local std::vector<float> panel;
  panel.resize(size_t(p.K) * kPanel);
  const uint8_t* bits_s = p.bits + s * p.R * p.N;
  const float* scale_s = p.scale + s * p.C;
  for (int64_t n0 = c0; n0 < c1; n0 += kPanel) {
    const int64_t ncols = std::min<int64_t>(c1 - n0, kPanel);
    ExpandPanel(p, bits_s, scale_s, false, n0, ncols, panel.data());
    FmaRows(p, panel.data(), kPanel, scale_s, rows, nrows, n0, ncols);
  }
}

// --- work split ---------------------------------------------------------------------------------

// One slot's rows (a contiguous part of the sorted row list) over a column range.
struct Task {
  int64_t slot;
  const int32_t* rows;
  int64_t nrows, c0, c1;
  bool expand;
};

// Vector operations (about cycles) of `nrows` rows of one slot over all N columns.
int64_t Work(const Problem& p, int64_t nrows, bool expand) {
  const int64_t chunks = (p.N + 15) / 16;
  if (expand) return p.K * chunks * (nrows + 1);  // FMAs, plus writing the panel once
  return nrows * p.R * (4 * chunks + 20);        // lookups and adds, plus the tables
}

// Splits one slot into about `parts` tasks: rows (whole blocks) when there are enough of them,
// else column ranges (whole tiles / panels).
void Split(const Problem& p, int64_t s, const int32_t* rows, int64_t nrows, bool expand,
           int parts, std::vector<Task>& tasks) {
  const int64_t block = expand ? kMr : kMaxRows, width = expand ? kPanel : kTileCols;
  const int64_t blocks = (nrows + block - 1) / block, tiles = (p.N + width - 1) / width;
  if (parts <= 1) {
    tasks.push_back({s, rows, nrows, 0, p.N, expand});
  } else if (blocks >= (expand ? 2 * parts : parts)) {
    for (int i = 0; i < parts; ++i) {  // disjoint rows: no table is built twice
      const int64_t b0 = blocks * i / parts, b1 = blocks * (i + 1) / parts;
      const int64_t r0 = b0 * block, r1 = std::min(nrows, b1 * block);
      if (r1 > r0) tasks.push_back({s, rows + r0, r1 - r0, 0, p.N, expand});
    }
  } else {
    const int64_t n = std::min<int64_t>(parts, tiles);
    for (int64_t i = 0; i < n; ++i)
      tasks.push_back({s, rows, nrows, tiles * i / n * width,
                       std::min(p.N, tiles * (i + 1) / n * width), expand});
  }
}

ffi::Error DeltaMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> bits,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> slots,
                           ffi::Buffer<ffi::F32> base, ffi::ResultBuffer<ffi::F32> out,
                           int64_t group_k, int64_t expand_rows) {
  auto xd = x.dimensions();
  auto bd = bits.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || bd.size() != 3 || sd.size() != 2)
    return ffi::Error::InvalidArgument("delta_matmul: expected x[M,K], bits[S,R,N], scale[S,C]");
  Problem p{};
  p.M = xd[0]; p.K = xd[1]; p.S = bd[0]; p.R = bd[1]; p.N = bd[2]; p.C = sd[1]; p.G = group_k;
  if (group_k <= 0 || group_k % 8 || (p.R * 8) % group_k || p.R * 8 < p.K || sd[0] != p.S ||
      (p.C != 1 && p.C != p.N) || int64_t(slots.element_count()) != p.M ||
      int64_t(base.element_count()) != p.M * p.N)
    return ffi::Error::InvalidArgument("delta_matmul: inconsistent shapes");
  p.x = x.typed_data(); p.bits = bits.typed_data(); p.scale = scale.typed_data();
  p.base = base.typed_data(); p.out = out->typed_data();
  const int32_t* slot = slots.typed_data();
  if (expand_rows <= 0) expand_rows = kExpandRowsDefault;

  // Counting sort of the rows by slot: rows of slot s are order[start[s] .. start[s + 1]).
  std::vector<int32_t> start(p.S + 1, 0), order(p.M);
  for (int64_t m = 0; m < p.M; ++m) {
    if (slot[m] >= 0 && slot[m] < p.S) {
      ++start[slot[m] + 1];
    } else if (p.out != p.base) {
      std::memcpy(p.out + m * p.N, p.base + m * p.N, sizeof(float) * p.N);  // base only
    }
  }
  for (int64_t s = 0; s < p.S; ++s) start[s + 1] += start[s];
  {
    std::vector<int32_t> fill(start.begin(), start.end() - 1);
    for (int64_t m = 0; m < p.M; ++m)
      if (slot[m] >= 0 && slot[m] < p.S) order[fill[slot[m]]++] = int32_t(m);
  }

  int64_t work = 0;
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t nr = start[s + 1] - start[s];
    if (nr) work += Work(p, nr, nr >= expand_rows);
  }
  Pool& pool = Pool::get();
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(pool.size(),
                                                                   work / kMinWorkPerThread)));
  std::vector<Task> tasks;
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t nr = start[s + 1] - start[s];
    if (!nr) continue;
    const bool expand = nr >= expand_rows;
    // a slot's share of the threads, by its share of the work
    const int parts = threads == 1 ? 1 : int(std::max<int64_t>(
      1, (threads * Work(p, nr, expand) + work - 1) / work));
    Split(p, s, order.data() + start[s], nr, expand, parts, tasks);
  }
  auto run = [&](int i) {
    const Task& t = tasks[i];
    (t.expand ? RunExpand : RunLut)(p, t.slot, t.rows, t.nrows, t.c0, t.c1);
  };
  if (threads == 1) {
    for (size_t i = 0; i < tasks.size(); ++i) run(int(i));
  } else {
    pool.run(run, int(tasks.size()));
  }
  return ffi::Error::Success();
}

// --- merged: y = x . W_base + alpha * (x . S) in one pass (many f32 rows) ---------------------
//
// For many rows the delta term costs as many FMAs as the base GEMM (LUT: half as many cycles at
// best), so adding it to XLA's GEMM cannot be cheap. Instead this entry point does the base GEMM
// too: per 64-column panel, rows of a slot with >= expand_rows rows run over W_base + alpha * S
// (expanded once per panel), the other rows over W_base itself, and those of small slots then
// add their delta from the LUT. The delta then costs the panel expansions (and LUT rows) only.

struct MergedPlan {
  std::vector<int32_t> plain;  // base-only rows: x . W_base
  std::vector<std::pair<int64_t, std::vector<int32_t>>> merged, lut;  // (slot, rows)
};

// Part `part` of `parts` of every row list, over columns [c0, c1) (c0 a multiple of kPanel).
void RunMerged(const Problem& p, const MergedPlan& plan, int part, int parts, int64_t c0,
               int64_t c1) {
  thread_local std::vector<float> panel, wpad;
  panel.resize(size_t(p.K) * kPanel);
  auto slice = [&](const std::vector<int32_t>& v, int64_t* n) {
    const int64_t b = int64_t(v.size()) * part / parts, e = int64_t(v.size()) * (part + 1) / parts;
    *n = e - b;
    return v.data() + b;
  };
  int64_t n;
  for (int64_t n0 = c0; n0 < c1; n0 += kPanel) {
    const int64_t ncols = std::min<int64_t>(c1 - n0, kPanel);
    const float* w = p.w + n0;
    int64_t ld = p.N;
    if (ncols < kPanel) {  // the micro-kernel reads 64 columns: a zero-padded copy
      wpad.resize(size_t(p.K) * kPanel);
      for (int64_t k = 0; k < p.K; ++k) {
        std::memcpy(wpad.data() + k * kPanel, p.w + k * p.N + n0, sizeof(float) * ncols);
        std::memset(wpad.data() + k * kPanel + ncols, 0, sizeof(float) * (kPanel - ncols));
      }
      w = wpad.data(), ld = kPanel;
    }
    const int32_t* rows = slice(plan.plain, &n);
    if (n) FmaRows(p, w, ld, nullptr, rows, n, n0, ncols);
    for (const auto& [s, all] : plan.lut) {  // their delta is added below
      rows = slice(all, &n);
      if (n) FmaRows(p, w, ld, nullptr, rows, n, n0, ncols);
    }
    for (const auto& [s, all] : plan.merged) {
      rows = slice(all, &n);
      if (!n) continue;
      ExpandPanel(p, p.bits + s * p.R * p.N, p.scale + s * p.C, true, n0, ncols, panel.data());
      FmaRows(p, panel.data(), kPanel, nullptr, rows, n, n0, ncols);
    }
  }
  for (const auto& [s, all] : plan.lut) {  // p.base == p.out: adds to x . W_base written above
    const int32_t* rows = slice(all, &n);
    if (n) RunLut(p, s, rows, n, c0, c1);
  }
}

ffi::Error MergedImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::U8> bits,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> slots,
                      ffi::ResultBuffer<ffi::F32> out, int64_t group_k, int64_t expand_rows) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto bd = bits.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || bd.size() != 3 || sd.size() != 2)
    return ffi::Error::InvalidArgument("delta_matmul: expected x[M,K], w[K,N], bits[S,R,N], "
                                       "scale[S,C]");
  Problem p{};
  p.M = xd[0]; p.K = xd[1]; p.S = bd[0]; p.R = bd[1]; p.N = bd[2]; p.C = sd[1]; p.G = group_k;
  if (group_k <= 0 || group_k % 8 || (p.R * 8) % group_k || p.R * 8 < p.K || sd[0] != p.S ||
      (p.C != 1 && p.C != p.N) || int64_t(slots.element_count()) != p.M || wd[0] != p.K ||
      wd[1] != p.N)
    return ffi::Error::InvalidArgument("delta_matmul: inconsistent shapes");
  p.x = x.typed_data(); p.w = w.typed_data(); p.bits = bits.typed_data();
  p.scale = scale.typed_data(); p.out = out->typed_data(); p.base = p.out;
  const int32_t* slot = slots.typed_data();
  if (expand_rows <= 0) expand_rows = kMergeRowsDefault;

  std::vector<std::vector<int32_t>> by_slot(p.S);
  MergedPlan plan;
  for (int64_t m = 0; m < p.M; ++m)
    (slot[m] >= 0 && slot[m] < p.S ? by_slot[slot[m]] : plan.plain).push_back(int32_t(m));
  for (int64_t s = 0; s < p.S; ++s) {
    auto& rows = by_slot[s];
    if (rows.empty()) continue;
    (int64_t(rows.size()) >= expand_rows ? plan.merged : plan.lut).emplace_back(s, std::move(rows));
  }

  Pool& pool = Pool::get();
  const int64_t panels = (p.N + kPanel - 1) / kPanel;
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(
    pool.size(), p.M * p.K * ((p.N + 15) / 16) / kMinWorkPerThread)));
  const int64_t chunks = std::min<int64_t>(panels, 4 * threads);
  const int parts = threads == 1 || panels >= 2 * threads ? 1 : int((2 * threads + panels - 1) / panels);
  pool.run([&](int i) {
    const int64_t c = i / parts;
    RunMerged(p, plan, i % parts, parts, panels * c / chunks * kPanel,
              std::min(p.N, panels * (c + 1) / chunks * kPanel));
  }, int(chunks * parts));
  return ffi::Error::Success();
}

}  // namespace

// Which tile this build runs: 512 (AVX-512), 2 (AVX2), 0 (portable loop).
extern "C" int BitdeltaDeltaMatmulIsa() {
#if defined(BD_AVX512)
  return 512;
#elif defined(BD_AVX2)
  return 2;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaDeltaMatmul, DeltaMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // bits [S, R, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [S, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [M]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // base [M, N] = x . W_base
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, N]
                                  .Attr<int64_t>("group_k")
                                  .Attr<int64_t>("expand_rows"));  // <= 0: kernel default

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaDeltaMatmulMerged, MergedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_base [K, N]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // bits [S, R, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [S, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [M]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, N]
                                  .Attr<int64_t>("group_k")
                                  .Attr<int64_t>("expand_rows"));  // <= 0: kMergeRowsDefault
