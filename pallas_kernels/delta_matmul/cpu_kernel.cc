// CPU kernel for delta_matmul's delta term, called from XLA through jax.ffi (see cpu.py).
//
//   out[m, n] = base[m, n] + alpha[s, n] * (x[m] . S_s[:, n]),  s = slots[m];
//   rows with s < 0 or s >= S get out = base (base only).
//
// x.S = 2 x.B - rowsum(x) with B in {0, 1} the stored bit planes. A packed byte row r holds
// bits for 8 rows of K (k = g*G + j*P + p, j = bit). Per row of x and byte row r we build two
// 16-entry tables (T-MAC / LUT-GEMM style): T_lo[i] = sum over the set bits j < 4 of i of
// x[k_j], T_hi the same for bits 4..7. Then for 16 columns at once
//   acc += vpermps(bytes, T_lo) + vpermps(bytes >> 4, T_hi)
// (vpermps only reads the low 4 index bits), i.e. 8 rows of K cost 2 permutes and 2 adds per
// 16 columns, and the bits never leave registers. Padded rows (k >= K) have x = 0 in the table.
// With AVX2 (no AVX-512: e.g. AMD Zen 2/3) a 16-entry lookup is two 8-entry vpermps (the low 3
// index bits) and a blend on bit 3, for 8 columns: 8 rows of K cost 4 permutes, 2 blends and 2
// adds per 8 columns. A portable loop (two scalar lookups per byte) runs where neither exists.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BD_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 4;        // rows of x per block (shares each loaded byte row)
constexpr int kTileCols = 64;      // columns per tile (4 zmm accumulators per row)
constexpr int kPrefetchRows = 16;  // byte rows are N bytes apart: prefetch ahead

struct Problem {
  const float* x;        // [M, K]
  const uint8_t* bits;   // [S, R, N], R = K_pad / 8
  const float* scale;    // [S, C]
  const float* base;     // [M, N]
  float* out;            // [M, N] (may alias base)
  int64_t M, K, N, R, G, C, S;
};

// Tables for `nrows` rows: tab[(m * R + r) * 32 + {0..15 lo, 16..31 hi}].
void BuildTables(const Problem& p, const int32_t* rows, int nrows, float* tab, float* rowsum) {
  const int64_t P = p.G / 8;
  for (int m = 0; m < nrows; ++m) {
    const float* x = p.x + int64_t(rows[m]) * p.K;
    float rs = 0.0f;
    for (int64_t r = 0; r < p.R; ++r) {
      const int64_t g = r / P, pp = r % P;
      float xs[8];
      for (int j = 0; j < 8; ++j) {
        const int64_t k = g * p.G + j * P + pp;
        xs[j] = k < p.K ? x[k] : 0.0f;
        rs += xs[j];
      }
      float* t = tab + (int64_t(m) * p.R + r) * 32;
      for (int h = 0; h < 2; ++h) {
        const float* v = xs + 4 * h;
        float* th = t + 16 * h;
        for (int i = 0; i < 16; ++i)
          th[i] = ((i & 1) ? v[0] : 0.0f) + ((i & 2) ? v[1] : 0.0f) + ((i & 4) ? v[2] : 0.0f) +
                  ((i & 8) ? v[3] : 0.0f);
      }
    }
    rowsum[m] = rs;
  }
}

void Epilogue(const Problem& p, const float* scale_s, const int32_t* rows, int nrows,
              const float* rowsum, int64_t n, float acc, int m) {
  const float alpha = p.C == 1 ? scale_s[0] : scale_s[n];
  const int64_t o = int64_t(rows[m]) * p.N + n;
  p.out[o] = p.base[o] + alpha * (2.0f * acc - rowsum[m]);
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
// 16-entry table lookup for 8 lanes: t8[0] = entries 0..7, t8[1] = entries 8..15; ``sel``
// carries index bit 3 in each lane's sign bit.
static inline __m256 Lookup16(__m256i idx, __m256i sel, __m256 t0, __m256 t1) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, idx), _mm256_permutevar8x32_ps(t1, idx),
                          _mm256_castsi256_ps(sel));
}

// Columns [n0, n0 + 16·chunks) of a tile, 16 at a time (2 ymm accumulators per row).
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
    for (int64_t c = 0; c < ncols; ++c) Epilogue(p, scale_s, rows, nrows, rowsum, n0 + c, acc[m][c], m);
}

void RunTile(const Problem& p, int64_t s, const int32_t* rows, int nrows, const float* tab,
             const float* rowsum, int64_t n0) {
  const uint8_t* bits_s = p.bits + s * p.R * p.N;
  const float* scale_s = p.scale + s * p.C;
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

// One worker: all row blocks of all slots, over the column tiles [t0, t1).
void Worker(const Problem& p, const std::vector<std::vector<int32_t>>& rows_by_slot,
            int64_t t0, int64_t t1) {
  std::vector<float> tab(size_t(kMaxRows) * p.R * 32 + 16);
  float rowsum[kMaxRows];
  for (int64_t s = 0; s < p.S; ++s) {
    const auto& rows = rows_by_slot[s];
    for (size_t r0 = 0; r0 < rows.size(); r0 += kMaxRows) {
      const int nrows = int(std::min<size_t>(kMaxRows, rows.size() - r0));
      BuildTables(p, rows.data() + r0, nrows, tab.data(), rowsum);
      for (int64_t t = t0; t < t1; ++t)
        RunTile(p, s, rows.data() + r0, nrows, tab.data(), rowsum, t * kTileCols);
    }
  }
}

int NumThreads(int64_t work, int64_t tiles) {
  int n = int(std::thread::hardware_concurrency());
  if (const char* env = std::getenv("BITDELTA_CPU_THREADS")) n = std::atoi(env);
  if (work < (int64_t(1) << 20)) n = 1;  // thread start-up would dominate
  return int(std::max<int64_t>(1, std::min<int64_t>({int64_t(n), tiles, 64})));
}

ffi::Error DeltaMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> bits,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> slots,
                           ffi::Buffer<ffi::F32> base, ffi::ResultBuffer<ffi::F32> out,
                           int64_t group_k) {
  auto xd = x.dimensions();
  auto bd = bits.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || bd.size() != 3 || sd.size() != 2)
    return ffi::Error::InvalidArgument("delta_matmul: expected x[M,K], bits[S,R,N], scale[S,C]");
  Problem p;
  p.M = xd[0]; p.K = xd[1]; p.S = bd[0]; p.R = bd[1]; p.N = bd[2]; p.C = sd[1]; p.G = group_k;
  if (group_k <= 0 || group_k % 8 || (p.R * 8) % group_k || p.R * 8 < p.K || sd[0] != p.S ||
      (p.C != 1 && p.C != p.N) || int64_t(slots.element_count()) != p.M ||
      int64_t(base.element_count()) != p.M * p.N)
    return ffi::Error::InvalidArgument("delta_matmul: inconsistent shapes");
  p.x = x.typed_data(); p.bits = bits.typed_data(); p.scale = scale.typed_data();
  p.base = base.typed_data(); p.out = out->typed_data();
  const int32_t* slot = slots.typed_data();

  std::vector<std::vector<int32_t>> rows_by_slot(p.S);
  int64_t active = 0;
  for (int64_t m = 0; m < p.M; ++m) {
    if (slot[m] >= 0 && slot[m] < p.S) {
      rows_by_slot[slot[m]].push_back(int32_t(m));
      ++active;
    } else if (p.out != p.base) {
      std::memcpy(p.out + m * p.N, p.base + m * p.N, sizeof(float) * p.N);  // base only
    }
  }
  const int64_t tiles = (p.N + kTileCols - 1) / kTileCols;
  const int nthreads = NumThreads(active * p.K * p.N / 8, tiles);
  std::vector<std::thread> pool;
  for (int i = 1; i < nthreads; ++i)
    pool.emplace_back(Worker, std::cref(p), std::cref(rows_by_slot), tiles * i / nthreads,
                      tiles * (i + 1) / nthreads);
  Worker(p, rows_by_slot, 0, tiles / nthreads);
  for (auto& t : pool) t.join();
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
                                  .Attr<int64_t>("group_k"));
