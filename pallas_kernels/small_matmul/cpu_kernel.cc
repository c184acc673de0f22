// Small-M f32 matmul for CPU decode steps: y[M,N] = x[M,K] · W[K,N] (W a Linear kernel).
//
// Why: at a few rows (2..16) a decode step is bound by reading W, but XLA's CPU dot runs far
// below both the bandwidth and the FLOP rate there (at 8 rows it costs nearly what 32 rows do).
// Here W is read once per block of up to 8 rows as kK contiguous row streams, the rows' partial
// sums stay in L1/L2, and a persistent pool of threads splits the columns.
// Numerics: f32 products and sums, K in another order than XLA's (agrees to rounding).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
constexpr int kRows = 8;  // rows of x per pass over W
constexpr int kK = 8;     // rows of W per accumulation step

inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }
inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, 64); }

// A persistent pool: run(f, n) calls f(i) for every i in [0, n), the caller taking part.
// It is never destroyed (its threads are detached and simply end with the process).
class Pool {
 public:
  static Pool& get() {
    static Pool* p = new Pool;
    return *p;
  }
  int size() const { return int(workers_) + 1; }
  void run(const std::function<void(int)>& f, int n) {
    if (n <= 1 || workers_ == 0) {
      for (int i = 0; i < n; ++i) f(i);
      return;
    }
    // One run at a time: XLA runs independent custom calls (q/k/v projections, two engines'
    // steps) on several threads at once, and a second caller would reset job_ / done_ under
    // the first, letting it return while workers still write into its (reused) output buffer.
    std::lock_guard<std::mutex> one_at_a_time(run_mu_);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &f; njobs_ = n; done_ = 0; gen = ++gen_;
      next_.store((gen & 0xffffffffu) << 32);
    }
    cv_.notify_all();
    int i, mine = 0;
    while ((i = claim(gen, n)) >= 0) { f(i); ++mine; }
    std::unique_lock<std::mutex> lk(mu_);
    done_ += mine;
    done_cv_.wait(lk, [&] { return done_ >= n; });
  }

 private:
  Pool() {
    int n = int(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("BITDELTA_CPU_THREADS")) n = std::atoi(env);
    n = std::max(1, std::min(n, 64));
    for (int i = 1; i < n; ++i) std::thread([this] { loop(); }).detach();
    workers_ = n - 1;
  }
  // the next index of run `gen`, or -1: a claim never crosses into another run
  int claim(uint64_t gen, int n) {
    uint64_t cur = next_.load();
    for (;;) {
      if ((cur >> 32) != (gen & 0xffffffffu) || int(cur & 0xffffffffu) >= n) return -1;
      if (next_.compare_exchange_weak(cur, cur + 1)) return int(cur & 0xffffffffu);
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      int n;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_ != seen; });
        seen = gen_;
        job = job_;
        n = njobs_;
      }
      int i, mine = 0;
      while ((i = claim(seen, n)) >= 0) { (*job)(i); ++mine; }
      if (mine) {
        std::lock_guard<std::mutex> lk(mu_);
        done_ += mine;
        done_cv_.notify_all();
      }
    }
  }
  int workers_ = 0;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<uint64_t> next_{0};
  int njobs_ = 0, done_ = 0;
  uint64_t gen_ = 0;
};

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

// ---- bf16 weights: y[M,N] (f32) = x[M,K] (bf16) · W[K,N] (bf16), f32 accumulation ----------
//
// Why: a bf16 W is half the bytes of an f32 one, and decode steps are bound by reading W.
// Where the build has AVX-512 BF16 and the CPU reports it, `vdpbf16ps` multiplies pairs of
// adjacent K (W rows 2p, 2p+1 interleaved on the fly by `vpunpck{l,h}wd`, which permutes the
// columns of a 32-column tile within 128-bit lanes; the accumulators are put back in column
// order at the store) with the row's (x[2p], x[2p+1]) broadcast. Elsewhere W is widened to f32
// by a 16-bit shift and multiplied with FMAs (generic vectors: AVX-512, AVX2 or SSE code).
// Numerics: the products of two bf16 numbers are exact in f32; sums in f32 (vdpbf16ps adds
// its pair of products and the accumulator in f32, round-to-nearest-even; its denormal inputs
// and outputs are flushed to zero, which the widening path does not).
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BITDELTA_HAVE_DPBF16 1
#endif

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

// Portable: y[0:R, n0:n1] = xf[0:R] · W[:, n0:n1], xf the rows widened to f32.
template <int R>
void BfWiden(const float* xf, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t n0,
             int64_t n1) {
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    v16 acc[R] = {};
    for (int64_t k = 0; k < K; ++k) {
      const v16 wk = widen16(w + k * N + n);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] += xf[r * K + k] * wk;
    }
    for (int r = 0; r < R; ++r) store16(y + r * N + n, acc[r]);
  }
  for (; n < n1; ++n)
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += xf[r * K + k] * widen1(w[k * N + n]);
      y[r * N + n] = s;
    }
}

#ifdef BITDELTA_HAVE_DPBF16
constexpr int kPairs = 8;  // pairs of W rows per pass over the columns (16 row streams)

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

// y[0:R, n0:n1] = x · W: passes of kPairs pairs of W rows over all the columns (W read as
// 2*kPairs contiguous row streams; the accumulators stay in L1), then back to column order.
template <int R>
void BfDp(const uint32_t* xp, int64_t P, const uint16_t* w, float* y, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  const int64_t width = (n1 - n0 + 31) / 32 * 32;
  thread_local std::vector<float> scratch;
  if (int64_t(scratch.size()) < R * width) scratch.resize(R * width);
  float* acc = scratch.data();
  for (int64_t p0 = 0; p0 < P; p0 += kPairs)
    BfDpPass<R>(xp, P, w, acc, width, K, N, n0, n1, p0, std::min<int64_t>(P, p0 + kPairs));
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  for (int64_t n = n0; n < n1; n += 32) {
    const int64_t cols = std::min<int64_t>(32, n1 - n);
    const __mmask32 m = cols == 32 ? ~__mmask32(0) : ((__mmask32(1) << cols) - 1);
    const __mmask16 m0 = __mmask16(m & 0xffff), m1 = __mmask16(m >> 16);
    for (int r = 0; r < R; ++r) {
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
                  int64_t n1) {
    BfWiden<R>(xf, w, y, K, N, n0, n1);
  }
};
#ifdef BITDELTA_HAVE_DPBF16
template <int R>
struct DpRows {
  static void run(const uint32_t* xp, int64_t P, const uint16_t* w, float* y, int64_t K,
                  int64_t N, int64_t n0, int64_t n1) {
    BfDp<R>(xp, P, w, y, K, N, n0, n1);
  }
};
#endif

ffi::Error ImplBf16(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1])
    return ffi::Error::InvalidArgument("small_matmul_bf16: expected x[M,K] and W[K,N]");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  const uint16_t* xh = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(yp, yp + M * N, 0.f);
    return ffi::Error::Success();
  }
  const bool dp = CpuHasDpbf16();
  // the rows once in the form the inner loop wants: bf16 pairs, or f32
  const int64_t P = (K + 1) / 2;
  std::vector<uint32_t> xp;
  std::vector<float> xf;
  if (dp) {
    xp.assign(M * P, 0u);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t k = 0; k < K; ++k)
        xp[r * P + k / 2] |= uint32_t(xh[r * K + k]) << (16 * (k & 1));
  } else {
    xf.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = widen1(xh[i]);
  }
  Pool& pool = Pool::get();
  int chunks = M * K * N < (int64_t(1) << 16) ? 1 : pool.size() * 2;
  int64_t per = (N + chunks - 1) / chunks;
  per = (per + 31) / 32 * 32;
  chunks = int((N + per - 1) / per);
  pool.run([&](int c) {
    const int64_t n0 = c * per, n1 = std::min(N, n0 + per);
    for (int64_t m0 = 0; m0 < M; m0 += kBfRows) {
      const int rows = int(std::min<int64_t>(kBfRows, M - m0));
#ifdef BITDELTA_HAVE_DPBF16
      if (dp) {
        ForRows<DpRows>(rows, xp.data() + m0 * P, P, wp, yp + m0 * N, K, N, n0, n1);
        continue;
      }
#endif
      ForRows<WidenRows>(rows, (const float*)(xf.data() + m0 * K), wp, yp + m0 * N, K, N, n0, n1);
    }
  }, chunks);
  return ffi::Error::Success();
}

}  // namespace

// 1: vdpbf16ps (AVX-512 BF16 built and reported by the CPU), 0: bf16 widened to f32 + FMA.
extern "C" int BitdeltaSmallMatmulBf16Isa() { return CpuHasDpbf16() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmulBf16, ImplBf16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // W [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaSmallMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
