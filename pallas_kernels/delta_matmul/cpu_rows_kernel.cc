// The whole 1-bit delta product for a few rows (decode steps) on the CPU, in one pass over W:
//   y[m] = x[m] · W + α_s ⊙ (x[m] · S_s),   s = slots[m]; s <= 0: the base only.
// Bank row s - first_slot holds slot s (first_slot 1: one variant's bits [1, KP, N], no zero row 0).
// W is f32 or bf16 [K, N]; S_s the slot's signs in the group-local bit-plane layout
// (`pallas_kernels/bits.py`: byte bits[s, g*P + p, n] holds in bit j the sign of row
// g*G + j*P + p, P = G / 8); α_s one f32 per column; x, y f32.
//
// Why: a decode step reads every weight once for a handful of rows, so it is bound by memory
// reads. Two things kept the earlier path (XLA's dot, then a separate delta kernel under a
// `lax.cond`) well under the bandwidth at 1-16 rows: XLA's dot falls to ~40% of it from 2 rows,
// and the delta kernel's fixed costs (tables, a second call, the cond) cost 10x its bytes.
// Here the K rows are split across the pool's threads, so each thread streams one contiguous
// block of W front to back (the hardware prefetchers' best case), KB rows of K at a time across
// all N columns. For each group of rows — the base rows, then each slot with more than
// kLutMaxRows rows — the KB x 16 tile of W is turned in registers into W + α_s ⊙ S_s (one blend
// per 16 weights, selected by the slot's bits) and multiplied into the group's rows. A slot with
// fewer rows runs them with the base rows and adds 2·x·B − Σx by nibble-table lookups over its
// bits after the chunk's W pass (`LutDelta`). Either way a slot present costs its bit plane's
// bytes (1/32 of f32 W) and a few vector operations per 16 weights, never a second pass over W.
// Each thread sums into its own [M, N] partials (L1/L2-resident for the shapes of a decode
// step); the caller adds them up.
//
// Numerics: W + α⊙S is rounded once to f32 per element (as the merged prefill kernel's expanded
// panels), products and sums in f32 in another order than the reference (agrees to rounding).
// bf16 W is widened exactly (a 16-bit shift). Vectors are GCC vector extensions: AVX-512 with
// -march=native on such a CPU, AVX2/SSE halves elsewhere. With AVX2 + FMA but no AVX-512 (GCC
// scalarizes the generic blend's byte widening there) a slot of up to 4 rows takes lookups into
// 8-entry `vpermps` tables (as `quant_matmul/cpu_rows_kernel.cc`), a larger one an intrinsics
// blend. A non-finite α reaches only its own slot's rows.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// pallas_kernels/native, on the include path (pallas_kernels/native/build.py)
#include "lut_delta.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using bitdelta_native::Pool;
namespace lut = bitdelta_native::lut;

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));
typedef uint8_t b16v __attribute__((vector_size(16)));

// Rows of K per step: KBFor<T> (a tile's partial sums stay in registers over them), then steps
// of kKBTail for the rest of a chunk, then single rows; kKBMax bounds them. Measured in C++ on
// the model's 210 matrices (AVX-512, 2 threads), against 4 rows per step: 16 rows of f32 x
// ~10% faster with 8 or 16 per step, 8 and 16 rows of bf16 10-20% faster with 16; at 8 rows
// of f32 x, 8 per step was ~4% faster than 16.
#if defined(__AVX512F__)
template <typename T> constexpr int KBFor = sizeof(T) == 4 ? 8 : 16;
#else
template <typename T> constexpr int KBFor = 4;  // portable: vectors of 16 are register pairs/quads
#endif
constexpr int kKBTail = 4;
constexpr int kKBMax = 16;

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }
inline v16 load16(const uint16_t* p) {
  h16v h;
  std::memcpy(&h, p, 32);
  u16v u = __builtin_convertvector(h, u16v) << 16;
  v16 f;
  std::memcpy(&f, &u, 64);
  return f;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, 64); }
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// the sign bit of row k in a column's packed byte: (byte row, bit) in the group-local layout
inline void bit_of(int64_t k, int64_t G, int64_t* byte_row, int* bit) {
  const int64_t P = G / 8, g = k / G, r = k % G;
  *byte_row = g * P + r % P;
  *bit = int(r / P);
}

// A group of rows sharing a slot (slot 0: the base rows).
struct Group {
  int64_t slot;
  std::vector<int64_t> rows;
};

struct Args {
  const float* x;       // [M, K]
  const uint8_t* bits;  // [S, KP, N]
  const float* scale;   // [S, N]
  int64_t M, K, N, KP, G;
  int64_t first;  // the slot held by bank row 0 (slot s > 0 reads row s - first)
  const std::vector<Group>* groups;  // the W pass: base rows, then slots blended into W
  const std::vector<Group>* lut;     // slots with few rows: their rows are in the base group,
                                     // their delta added by `LutDelta`
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load16v(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16v(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// acc[rows, n:n+16C] += x[rows, k:k+KB] · (W + α⊙S)[k:k+KB, n:n+16C] for R rows of one group
// (kDelta false: W itself). The R x C partial sums stay in registers over the KB rows of K, so
// the FMAs form R·C independent chains (one chain per row was bound by the FMA latency, not
// its throughput); with kDelta each W vector becomes W ± α by a blend selected straight from
// the slot's packed bytes (`vptestmb`). wr[j], ar[i], br[j], al: row j of W, row i's partial
// sums, row j's packed bytes and α, each at column 0 of the block; pf[j]: the next step's
// rows to prefetch (kPrefetch).
template <int KB, int R, int C, bool kDelta, bool kPrefetch, typename T>
inline void Tile(const T* const* wr, float* const* ar, const float* xs,
                 const uint8_t* const* br, const float* al, const __m128i* bm,
                 const T* const* pf, int64_t n) {
  __m512 s[R][C];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[i][c] = _mm512_loadu_ps(ar[i] + n + 16 * c);
#pragma GCC unroll 8
  for (int j = 0; j < KB; ++j) {
    __m512 we[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) we[c] = load16v(wr[j] + n + 16 * c);
    if constexpr (kPrefetch)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        if (c * 16 * sizeof(T) % 64 == 0)  // into L2: L1's fill buffers stay for the loads
          _mm_prefetch((const char*)(pf[j] + n + 16 * c), _MM_HINT_T1);
    if constexpr (kDelta)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m512 a = _mm512_loadu_ps(al + n + 16 * c);
        const __m512 na = _mm512_sub_ps(_mm512_setzero_ps(), a);
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(br[j] + n + 16 * c));
        we[c] = _mm512_add_ps(we[c], _mm512_mask_blend_ps(_mm_test_epi8_mask(b, bm[j]), na, a));
      }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 xb = _mm512_set1_ps(xs[i * KB + j]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s[i][c] = _mm512_fmadd_ps(xb, we[c], s[i][c]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(ar[i] + n + 16 * c, s[i][c]);
}

constexpr int kTileC = 4;  // column vectors per tile (4 x 4 partial sums in registers)

template <int KB, int R, bool kDelta, bool kPrefetch, typename T>
void RowsLoop(const T* const* wr, float* const* ar, const float* xs, const uint8_t* const* br,
              const float* al, const __m128i* bm, const T* const* pf, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 16 * kTileC <= n1; n += 16 * kTileC)
    Tile<KB, R, kTileC, kDelta, kPrefetch>(wr, ar, xs, br, al, bm, pf, n);
  for (; n < n1; n += 16) Tile<KB, R, 1, kDelta, kPrefetch>(wr, ar, xs, br, al, bm, pf, n);
}

// acc[rows, n0:n1] (+)= x[rows, k:k+KB] · (W + α⊙S)[k:k+KB, n0:n1] for R rows of one group
// (slot <= 0: W itself); next: the next step's rows of W to prefetch, or null.
template <int KB, int R, typename T>
void Rows16(const Args& a, const T* w, float* acc, int64_t k, int64_t n0, int64_t n1,
            int64_t slot, const int64_t* rows, const uint8_t* const* brow, const uint32_t* bmask,
            const T* next) {
  const int64_t N = a.N;
  float* ar[R];
  alignas(64) float xs[R * KB];
  for (int i = 0; i < R; ++i) {
    ar[i] = acc + rows[i] * N;
    for (int j = 0; j < KB; ++j) xs[i * KB + j] = a.x[rows[i] * a.K + k + j];
  }
  const T* wr[KB];
  const T* pf[KB];
  __m128i bm[KB];
  for (int j = 0; j < KB; ++j) {
    wr[j] = w + (k + j) * N;
    pf[j] = next == nullptr ? nullptr : next + j * N;
    bm[j] = _mm_set1_epi8(char(slot > 0 ? bmask[j] : 0));
  }
  const float* al = slot > 0 ? a.scale + (slot - a.first) * N : nullptr;
  if (slot > 0) {
    if (next) RowsLoop<KB, R, true, true>(wr, ar, xs, brow, al, bm, pf, n0, n1);
    else RowsLoop<KB, R, true, false>(wr, ar, xs, brow, al, bm, pf, n0, n1);
  } else {
    if (next) RowsLoop<KB, R, false, true>(wr, ar, xs, brow, al, bm, pf, n0, n1);
    else RowsLoop<KB, R, false, false>(wr, ar, xs, brow, al, bm, pf, n0, n1);
  }
}

// Columns per block: a block's partial sums for every row (16 rows x 256 x 4 B) and its KB rows
// of W stay in L1 while each group and block of rows passes over them.
constexpr int64_t kColBlock = 256;

// acc[rows, 0:n16] (+)= x[rows, k:k+KB] · (W + α⊙S)[k:k+KB, 0:n16] for every group's rows;
// brow, bmask: per group, kKBMax entries (the byte row and bit of each of the KB rows).
template <int KB, typename T>
void Step16(const Args& a, const T* w, float* acc, int64_t k, int64_t n16,
            const uint8_t* const* brow, const uint32_t* bmask) {
  const int ng = int(a.groups->size());
  for (int64_t n0 = 0; n0 < n16; n0 += kColBlock) {
    const int64_t n1 = std::min(n16, n0 + kColBlock);
    for (int gi = 0; gi < ng; ++gi) {
      const Group& g = (*a.groups)[gi];
      const int64_t* rows = g.rows.data();
      const int64_t nr = int64_t(g.rows.size());
      const uint8_t* const* br = brow + gi * kKBMax;
      const uint32_t* bm = bmask + gi * kKBMax;
      for (int64_t i = 0; i < nr; i += 4) {
        // the first pass over the block prefetches the next step's rows
        const T* next = gi == 0 && i == 0 && k + 2 * KB <= a.K ? w + (k + KB) * a.N : nullptr;
        switch (std::min<int64_t>(4, nr - i)) {
          case 1: Rows16<KB, 1>(a, w, acc, k, n0, n1, g.slot, rows + i, br, bm, next); break;
          case 2: Rows16<KB, 2>(a, w, acc, k, n0, n1, g.slot, rows + i, br, bm, next); break;
          case 3: Rows16<KB, 3>(a, w, acc, k, n0, n1, g.slot, rows + i, br, bm, next); break;
          default: Rows16<KB, 4>(a, w, acc, k, n0, n1, g.slot, rows + i, br, bm, next); break;
        }
      }
    }
  }
}

// A slot with at most this many rows adds its delta by table lookups (`LutDelta`) instead of
// blending W ± α for the W pass (per 8 rows of K and 16 columns: ~3 vector operations per slot
// and ~6 per row, against ~32 per slot for the blend).
#ifndef BITDELTA_LUT_MAX_ROWS
#define BITDELTA_LUT_MAX_ROWS 4
#endif
constexpr int64_t kLutMaxRows = BITDELTA_LUT_MAX_ROWS;

// acc[r] += α_s ⊙ (x[r, k0:k1] · S_s[k0:k1]) for the rows of each slot in `a.lut`; k0, k1 on
// group boundaries. x·S = 2·x·B − Σx (B the 0/1 bits): per packed byte row each row gets two
// 16-entry tables of 2·Σx over the set bits of a nibble (`lut_delta.h`), looked up for 16
// columns at once; byte row after byte row over all N columns, the sums in memory.
void LutDelta(const Args& a, float* acc, int64_t k0, int64_t k1) {
  const int64_t N = a.N, K = a.K, G = a.G, P = G / 8, n16 = N / 16 * 16;
  thread_local std::vector<float> dsum;
  for (const Group& g : *a.lut) {
    const int nr = int(g.rows.size());
    const float* xr[kLutMaxRows];
    for (int i = 0; i < nr; ++i) xr[i] = a.x + g.rows[i] * K;
    dsum.assign(nr * N, 0.f);
    float* d = dsum.data();
    for (int64_t gk = k0; gk < k1; gk += G)
      for (int64_t p = 0; p < P; ++p) {
        const uint8_t* b = a.bits + ((g.slot - a.first) * a.KP + gk / G * P + p) * N;
        __m512 tlo[kLutMaxRows], thi[kLutMaxRows];
        for (int i = 0; i < nr; ++i) lut::NibbleTables(xr[i], gk, P, p, K, &tlo[i], &thi[i]);
        lut::NibbleRows(b, n16, tlo, thi, nr, d, N);
        lut::SetBitsRows(b + n16, N - n16, xr, nr, gk, P, p, K, d + n16, N);
      }
    const float* al = a.scale + (g.slot - a.first) * N;
    for (int i = 0; i < nr; ++i) {
      float total = 0.f;
      for (int64_t k = k0; k < std::min(k1, K); ++k) total += xr[i][k];
      lut::AddScaled(acc + g.rows[i] * N, al, d + i * N, total, N);
    }
  }
}
#else
#if defined(__AVX2__) && defined(__FMA__)
// AVX2: a slot with few rows adds its delta by lookups (`lut_delta.h`), as
// `quant_matmul/cpu_rows_kernel.cc`'s `Delta`: per packed byte row, three 8-entry tables of
// 2·Σx over the set bits of fields 0-2, 3-5 and 6-7, looked up for 8 columns at once (vpermps,
// ~6 operations per row per 8 rows of K and 8 columns); a larger slot blends W ± α in the W
// pass (~4 per row of K and 8 columns, whatever its rows). Measured at 8 and 16 rows of one
// slot the two were within the noise.
#ifndef BITDELTA_LUT_MAX_ROWS_AVX2
#define BITDELTA_LUT_MAX_ROWS_AVX2 4
#endif
constexpr int64_t kLutMaxRows = BITDELTA_LUT_MAX_ROWS_AVX2;

// acc[rows, 0:n8] += α ⊙ (d − Σx) for R rows, d = 2·x·B summed in registers over the chunk's
// nbr packed byte rows (`bits` at its first), 8 columns at a time; tab: per byte row, each row's
// three tables.
template <int R>
void LutCols(const __m256* tab, const uint8_t* bits, int64_t nbr, int64_t N, int64_t n8,
             float* acc, const int64_t* rows, const float* al, const float* total) {
  for (int64_t n = 0; n < n8; n += 8) {
    __m256 s[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nbr; ++b) {
      __m256i i0, i1, i2;
      lut::FieldIndex(bits + b * N + n, &i0, &i1, &i2);
      const __m256* t = tab + b * R * 3;
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
        s[i] = _mm256_add_ps(s[i], lut::FieldLookup(i0, i1, i2, t + 3 * i));
    }
    const __m256 alv = _mm256_loadu_ps(al + n);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      float* p = acc + rows[i] * N + n;
      const __m256 dv = _mm256_sub_ps(s[i], _mm256_set1_ps(total[i]));
      _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(alv, dv)));
    }
  }
}

// acc[r] += α_s ⊙ (x[r, k0:k1] · S_s[k0:k1]) for the rows of each slot in `a.lut`; k0, k1 on
// group boundaries. Rows in passes of kRd (partial sums in registers) over the slot's bits.
void LutDelta(const Args& a, float* acc, int64_t k0, int64_t k1) {
  constexpr int kRd = 8;
  const int64_t N = a.N, K = a.K, G = a.G, P = G / 8, n8 = N / 8 * 8;
  const int64_t nbr = (k1 - k0 + G - 1) / G * P;
  thread_local std::vector<__m256> tab;
  if (int64_t(tab.size()) < nbr * kRd * 3) tab.resize(nbr * kRd * 3);
  __m256 fmask[3];
  lut::FieldMasks(fmask);
  for (const Group& g : *a.lut) {
    const uint8_t* bits = a.bits + ((g.slot - a.first) * a.KP + k0 / G * P) * N;
    const float* al = a.scale + (g.slot - a.first) * N;
    for (size_t r0 = 0; r0 < g.rows.size(); r0 += kRd) {
      const int nr = int(std::min<size_t>(kRd, g.rows.size() - r0));
      const int64_t* rows = g.rows.data() + r0;
      float total[kRd];
      for (int i = 0; i < nr; ++i) {
        total[i] = 0.f;
        for (int64_t k = k0; k < std::min(k1, K); ++k) total[i] += a.x[rows[i] * K + k];
      }
      __m256* t = tab.data();
      for (int64_t b = 0; b < nbr; ++b) {
        const int64_t gk = k0 + b / P * G, p = b % P;
        for (int i = 0; i < nr; ++i)
          lut::FieldTables(a.x + rows[i] * K, gk, P, p, K, fmask, t + (b * nr + i) * 3);
      }
      switch (nr) {
        case 1: LutCols<1>(t, bits, nbr, N, n8, acc, rows, al, total); break;
        case 2: LutCols<2>(t, bits, nbr, N, n8, acc, rows, al, total); break;
        case 3: LutCols<3>(t, bits, nbr, N, n8, acc, rows, al, total); break;
        case 4: LutCols<4>(t, bits, nbr, N, n8, acc, rows, al, total); break;
        case 5: LutCols<5>(t, bits, nbr, N, n8, acc, rows, al, total); break;
        case 6: LutCols<6>(t, bits, nbr, N, n8, acc, rows, al, total); break;
        case 7: LutCols<7>(t, bits, nbr, N, n8, acc, rows, al, total); break;
        default: LutCols<8>(t, bits, nbr, N, n8, acc, rows, al, total); break;
      }
      for (int64_t n = n8; n < N; ++n)  // the columns past the last full vector
        for (int i = 0; i < nr; ++i) {
          float d = 0.f;
          for (int64_t b = 0; b < nbr; ++b)
            d = lut::AddSetBits(d, bits[b * N + n], a.x + rows[i] * K, k0 + b / P * G, P, b % P, K);
          acc[rows[i] * N + n] += al[n] * (d - total[i]);
        }
    }
  }
}
#else
constexpr int64_t kLutMaxRows = 0;  // the portable build blends every slot
void LutDelta(const Args&, float*, int64_t, int64_t) {}
#endif

// portable: the same with GCC vector extensions (AVX2/SSE halves)
template <int KB, typename T>
void Step16(const Args& a, const T* w, float* acc, int64_t k, int64_t n16,
            const uint8_t* const* brow, const uint32_t* bmask) {
  const int64_t N = a.N, K = a.K;
  const int ng = int(a.groups->size());
  for (int64_t n = 0; n < n16; n += 16) {
    v16 wv[KB];
    for (int j = 0; j < KB; ++j) wv[j] = load16(w + (k + j) * N + n);
    for (int gi = 0; gi < ng; ++gi) {
      const Group& g = (*a.groups)[gi];
      v16 we[KB];
      if (g.slot <= 0) {
        for (int j = 0; j < KB; ++j) we[j] = wv[j];
      } else {
        const v16 al = load16(a.scale + (g.slot - a.first) * N + n);
        for (int j = 0; j < KB; ++j) {
#if defined(__AVX2__) && defined(__FMA__)
          // as below, in halves of 8 (GCC scalarizes the uint8 -> uint32 vector conversion)
          const __m128i b =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(brow[gi * kKBMax + j] + n));
          const __m256i bm = _mm256_set1_epi32(int(bmask[gi * kKBMax + j]));
          const __m256i lo = _mm256_cvtepu8_epi32(b);
          const __m256i hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
          __m256 w2[2], a2[2], e2[2];
          std::memcpy(w2, &wv[j], 64);
          std::memcpy(a2, &al, 64);
          const __m256i neg[2] = {
              _mm256_cmpeq_epi32(_mm256_and_si256(lo, bm), _mm256_setzero_si256()),
              _mm256_cmpeq_epi32(_mm256_and_si256(hi, bm), _mm256_setzero_si256())};
          for (int h = 0; h < 2; ++h)
            e2[h] = _mm256_blendv_ps(_mm256_add_ps(w2[h], a2[h]), _mm256_sub_ps(w2[h], a2[h]),
                                     _mm256_castsi256_ps(neg[h]));
          std::memcpy(&we[j], e2, 64);
#else
          b16v b;
          std::memcpy(&b, brow[gi * kKBMax + j] + n, 16);
          const u16v bw = __builtin_convertvector(b, u16v);
          const i16v pos = (bw & bmask[gi * kKBMax + j]) != 0;
          we[j] = pos ? wv[j] + al : wv[j] - al;
#endif
        }
      }
      for (int64_t r : g.rows) {
        const float* xr = a.x + r * K + k;
        float* ar = acc + r * N + n;
        v16 s = load16(ar);
        for (int j = 0; j < KB; ++j) s += xr[j] * we[j];
        store16(ar, s);
      }
    }
  }
}
#endif

// acc[r] (+)= x[r, k0:k1] · (W + α⊙S)[k0:k1, :] for every row r of every group.
template <typename T>
void Chunk(const Args& a, const T* w, float* acc, int64_t k0, int64_t k1) {
  const int64_t N = a.N, K = a.K, n16 = N / 16 * 16;
  std::fill(acc, acc + a.M * N, 0.f);
  // per slot group: the byte row and bit mask of each of a step's rows of K
  const int ng = int(a.groups->size());
  thread_local std::vector<const uint8_t*> brow_v;
  thread_local std::vector<uint32_t> bmask_v;
  brow_v.resize(ng * kKBMax);
  bmask_v.resize(ng * kKBMax);
  const uint8_t** brow = brow_v.data();
  uint32_t* bmask = bmask_v.data();
  auto locate = [&](int64_t k, int kb) {
    for (int gi = 0; gi < ng; ++gi) {
      const Group& g = (*a.groups)[gi];
      if (g.slot <= 0) continue;
      for (int j = 0; j < kb; ++j) {
        int64_t br;
        int bit;
        bit_of(k + j, a.G, &br, &bit);
        brow[gi * kKBMax + j] = a.bits + ((g.slot - a.first) * a.KP + br) * N;
        bmask[gi * kKBMax + j] = 1u << bit;
      }
    }
  };
  // rows [k, k + kb), columns [n0, N), one element at a time
  auto scalar = [&](int64_t k, int kb, int64_t n0) {
    for (int j = 0; j < kb; ++j)
      for (int gi = 0; gi < ng; ++gi) {
        const Group& g = (*a.groups)[gi];
        for (int64_t n = n0; n < N; ++n) {
          float we = load1(w + (k + j) * N + n);
          if (g.slot > 0) {
            const float al = a.scale[(g.slot - a.first) * N + n];
            we = (brow[gi * kKBMax + j][n] & bmask[gi * kKBMax + j]) ? we + al : we - al;
          }
          for (int64_t r : g.rows) acc[r * N + n] += a.x[r * K + k + j] * we;
        }
      }
  };
  int64_t k = k0;
  constexpr int kKB = KBFor<T>;
  for (; k + kKB <= k1; k += kKB) {
    locate(k, kKB);
    Step16<kKB>(a, w, acc, k, n16, brow, bmask);
    scalar(k, kKB, n16);  // the columns past the last full vector
  }
  for (; k + kKBTail <= k1; k += kKBTail) {
    locate(k, kKBTail);
    Step16<kKBTail>(a, w, acc, k, n16, brow, bmask);
    scalar(k, kKBTail, n16);
  }
  if (k < k1) {
    locate(k, int(k1 - k));
    scalar(k, int(k1 - k), 0);
  }
  if (!a.lut->empty()) LutDelta(a, acc, k0, k1);
}

template <typename T>
ffi::Error Run(const float* x, const T* w, const uint8_t* bits, const float* scale,
               const int32_t* slots, float* y, int64_t M, int64_t K, int64_t N, int64_t S,
               int64_t KP, int64_t G, int64_t first) {
  if (M == 0 || N == 0) return ffi::Error::Success();
  std::vector<Group> groups;
  groups.push_back({0, {}});
  for (int64_t m = 0; m < M; ++m) {
    const int64_t s = slots[m];
    if (s > 0 && (s < first || s - first >= S))
      return ffi::Error::InvalidArgument("delta_rows: a slot id is past the bank");
    if (s <= 0) { groups[0].rows.push_back(m); continue; }
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.slot == s; });
    if (it == groups.end()) groups.push_back({s, {m}});
    else it->rows.push_back(m);
  }
  // slots with few rows: rows in the base group's W pass, delta by lookups
  std::vector<Group> lut;
  for (size_t i = 1; i < groups.size();)
    if (int64_t(groups[i].rows.size()) <= kLutMaxRows) {
      groups[0].rows.insert(groups[0].rows.end(), groups[i].rows.begin(), groups[i].rows.end());
      lut.push_back(std::move(groups[i]));
      groups.erase(groups.begin() + i);
    } else {
      ++i;
    }
  if (groups[0].rows.empty()) groups.erase(groups.begin());
  Pool& pool = Pool::get();
  const int64_t work = M * K * N;
  int chunks = work < (int64_t(1) << 16) ? 1 : pool.size();
  // K split into contiguous blocks of whole groups of G rows (G a multiple of 8)
  int64_t per = (K + chunks - 1) / chunks;
  per = (per + G - 1) / G * G;
  chunks = int((K + per - 1) / per);
  thread_local std::vector<float> scratch;  // the partials of chunks 1.. (chunk 0's: y)
  const int64_t part = M * N;
  if (int64_t(scratch.size()) < (chunks - 1) * part) scratch.resize((chunks - 1) * part);
  float* parts = scratch.data();
  const Args a{x, bits, scale, M, K, N, KP, G, first, &groups, &lut};
  pool.run([&](int c) {
    const int64_t k0 = c * per, k1 = std::min(K, k0 + per);
    Chunk<T>(a, w, c == 0 ? y : parts + (c - 1) * part, k0, k1);
  }, chunks);
  for (int c = 1; c < chunks; ++c) {
    const float* p = parts + (c - 1) * part;
    for (int64_t i = 0; i < part; ++i) y[i] += p[i];
  }
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::U8> bits,
                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> slots,
                ffi::ResultBuffer<ffi::F32> y, int64_t group_k, int64_t first_slot) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto bd = bits.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1])
    return ffi::Error::InvalidArgument("delta_rows: expected x[M,K] and W[K,N]");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  if (bd.size() != 3 || bd[2] != N || bd[1] * 8 < K || sd.size() != 2 || sd[0] != bd[0] ||
      sd[1] != N || slots.dimensions().size() != 1 || slots.dimensions()[0] != M)
    return ffi::Error::InvalidArgument(
        "delta_rows: expected bits[S,KP,N], scale[S,N] and slots[M] matching x and W");
  if (first_slot < 0 || first_slot > 1)
    return ffi::Error::InvalidArgument("delta_rows: first_slot must be 0 or 1");
  if (group_k <= 0 || group_k % 8 || bd[1] % (group_k / 8))
    return ffi::Error::InvalidArgument("delta_rows: group_k must be a multiple of 8 dividing 8*KP");
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  if (w.element_type() == ffi::DataType::F32)
    return Run(xp, static_cast<const float*>(w.untyped_data()), bits.typed_data(),
               scale.typed_data(), slots.typed_data(), yp, M, K, N, bd[0], bd[1], group_k,
               first_slot);
  if (w.element_type() == ffi::DataType::BF16)
    return Run(xp, static_cast<const uint16_t*>(w.untyped_data()), bits.typed_data(),
               scale.typed_data(), slots.typed_data(), yp, M, K, N, bd[0], bd[1], group_k,
               first_slot);
  return ffi::Error::InvalidArgument("delta_rows: W must be f32 or bf16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaDeltaRows, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // W [K, N] f32 | bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()   // bits [S, KP, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [S, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [M]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("group_k")
                                  .Attr<int64_t>("first_slot"));
