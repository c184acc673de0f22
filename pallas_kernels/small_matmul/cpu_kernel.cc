// Small-M f32 matmuls for CPU decode steps:
//   NN: y[M,N] = x[M,K] · W[K,N]   (W a Linear kernel)
//   NT: y[M,N] = x[M,K] · E[N,K]ᵀ  (E a tied embedding used as the LM head)
//
// Why: at a few rows a decode step is bound by reading W, but XLA's CPU dot runs far below
// both the bandwidth and the FLOP rate there (NN at 8 rows costs nearly what 32 rows do; the
// NT LM head of SmolLM2, 113 MB, ran on one thread at ~14 GB/s at one row, and its CPU time
// grew 2.4x from 1 to 16 rows). NN reads W once per block of up to 8 rows as kK contiguous row
// streams, the rows' partial sums in L1/L2. NT reads each E row once per call: blocks of
// kNtCols E rows stay in cache while every row block of x is multiplied by them (the next block
// prefetched meanwhile), a register tile of R rows x C E rows accumulating 16 K-lanes each
// (FMAs on generic vectors: AVX-512, AVX2 or SSE code), reduced across lanes at the end. A
// persistent pool splits the columns (N) of both, NT in many small chunks.
// Numerics: f32 products and sums, K in another order than XLA's (agrees to rounding).
#include <algorithm>
#include <cstdint>

#include "pool.h"  // pallas_kernels/native, on the include path (native/build.py)
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using bitdelta_native::Pool;

typedef float v16 __attribute__((vector_size(64)));
constexpr int kRows = 8;  // rows of x per pass over W
constexpr int kK = 8;     // rows of W per accumulation step

inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }
inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, 64); }

// y[0:R, n0:n1] = x[0:R] · W[:, n0:n1]; k-blocks outer, columns inner.
template <int R>
void Block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0,
           int64_t n1) {
  const int64_t n16 = n0 + (n1 - n0) / 16 * 16;
  for (int r = 0; r < R; ++r)
    for (int64_t n = n0; n < n1; ++n) y[r * N + n] = 0.f;
  int64_t k = 0;
  for (; k + kK <= K; k += kK) {
    float xs[R][kK];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kK; ++j) xs[r][j] = x[r * K + k + j];
    for (int64_t n = n0; n < n16; n += 16) {
      v16 wk[kK];
#pragma GCC unroll 8
      for (int j = 0; j < kK; ++j) wk[j] = load16(w + (k + j) * N + n);
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
        for (int j = 0; j < kK; ++j) s += xs[r][j] * w[(k + j) * N + n];
        y[r * N + n] += s;
      }
  }
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
      for (int64_t n = n0; n < n1; ++n) y[r * N + n] += xv * w[k * N + n];
    }
}

void Rows(int rows, const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0,
          int64_t n1) {
  switch (rows) {
    case 1: return Block<1>(x, w, y, K, N, n0, n1);
    case 2: return Block<2>(x, w, y, K, N, n0, n1);
    case 3: return Block<3>(x, w, y, K, N, n0, n1);
    case 4: return Block<4>(x, w, y, K, N, n0, n1);
    case 5: return Block<5>(x, w, y, K, N, n0, n1);
    case 6: return Block<6>(x, w, y, K, N, n0, n1);
    case 7: return Block<7>(x, w, y, K, N, n0, n1);
    default: return Block<8>(x, w, y, K, N, n0, n1);
  }
}

// ---- NT: y = x · Eᵀ ----------------------------------------------------------------------

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline float Hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// E rows kept in cache while every row block of x uses them (27 KiB at K = 576)
constexpr int64_t kNtCols = 12;
// E rows per register tile for R rows: R*C accumulators + C E vectors + 1 x vector <= 32
constexpr int NtCols(int R) { return R == 1 ? 12 : R <= 4 ? 6 : 3; }

// Software prefetch (into L2) of the next E block, by the first row block's pass over this
// one: DRAM reads overlap the FMAs. One thread's CPU time on the SmolLM2 head (49152 x 576),
// none -> this: 7.4 -> 7.3 ms at 1 row, 14.2 -> 8.9 at 8, 18.8 -> 13.6 at 16 (12 rows ahead
// into L1: 9.9 / 14.8; 24 or 48 rows ahead: no better).
constexpr int64_t kNtPrefetchRows = kNtCols;

// y[0:R, n:n+C] = x[0:R] · E[n:n+C]ᵀ; `pf`: prefetch E rows kNtPrefetchRows ahead (up to `N`)
template <int R, int C>
void NtBlock(const float* x, const float* e, float* y, int64_t K, int64_t N, int64_t n, bool pf) {
  v16 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = v16{};
  const int64_t k16 = K / 16 * 16;
  // the rows to prefetch: C rows kNtPrefetchRows ahead, clamped inside E
  const float* ahead = e + std::min(n + kNtPrefetchRows, N - C) * K;
  for (int64_t k = 0; k < k16; k += 16) {
    v16 ev[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      if (pf) __builtin_prefetch(ahead + c * K + k, 0, 2);
      ev[c] = load16(e + (n + c) * K + k);
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
      float s = Hsum(acc[r][c]);
      for (int64_t k = k16; k < K; ++k) s += x[r * K + k] * e[(n + c) * K + k];
      y[r * N + n + c] = s;
    }
}

template <int R>
void NtRows(const float* x, const float* e, float* y, int64_t K, int64_t N, int64_t n,
            int64_t n1, bool pf) {
  constexpr int C = NtCols(R);
  for (; n + C <= n1; n += C) NtBlock<R, C>(x, e, y, K, N, n, pf);
  for (; n < n1; ++n) NtBlock<R, 1>(x, e, y, K, N, n, pf);
}

void NtRowsAny(int rows, const float* x, const float* e, float* y, int64_t K, int64_t N,
               int64_t n, int64_t n1, bool pf) {
  switch (rows) {
    case 1: return NtRows<1>(x, e, y, K, N, n, n1, pf);
    case 2: return NtRows<2>(x, e, y, K, N, n, n1, pf);
    case 3: return NtRows<3>(x, e, y, K, N, n, n1, pf);
    case 4: return NtRows<4>(x, e, y, K, N, n, n1, pf);
    case 5: return NtRows<5>(x, e, y, K, N, n, n1, pf);
    case 6: return NtRows<6>(x, e, y, K, N, n, n1, pf);
    case 7: return NtRows<7>(x, e, y, K, N, n, n1, pf);
    default: return NtRows<8>(x, e, y, K, N, n, n1, pf);
  }
}

ffi::Error ImplNT(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> e,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto ed = e.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || ed[1] != xd[1])
    return ffi::Error::InvalidArgument("small_matmul_nt: expected x[M,K] and E[N,K]");
  const int64_t M = xd[0], K = xd[1], N = ed[0];
  const float* xp = x.typed_data();
  const float* ep = e.typed_data();
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  Pool& pool = Pool::get();
  // many small chunks claimed dynamically: on a shared machine one thread may be descheduled
  int64_t per = (int64_t(1) << 18) / (4 * std::max<int64_t>(K, 1));  // ~256 KiB of E
  per = std::max<int64_t>(kNtCols, per / kNtCols * kNtCols);
  if (M * K * N < (int64_t(1) << 16)) per = N;
  const int chunks = int((N + per - 1) / per);
  pool.run([&](int c) {
    const int64_t n0 = c * per, n1 = std::min(N, n0 + per);
    for (int64_t n = n0; n < n1; n += kNtCols)
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        NtRowsAny(int(std::min<int64_t>(kRows, M - m0)), xp + m0 * K, ep, yp + m0 * N, K, N, n,
                  std::min(n1, n + kNtCols), m0 == 0);
  }, chunks);
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1])
    return ffi::Error::InvalidArgument("small_matmul: expected x[M,K] and W[K,N]");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  Pool& pool = Pool::get();
  int chunks = M * K * N < (int64_t(1) << 16) ? 1 : pool.size() * 2;
  int64_t per = (N + chunks - 1) / chunks;
  per = (per + 15) / 16 * 16;
  chunks = int((N + per - 1) / per);
  pool.run([&](int c) {
    const int64_t n0 = c * per, n1 = std::min(N, n0 + per);
    for (int64_t m0 = 0; m0 < M; m0 += kRows)
      Rows(int(std::min<int64_t>(kRows, M - m0)), xp + m0 * K, wp, yp + m0 * N, K, N, n0, n1);
  }, chunks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmulNt, ImplNT,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // E [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
