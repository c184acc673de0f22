// Small-M f32 matmul for CPU decode steps: y[M,N] = x[M,K] · W[K,N] (W a Linear kernel).
//
// Why: at a few rows (2..16) a decode step is bound by reading W, but XLA's CPU dot runs far
// below both the bandwidth and the FLOP rate there (at 8 rows it costs nearly what 32 rows do).
// Here W is read once per block of up to 8 rows as kK contiguous row streams, the rows' partial
// sums stay in L1/L2, and a persistent pool of threads splits the columns.
// Numerics: f32 products and sums, K in another order than XLA's (agrees to rounding).
#include <algorithm>
#include <cstdint>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using bitdelta_small::Pool;

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
