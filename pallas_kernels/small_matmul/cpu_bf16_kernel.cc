// Small-M matmuls with bf16 weights for CPU decode steps, f32 results:
//   NN: y[M,N] = x[M,K] · W[K,N]   (W a Linear kernel)
//   NT: y[M,N] = x[M,K] · E[N,K]ᵀ  (E a tied embedding used as the LM head)
//
// Why: a bf16 W is half the bytes of an f32 one and decode steps are bound by reading W, but
// XLA's CPU bf16 dot is slow at one row (the NT one ~12x slower than f32 at SmolLM2's LM head).
// Where the build has AVX-512 BF16 and the CPU reports it at run time, `vdpbf16ps` multiplies
// pairs of adjacent K: for NN, W rows 2p and 2p+1 interleaved on the fly by `vpunpck{l,h}wd`
// (which permutes the columns of a 32-column tile within 128-bit lanes; the accumulators go back
// to column order at the end) times the row's broadcast (x[2p], x[2p+1]); for NT, E's rows
// already hold the pairs. Elsewhere W is widened to f32 by a 16-bit shift and multiplied with
// FMAs (generic vectors: AVX-512, AVX2 or SSE code). A persistent pool splits the columns.
// Numerics: x is bf16 (the caller rounds it), so every product is exact in f32; sums in f32
// (vdpbf16ps adds its two products to the accumulator in f32 with round-to-nearest-even; it
// flushes denormal inputs and outputs to zero, the widening path does not).
#include <algorithm>
#include <cstdint>
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

typedef float v16 __attribute__((vector_size(64)));
constexpr int kK = 8;  // rows of W per accumulation step (widening NN path)

inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }
inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, 64); }

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
constexpr int kBfRows = 8;  // rows of x per pass over a W tile

inline v16 widen16(const uint16_t* p) {
  u16x16 h;
  __builtin_memcpy(&h, p, 32);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  v16 f;
  __builtin_memcpy(&f, &u, 64);
  return f;
}
inline float widen1(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// Portable: y[0:R, n0:n1] += xf[0:R] · W[k:k+kK, n0:n1] (fewer rows at K's end), xf the rows
// widened to f32; one k-block of the f32 `Block` (columns inner: kK long row streams).
template <int R>
void BfWidenStep(const float* xf, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t n0,
                 int64_t n1, int64_t k) {
  if (k + kK > K) {
    for (; k < K; ++k)
      for (int r = 0; r < R; ++r) {
        const float xv = xf[r * K + k];
        for (int64_t n = n0; n < n1; ++n) y[r * N + n] += xv * widen1(w[k * N + n]);
      }
    return;
  }
  const int64_t n16 = n0 + (n1 - n0) / 16 * 16;
  float xs[R][kK];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kK; ++j) xs[r][j] = xf[r * K + k + j];
  for (int64_t n = n0; n < n16; n += 16) {
    v16 wk[kK];
#pragma GCC unroll 8
    for (int j = 0; j < kK; ++j) wk[j] = widen16(w + (k + j) * N + n);
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
      for (int j = 0; j < kK; ++j) s += xs[r][j] * widen1(w[(k + j) * N + n]);
      y[r * N + n] += s;
    }
}

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
void BfDpPass(const uint32_t* xp, int64_t P, const uint16_t* w, float* acc, int64_t acc_stride,
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

template <int R>
struct DpPassRows {
  static void run(const uint32_t* xp, int64_t P, const uint16_t* w, float* acc, int64_t stride,
                  int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t p0, int64_t p1) {
    BfDpPass<R>(xp, P, w, acc, stride, K, N, n0, n1, p0, p1);
  }
};

template <template <int> class F, typename... A>
void ForRows(int rows, A... a);

// y[0:M, n0:n1] = x · W: passes of kPairs pairs of W rows over all the columns (W read as
// 2*kPairs row streams), each pass run for every block of kBfRows rows while its W rows are
// in L1/L2 (W leaves memory once whatever M), then back to column order.
void BfDp(const uint32_t* xp, int64_t P, int64_t M, const uint16_t* w, float* y, int64_t K,
          int64_t N, int64_t n0, int64_t n1) {
  const int64_t width = (n1 - n0 + 31) / 32 * 32;
  thread_local std::vector<float> scratch;
  if (int64_t(scratch.size()) < M * width) scratch.resize(M * width);
  float* acc = scratch.data();
  for (int64_t p0 = 0; p0 < P; p0 += kPairs)
    for (int64_t m0 = 0; m0 < M; m0 += kBfRows)
      ForRows<DpPassRows>(int(std::min<int64_t>(kBfRows, M - m0)), xp + m0 * P, P, w,
                          acc + m0 * width, width, K, N, n0, n1, p0,
                          std::min<int64_t>(P, p0 + kPairs));
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

bool CpuHasDpbf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#else
bool CpuHasDpbf16() { return false; }
#endif

template <template <int> class F, typename... A>
void ForRows(int rows, A... a) {
  switch (rows) {
    case 1: return F<1>::run(a...);
    case 2: return F<2>::run(a...);
    case 3: return F<3>::run(a...);
    case 4: return F<4>::run(a...);
    case 5: return F<5>::run(a...);
    case 6: return F<6>::run(a...);
    case 7: return F<7>::run(a...);
    default: return F<8>::run(a...);
  }
}
template <int R>
struct WidenRows {
  static void run(const float* xf, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t n0,
                  int64_t n1, int64_t k) {
    BfWidenStep<R>(xf, w, y, K, N, n0, n1, k);
  }
};

// ---- NT: y = x · Eᵀ ----------------------------------------------------------------------

// y[0:R, n:n+C] = x[0:R] · E[n:n+C]ᵀ with f32 rows xf, E widened 16 at a time.
template <int R, int C>
void NtWidenBlock(const float* xf, const uint16_t* e, float* y, int64_t K, int64_t N, int64_t n) {
  v16 acc[R][C] = {};
  const int64_t k16 = K / 16 * 16;
  for (int64_t k = 0; k < k16; k += 16) {
    v16 ev[C];
    for (int c = 0; c < C; ++c) ev[c] = widen16(e + (n + c) * K + k);
    for (int r = 0; r < R; ++r) {
      const v16 xv = load16(xf + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] += xv * ev[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += acc[r][c][j];
      for (int64_t k = k16; k < K; ++k) s += xf[r * K + k] * widen1(e[(n + c) * K + k]);
      y[r * N + n + c] = s;
    }
}

#ifdef BITDELTA_HAVE_DPBF16
// The same with vdpbf16ps on bf16 rows x: 32 elements of K per step, K's tail masked (zeros).
template <int R, int C>
void NtDpBlock(const uint16_t* x, const uint16_t* e, float* y, int64_t K, int64_t N, int64_t n) {
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
#endif

// columns per block for R rows: R*C accumulators (<= 16) plus C loaded E rows in registers
constexpr int NtCols(int R) { return R <= 2 ? 8 : R <= 4 ? 4 : 2; }

template <int R>
struct NtRows {
  // y[0:R, n:n1]: blocks of NtCols(R) columns, then single columns
  static void run(bool dp, const uint16_t* x, const float* xf, const uint16_t* e, float* y,
                  int64_t K, int64_t N, int64_t n, int64_t n1) {
    constexpr int C = NtCols(R);
#ifdef BITDELTA_HAVE_DPBF16
    if (dp) {
      for (; n + C <= n1; n += C) NtDpBlock<R, C>(x, e, y, K, N, n);
      for (; n < n1; ++n) NtDpBlock<R, 1>(x, e, y, K, N, n);
      return;
    }
#endif
    for (; n + C <= n1; n += C) NtWidenBlock<R, C>(xf, e, y, K, N, n);
    for (; n < n1; ++n) NtWidenBlock<R, 1>(xf, e, y, K, N, n);
  }
};

// x's rows once in the form an inner loop wants: bf16 pairs (NN, vdpbf16ps) or f32 (widening)
struct Rows16 {
  std::vector<uint32_t> pairs;
  std::vector<float> f32;
};

Rows16 PrepareRows(const uint16_t* xh, int64_t M, int64_t K, bool pairs) {
  Rows16 out;
  if (pairs) {
    const int64_t P = (K + 1) / 2;
    out.pairs.assign(M * P, 0u);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t k = 0; k < K; ++k)
        out.pairs[r * P + k / 2] |= uint32_t(xh[r * K + k]) << (16 * (k & 1));
  } else {
    out.f32.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) out.f32[i] = widen1(xh[i]);
  }
  return out;
}

// Columns [0, N) in chunks of a multiple of `align`, two per pool thread (one if tiny).
template <typename F>
void SplitColumns(int64_t M, int64_t K, int64_t N, int64_t align, const F& f) {
  Pool& pool = Pool::get();
  int chunks = M * K * N < (int64_t(1) << 16) ? 1 : pool.size() * 2;
  int64_t per = (N + chunks - 1) / chunks;
  per = (per + align - 1) / align * align;
  chunks = int((N + per - 1) / per);
  pool.run([&](int c) { f(c * per, std::min(N, (c + 1) * per)); }, chunks);
}

ffi::Error ImplNN(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1])
    return ffi::Error::InvalidArgument("small_matmul_bf16: expected x[M,K] and W[K,N]");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  const uint16_t* xh = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  float* yp = y->typed_data();
  std::fill(yp, yp + M * N, 0.f);
  if (M == 0 || N == 0 || K == 0) return ffi::Error::Success();
  const bool dp = CpuHasDpbf16();
  const Rows16 rows = PrepareRows(xh, M, K, dp);
  SplitColumns(M, K, N, 32, [&](int64_t n0, int64_t n1) {
#ifdef BITDELTA_HAVE_DPBF16
    if (dp) return BfDp(rows.pairs.data(), (K + 1) / 2, M, wp, yp, K, N, n0, n1);
#endif
    // k-blocks outer, row blocks inner: W leaves memory once whatever M
    for (int64_t k = 0; k < K; k += kK)
      for (int64_t m0 = 0; m0 < M; m0 += kBfRows)
        ForRows<WidenRows>(int(std::min<int64_t>(kBfRows, M - m0)), rows.f32.data() + m0 * K,
                           wp, yp + m0 * N, K, N, n0, n1, k);
  });
  return ffi::Error::Success();
}

ffi::Error ImplNT(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> e,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto ed = e.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || ed[1] != xd[1])
    return ffi::Error::InvalidArgument("small_matmul_bf16_nt: expected x[M,K] and E[N,K]");
  const int64_t M = xd[0], K = xd[1], N = ed[0];
  const uint16_t* xh = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const uint16_t* ep = reinterpret_cast<const uint16_t*>(e.untyped_data());
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  const bool dp = CpuHasDpbf16();
  Rows16 rows;  // the widening path's f32 rows (vdpbf16ps reads x as it is)
  if (!dp) rows = PrepareRows(xh, M, K, false);
  constexpr int64_t kCols = 8;  // E rows kept in L1 while every row block uses them
  SplitColumns(M, K, N, kCols, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += kCols)
      for (int64_t m0 = 0; m0 < M; m0 += kBfRows)
        ForRows<NtRows>(int(std::min<int64_t>(kBfRows, M - m0)), dp, xh + m0 * K,
                        dp ? nullptr : rows.f32.data() + m0 * K, ep, yp + m0 * N, K, N, n,
                        std::min(n1, n + kCols));
  });
  return ffi::Error::Success();
}

}  // namespace

// 1: vdpbf16ps (AVX-512 BF16 built and reported by the CPU), 0: bf16 widened to f32 + FMA.
extern "C" int BitdeltaSmallMatmulBf16Isa() { return CpuHasDpbf16() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmulBf16, ImplNN,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // W [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmulBf16Nt, ImplNT,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // E [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
