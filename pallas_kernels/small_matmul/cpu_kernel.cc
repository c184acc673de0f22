// Small-M matmuls for CPU decode steps, f32 or bf16 weights, f32 results:
//   NN: y[M,N] = x[M,K] · W[K,N]   (W a Linear kernel)
//   NT: y[M,N] = x[M,K] · E[N,K]ᵀ  (E a tied embedding used as the LM head)
//
// Why: at a few rows a decode step is bound by reading W, but XLA's CPU dot runs far below
// both the bandwidth and the FLOP rate there (f32 NN at 8 rows costs nearly what 32 rows do;
// the f32 NT LM head of SmolLM2, 113 MB, ran on one thread at ~14 GB/s at one row; XLA's bf16
// NT dot ~12x slower than the f32 one), and a bf16 W is half the bytes. NN reads W as kK
// contiguous row streams, the rows' partial sums in L1/L2. NT reads each E row once per call:
// blocks of E rows stay in cache while every row block of x is multiplied by them, a register
// tile of R rows x C E rows accumulating 16 K-lanes each, reduced across lanes at the end. A
// persistent pool splits the columns (N). FMAs on generic vectors (AVX-512, AVX2 or SSE code);
// a bf16 weight is widened to f32 by a 16-bit shift as it is loaded.
// One body per loop, templated on the weight type; `Weight<T>` holds what differs (loading 16
// weights, the tiles, the loop order, the lane sum), each as it was tuned for that type.
// bf16 only: where the build has AVX-512 BF16 and the CPU reports it at run time, `vdpbf16ps`
// multiplies pairs of adjacent K: for NN, W rows 2p and 2p+1 interleaved on the fly by
// `vpunpck{l,h}wd` (which permutes the columns of a 32-column tile within 128-bit lanes; the
// accumulators go back to column order at the end) times the row's broadcast (x[2p], x[2p+1]);
// for NT, E's rows already hold the pairs.
// Numerics: f32 products and sums, K in another order than XLA's (agrees to rounding). bf16 x
// (the caller rounds it) makes every product exact in f32; vdpbf16ps adds its two products to
// the accumulator in f32 with round-to-nearest-even and flushes denormal inputs and outputs to
// zero, the widening path does not.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "pool.h"  // pallas_kernels/native, on the include path (native/build.py)
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BITDELTA_HAVE_DPBF16 1
#endif

namespace ffi = xla::ffi;

namespace {

using bitdelta_native::Pool;
using bf16 = uint16_t;  // a bf16 as its bits: the high half of an f32

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
constexpr int kRows = 8;  // rows of x per pass over W
constexpr int kK = 8;     // rows of W per NN accumulation step

inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }
inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, 64); }

inline v16 widen16(const bf16* p) {
  u16x16 h;
  __builtin_memcpy(&h, p, 32);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  v16 f;
  __builtin_memcpy(&f, &u, 64);
  return f;
}
inline float widen1(bf16 h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

inline float Hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Columns [0, N) in chunks of `per` (the last shorter), f(n0, n1) on the pool.
template <typename F>
void RunColumns(int64_t N, int64_t per, const F& f) {
  const int chunks = int((N + per - 1) / per);
  Pool::get().run([&](int c) { f(c * per, std::min(N, (c + 1) * per)); }, chunks);
}

// Two chunks per pool thread (one if the product is tiny), a multiple of `align` columns.
int64_t TwoPerThread(int64_t M, int64_t K, int64_t N, int64_t align) {
  const int chunks = M * K * N < (int64_t(1) << 16) ? 1 : Pool::get().size() * 2;
  const int64_t per = (N + chunks - 1) / chunks;
  return (per + align - 1) / align * align;
}

template <typename T>
struct Weight;

template <>
struct Weight<float> {
  static v16 Load16(const float* p) { return load16(p); }
  static float Load1(float w) { return w; }
  static constexpr int64_t kNnAlign = 16;  // NN chunks: a multiple of the 16-column vectors
  static constexpr bool kKOuter = false;   // NN: row blocks outer, each reading W once
  // NT: E rows kept in cache while every row block of x uses them (27 KiB at K = 576)
  static constexpr int64_t kNtCols = 12;
  // E rows per register tile for R rows: R*C accumulators + C E vectors + 1 x vector <= 32
  static constexpr int NtCols(int R) { return R == 1 ? 12 : R <= 4 ? 6 : 3; }
  // Software prefetch (into L2) of the next E block, by the first row block's pass over this
  // one: DRAM reads overlap the FMAs. One thread's CPU time on the SmolLM2 head (49152 x 576),
  // none -> this: 7.4 -> 7.3 ms at 1 row, 14.2 -> 8.9 at 8, 18.8 -> 13.6 at 16 (12 rows ahead
  // into L1: 9.9 / 14.8; 24 or 48 rows ahead: no better).
  static constexpr bool kNtPrefetch = true;
  static float Sum(v16 v) { return Hsum(v); }
  // NT: many small chunks (~256 KiB of E) claimed dynamically: on a shared machine one thread
  // may be descheduled
  static int64_t NtPer(int64_t M, int64_t K, int64_t N) {
    if (M * K * N < (int64_t(1) << 16)) return N;
    const int64_t per = (int64_t(1) << 18) / (4 * std::max<int64_t>(K, 1));
    return std::max<int64_t>(kNtCols, per / kNtCols * kNtCols);
  }
  static bool Dp() { return false; }
};

#ifdef BITDELTA_HAVE_DPBF16
bool CpuHasDpbf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#else
bool CpuHasDpbf16() { return false; }
#endif

template <>
struct Weight<bf16> {
  static v16 Load16(const bf16* p) { return widen16(p); }
  static float Load1(bf16 w) { return widen1(w); }
  static constexpr int64_t kNnAlign = 32;  // the vdpbf16ps path's 32-column tiles
  static constexpr bool kKOuter = true;    // NN: k-blocks outer: W leaves memory once whatever M
  static constexpr int64_t kNtCols = 8;    // E rows kept in L1 while every row block uses them
  // R*C accumulators (<= 16) plus C loaded E rows in registers
  static constexpr int NtCols(int R) { return R <= 2 ? 8 : R <= 4 ? 4 : 2; }
  static constexpr bool kNtPrefetch = false;
  static float Sum(v16 v) {
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += v[j];
    return s;
  }
  static int64_t NtPer(int64_t M, int64_t K, int64_t N) { return TwoPerThread(M, K, N, kNtCols); }
  // vdpbf16ps: AVX-512 BF16 built and reported by the CPU
  static bool Dp() { return CpuHasDpbf16(); }
};

// R = rows: f(std::integral_constant<int, R>) for R = rows (1..8)
template <typename F>
void ForRows(int rows, const F& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// ---- NN: y = x · W -----------------------------------------------------------------------

// y[0:R, n0:n1] += x[0:R] · W[k:k+kK, n0:n1] (fewer rows at K's end), x the rows in f32;
// columns inner: kK long row streams.
template <typename T, int R>
void NnStep(const float* x, const T* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1,
            int64_t k) {
  if (k + kK > K) {
    for (; k < K; ++k)
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * K + k];
        for (int64_t n = n0; n < n1; ++n) y[r * N + n] += xv * Weight<T>::Load1(w[k * N + n]);
      }
    return;
  }
  const int64_t n16 = n0 + (n1 - n0) / 16 * 16;
  float xs[R][kK];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kK; ++j) xs[r][j] = x[r * K + k + j];
  for (int64_t n = n0; n < n16; n += 16) {
    v16 wk[kK];
#pragma GCC unroll 8
    for (int j = 0; j < kK; ++j) wk[j] = Weight<T>::Load16(w + (k + j) * N + n);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      v16 a = load16(y + r * N + n);
#pragma GCC unroll 8
      for (int j = 0; j < kK; ++j) a += xs[r][j] * wk[j];
      store16(y + r * N + n, a);
    }
  }
  for (int64_t n = n16; n < n1; ++n)
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int j = 0; j < kK; ++j) s += xs[r][j] * Weight<T>::Load1(w[(k + j) * N + n]);
      y[r * N + n] += s;
    }
}

// y[0:M, n0:n1] = x · W[:, n0:n1], x the rows in f32
template <typename T>
void NnColumns(const float* x, const T* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  for (int64_t r = 0; r < M; ++r) std::fill(y + r * N + n0, y + r * N + n1, 0.f);
  if constexpr (Weight<T>::kKOuter) {
    for (int64_t k = 0; k < K; k += kK)
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        ForRows(int(std::min<int64_t>(kRows, M - m0)), [&](auto R) {
          NnStep<T, R()>(x + m0 * K, w, y + m0 * N, K, N, n0, n1, k);
        });
  } else {
    for (int64_t m0 = 0; m0 < M; m0 += kRows)
      ForRows(int(std::min<int64_t>(kRows, M - m0)), [&](auto R) {
        for (int64_t k = 0; k < K; k += kK)
          NnStep<T, R()>(x + m0 * K, w, y + m0 * N, K, N, n0, n1, k);
      });
  }
}

// ---- NT: y = x · Eᵀ ----------------------------------------------------------------------

// y[0:R, n:n+C] = x[0:R] · E[n:n+C]ᵀ, x the rows in f32; `pf` (where `Weight<T>::kNtPrefetch`):
// prefetch the C E rows kNtCols ahead (clamped inside E)
template <typename T, int R, int C>
void NtBlock(const float* x, const T* e, float* y, int64_t K, int64_t N, int64_t n, bool pf) {
  constexpr bool kPrefetch = Weight<T>::kNtPrefetch;
  v16 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = v16{};
  const int64_t k16 = K / 16 * 16;
  const T* ahead = e + std::min(n + Weight<T>::kNtCols, N - C) * K;
  for (int64_t k = 0; k < k16; k += 16) {
    v16 ev[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      if (kPrefetch && pf) __builtin_prefetch(ahead + c * K + k, 0, 2);
      ev[c] = Weight<T>::Load16(e + (n + c) * K + k);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const v16 xv = load16(x + r * K + k);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] += xv * ev[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = Weight<T>::Sum(acc[r][c]);
      for (int64_t k = k16; k < K; ++k) s += x[r * K + k] * Weight<T>::Load1(e[(n + c) * K + k]);
      y[r * N + n + c] = s;
    }
}

// y[0:R, n:n1]: tiles of NtCols(R) E rows, then single ones
template <typename T, int R>
void NtRows(const float* x, const T* e, float* y, int64_t K, int64_t N, int64_t n, int64_t n1,
            bool pf) {
  constexpr int C = Weight<T>::NtCols(R);
  for (; n + C <= n1; n += C) NtBlock<T, R, C>(x, e, y, K, N, n, pf);
  for (; n < n1; ++n) NtBlock<T, R, 1>(x, e, y, K, N, n, pf);
}

// ---- bf16 with vdpbf16ps -------------------------------------------------------------------

#ifdef BITDELTA_HAVE_DPBF16
constexpr int kPairs = 8;  // pairs of W rows per pass over the columns (16 row streams)
// software prefetch distance along a row, in columns: with 16 strided streams the hardware
// prefetchers alone left a single thread at ~20 GB/s from DRAM; 512 bytes ahead gives ~25 at
// 1 row and halves the time at 8 rows (measured: 2 to 32 pairs x 64 to 512 columns)
constexpr int kPrefetchCols = 256;

// acc[0:R, tile] (+)= x[:, 2p0 : 2p1] · W[2p0 : 2p1, n:n+32] with vdpbf16ps, columns past n1
// masked off; xp[r * P + p] holds (x[r, 2p], x[r, 2p+1]) as one 32-bit word (the partner of
// an odd K's last element is zero, and so is the missing W row). acc holds each 32-column tile
// as the unpack leaves it: 16 `lo` lanes (columns 8*(j/4) + j%4), then 16 `hi` (those + 4).
template <int R>
void BfDpPass(const uint32_t* xp, int64_t P, const bf16* w, float* acc, int64_t acc_stride,
              int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t p0, int64_t p1) {
  for (int64_t n = n0; n < n1; n += 32) {
    const int64_t width = std::min<int64_t>(32, n1 - n);
    const __mmask32 m = width == 32 ? ~__mmask32(0) : ((__mmask32(1) << width) - 1);
    float* a = acc + (n - n0);
    __m512 lo[R], hi[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      lo[r] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(a + r * acc_stride);
      hi[r] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(a + r * acc_stride + 16);
    }
    for (int64_t p = p0; p < p1; ++p) {
      _mm_prefetch((const char*)(w + (2 * p) * N + n + kPrefetchCols), _MM_HINT_T0);
      _mm_prefetch((const char*)(w + (2 * p + 1) * N + n + kPrefetchCols), _MM_HINT_T0);
      const __m512i wa = _mm512_maskz_loadu_epi16(m, w + (2 * p) * N + n);
      const __m512i wb = 2 * p + 1 < K ? _mm512_maskz_loadu_epi16(m, w + (2 * p + 1) * N + n)
                                       : _mm512_setzero_si512();
      const __m512bh wl = (__m512bh)_mm512_unpacklo_epi16(wa, wb);
      const __m512bh wh = (__m512bh)_mm512_unpackhi_epi16(wa, wb);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(xp[r * P + p]));
        lo[r] = _mm512_dpbf16_ps(lo[r], wl, xb);
        hi[r] = _mm512_dpbf16_ps(hi[r], wh, xb);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(a + r * acc_stride, lo[r]);
      _mm512_storeu_ps(a + r * acc_stride + 16, hi[r]);
    }
  }
}

// x's rows as bf16 pairs: word p of a row holds (x[2p], x[2p+1]), an odd K's last partner 0
std::vector<uint32_t> Pairs(const bf16* xh, int64_t M, int64_t K) {
  const int64_t P = (K + 1) / 2;
  std::vector<uint32_t> pairs(M * P, 0u);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k)
      pairs[r * P + k / 2] |= uint32_t(xh[r * K + k]) << (16 * (k & 1));
  return pairs;
}

// y[0:M, n0:n1] = x · W: passes of kPairs pairs of W rows over all the columns (W read as
// 2*kPairs row streams), each pass run for every block of kRows rows while its W rows are
// in L1/L2 (W leaves memory once whatever M), then back to column order.
void BfDp(const uint32_t* xp, int64_t P, int64_t M, const bf16* w, float* y, int64_t K,
          int64_t N, int64_t n0, int64_t n1) {
  const int64_t width = (n1 - n0 + 31) / 32 * 32;
  thread_local std::vector<float> scratch;
  if (int64_t(scratch.size()) < M * width) scratch.resize(M * width);
  float* acc = scratch.data();
  for (int64_t p0 = 0; p0 < P; p0 += kPairs)
    for (int64_t m0 = 0; m0 < M; m0 += kRows)
      ForRows(int(std::min<int64_t>(kRows, M - m0)), [&](auto R) {
        BfDpPass<R()>(xp + m0 * P, P, w, acc + m0 * width, width, K, N, n0, n1, p0,
                      std::min<int64_t>(P, p0 + kPairs));
      });
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  for (int64_t n = n0; n < n1; n += 32) {
    const int64_t cols = std::min<int64_t>(32, n1 - n);
    const __mmask32 m = cols == 32 ? ~__mmask32(0) : ((__mmask32(1) << cols) - 1);
    const __mmask16 m0 = __mmask16(m & 0xffff), m1 = __mmask16(m >> 16);
    for (int64_t r = 0; r < M; ++r) {
      const __m512 lo = _mm512_loadu_ps(acc + r * width + (n - n0));
      const __m512 hi = _mm512_loadu_ps(acc + r * width + (n - n0) + 16);
      _mm512_mask_storeu_ps(y + r * N + n, m0, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_mask_storeu_ps(y + r * N + n + 16, m1, _mm512_permutex2var_ps(lo, second, hi));
    }
  }
}

// NtBlock with vdpbf16ps on bf16 rows x: 32 elements of K per step, K's tail masked (zeros).
template <int R, int C>
void NtDpBlock(const bf16* x, const bf16* e, float* y, int64_t K, int64_t N, int64_t n) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 m = K - k >= 32 ? ~__mmask32(0) : ((__mmask32(1) << (K - k)) - 1);
    __m512bh ev[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch((const char*)(e + (n + C + c) * K + k), _MM_HINT_T0);  // the next block
      ev[c] = (__m512bh)_mm512_maskz_loadu_epi16(m, e + (n + c) * K + k);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + k);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], ev[c], xv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) y[r * N + n + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int R>
void NtDpRows(const bf16* x, const bf16* e, float* y, int64_t K, int64_t N, int64_t n,
              int64_t n1) {
  constexpr int C = Weight<bf16>::NtCols(R);
  for (; n + C <= n1; n += C) NtDpBlock<R, C>(x, e, y, K, N, n);
  for (; n < n1; ++n) NtDpBlock<R, 1>(x, e, y, K, N, n);
}
#endif

// ---- the FFI handlers ----------------------------------------------------------------------

// x's rows in f32 for the FMA loops: f32 x itself, bf16 x widened once into `buf`
const float* RowsF32(const float* x, int64_t, std::vector<float>&) { return x; }
const float* RowsF32(const bf16* x, int64_t size, std::vector<float>& buf) {
  buf.resize(size);
  for (int64_t i = 0; i < size; ++i) buf[i] = widen1(x[i]);
  return buf.data();
}

template <ffi::DataType D>
using Elem = std::conditional_t<D == ffi::F32, float, bf16>;

template <ffi::DataType D>
constexpr const char* kName = D == ffi::F32 ? "small_matmul" : "small_matmul_bf16";

template <ffi::DataType D>
ffi::Error ImplNN(ffi::Buffer<D> x, ffi::Buffer<D> w, ffi::ResultBuffer<ffi::F32> y) {
  using T = Elem<D>;
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1])
    return ffi::Error::InvalidArgument(std::string(kName<D>) + ": expected x[M,K] and W[K,N]");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  const T* xp = static_cast<const T*>(x.untyped_data());
  const T* wp = static_cast<const T*>(w.untyped_data());
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(yp, yp + M * N, 0.f);
    return ffi::Error::Success();
  }
  const int64_t per = TwoPerThread(M, K, N, Weight<T>::kNnAlign);
#ifdef BITDELTA_HAVE_DPBF16
  if constexpr (std::is_same_v<T, bf16>) {
    if (Weight<T>::Dp()) {
      const std::vector<uint32_t> pairs = Pairs(xp, M, K);
      RunColumns(N, per, [&](int64_t n0, int64_t n1) {
        BfDp(pairs.data(), (K + 1) / 2, M, wp, yp, K, N, n0, n1);
      });
      return ffi::Error::Success();
    }
  }
#endif
  std::vector<float> buf;
  const float* xf = RowsF32(xp, M * K, buf);
  RunColumns(N, per, [&](int64_t n0, int64_t n1) { NnColumns(xf, wp, yp, M, K, N, n0, n1); });
  return ffi::Error::Success();
}

template <ffi::DataType D>
ffi::Error ImplNT(ffi::Buffer<D> x, ffi::Buffer<D> e, ffi::ResultBuffer<ffi::F32> y) {
  using T = Elem<D>;
  auto xd = x.dimensions();
  auto ed = e.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || ed[1] != xd[1])
    return ffi::Error::InvalidArgument(std::string(kName<D>) + "_nt: expected x[M,K] and E[N,K]");
  const int64_t M = xd[0], K = xd[1], N = ed[0];
  const T* xp = static_cast<const T*>(x.untyped_data());
  const T* ep = static_cast<const T*>(e.untyped_data());
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  const bool dp = Weight<T>::Dp();
  std::vector<float> buf;
  const float* xf = dp ? nullptr : RowsF32(xp, M * K, buf);  // vdpbf16ps reads x as it is
  constexpr int64_t kCols = Weight<T>::kNtCols;
  RunColumns(N, Weight<T>::NtPer(M, K, N), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += kCols)
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        ForRows(int(std::min<int64_t>(kRows, M - m0)), [&](auto R) {
          const int64_t n_end = std::min(n1, n + kCols);
#ifdef BITDELTA_HAVE_DPBF16
          if constexpr (std::is_same_v<T, bf16>)
            if (dp) return NtDpRows<R()>(xp + m0 * K, ep, yp + m0 * N, K, N, n, n_end);
#endif
          NtRows<T, R()>(xf + m0 * K, ep, yp + m0 * N, K, N, n, n_end, m0 == 0);
        });
  });
  return ffi::Error::Success();
}

}  // namespace

// bf16: 1 vdpbf16ps (AVX-512 BF16 built and reported by the CPU), 0 bf16 widened to f32 + FMA.
extern "C" int BitdeltaSmallMatmulBf16Isa() { return Weight<bf16>::Dp() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmul, ImplNN<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmulNt, ImplNT<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // E [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmulBf16, ImplNN<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // W [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmulBf16Nt, ImplNT<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // E [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
