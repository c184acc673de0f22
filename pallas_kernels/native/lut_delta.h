// The 1-bit delta term by table lookups, shared by the CPU rows kernels
// (`delta_matmul/cpu_rows_kernel.cc` `LutDelta`, `quant_matmul/cpu_rows_kernel.cc` `Delta`,
// `Delta512`):
//   acc[r] += α ⊙ (x[r, k0:k1] · S[k0:k1]),   x·S = 2·x·B − Σx   (B: the 0/1 bits).
// Per packed byte row (gk, p) of the group-local layout (`pallas_kernels/bits.py`: bit j of a
// column's byte holds the sign of row gk + j·P + p, P = G / 8) each row of x gets tables of 2·Σx
// over the subsets of the byte's bits, and one permute looks up many columns' bytes at once:
//   AVX-512F: two 16-entry tables (bits 0-3, 4-7), 16 columns a lookup (`NibbleTables`,
//             `NibbleRows`); AVX2: three 8-entry tables (bits 0-2, 3-5, 6-7), 8 columns
//             (`FieldTables`, `FieldLookup`); columns past the last vector bit by bit
//             (`AddSetBits`).
// What stays with each caller, because the two kernels differ there: the loop order (which rows,
// byte rows and columns nest how; sums in memory or in registers), the K bound (x's K or the
// task's k1), Σx (x's own sum, or the 32-blocks' sums) and the α step (`AddScaled`, or the
// caller's own vector FMA). Each table entry and each column's sum over the byte rows comes out
// the same whichever caller computes it: the byte rows are added in order, from zero.
#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace bitdelta_native::lut {
namespace {  // internal linkage: every library, and every ISA build of one, has its own copy

// d + 2·x[k] for each set bit j of `byte` (k = gk + j·P + p, rows k >= kend skipped), bit after
// bit: the columns past the last full vector.
inline float AddSetBits(float d, uint8_t byte, const float* x, int64_t gk, int64_t P, int64_t p,
                        int64_t kend) {
  for (int j = 0; j < 8; ++j) {
    const int64_t k = gk + j * P + p;
    if (k < kend && (byte >> j) & 1) d += 2.f * x[k];
  }
  return d;
}

// d[i·ds + n] = AddSetBits(d[i·ds + n], b[n], xr[i], ...) for nc columns and nr rows.
inline void SetBitsRows(const uint8_t* b, int64_t nc, const float* const* xr, int nr,
                        int64_t gk, int64_t P, int64_t p, int64_t kend, float* d, int64_t ds) {
  for (int64_t n = 0; n < nc; ++n)
    for (int i = 0; i < nr; ++i)
      d[i * ds + n] = AddSetBits(d[i * ds + n], b[n], xr[i], gk, P, p, kend);
}

// y[n] += α[n] · (d[n] − total) for nc columns (d: 2·x·B, total: Σx).
inline void AddScaled(float* y, const float* al, const float* d, float total, int64_t nc) {
  for (int64_t n = 0; n < nc; ++n) y[n] += al[n] * (d[n] - total);
}

#if defined(__AVX512F__)
// lo, hi: for byte row (gk, p) of one row x, 2·Σx over the subsets of bits 0-3 and 4-7 (lane l:
// the bits set in l); rows k >= kend count 0.
inline void NibbleTables(const float* x, int64_t gk, int64_t P, int64_t p, int64_t kend,
                         __m512* lo, __m512* hi) {
  const __mmask16 lane_bit[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};  // lanes with bit j set
  __m512 t[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int j = 0; j < 8; ++j) {
    const int64_t k = gk + j * P + p;
    const float v = k < kend ? 2.f * x[k] : 0.f;
    t[j >> 2] = _mm512_mask_add_ps(t[j >> 2], lane_bit[j & 3], t[j >> 2], _mm512_set1_ps(v));
  }
  *lo = t[0];
  *hi = t[1];
}

// d[i·ds + n] += the lookups of row i's tables (tlo[i], thi[i]) for the bytes b[n], nc columns
// (a multiple of 16), nr rows; the bytes widened once for all rows (vpermps reads the low 4 bits
// of each index).
inline void NibbleRows(const uint8_t* b, int64_t nc, const __m512* tlo, const __m512* thi,
                       int nr, float* d, int64_t ds) {
  for (int64_t n = 0; n < nc; n += 16) {
    const __m512i il =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + n)));
    const __m512i ih = _mm512_srli_epi32(il, 4);
    for (int i = 0; i < nr; ++i) {
      float* dp = d + i * ds + n;
      _mm512_storeu_ps(dp, _mm512_add_ps(_mm512_loadu_ps(dp),
                                         _mm512_add_ps(_mm512_permutexvar_ps(il, tlo[i]),
                                                       _mm512_permutexvar_ps(ih, thi[i]))));
    }
  }
}
#endif

#if defined(__AVX2__)
// Lane masks of the 8-entry tables: fmask[f] has lane l set where l has bit f.
inline void FieldMasks(__m256 fmask[3]) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int f = 0; f < 3; ++f)
    fmask[f] = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
        _mm256_and_si256(lane, _mm256_set1_epi32(1 << f)), _mm256_set1_epi32(1 << f)));
}

// t[0..2]: for byte row (gk, p) of one row x, 2·Σx over the subsets of bits 0-2, 3-5 and 6-7
// (lane l: the bits set in l); rows k >= kend count 0.
inline void FieldTables(const float* x, int64_t gk, int64_t P, int64_t p, int64_t kend,
                        const __m256* fmask, __m256* t) {
  for (int tb = 0; tb < 3; ++tb) {
    __m256 v = _mm256_setzero_ps();
    for (int f = 0; f < (tb == 2 ? 2 : 3); ++f) {
      const int64_t k = gk + (3 * tb + f) * P + p;
      const float xv = k < kend ? 2.f * x[k] : 0.f;
      v = _mm256_add_ps(v, _mm256_and_ps(fmask[f], _mm256_set1_ps(xv)));
    }
    t[tb] = v;
  }
}

// The lookup indices of 8 columns' bytes: the fields at bits 0, 3 and 6 (vpermps reads the low
// 3 bits of each index).
inline void FieldIndex(const uint8_t* b, __m256i* i0, __m256i* i1, __m256i* i2) {
  *i0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  *i1 = _mm256_srli_epi32(*i0, 3);
  *i2 = _mm256_srli_epi32(*i0, 6);
}

// 2·x·B of one byte row for those 8 columns, from one row's three tables t.
inline __m256 FieldLookup(__m256i i0, __m256i i1, __m256i i2, const __m256* t) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_permutevar8x32_ps(t[0], i0),
                                     _mm256_permutevar8x32_ps(t[1], i1)),
                       _mm256_permutevar8x32_ps(t[2], i2));
}
#endif

}  // namespace
}  // namespace bitdelta_native::lut
