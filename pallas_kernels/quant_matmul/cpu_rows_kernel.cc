// x times a ggml-quantized base (Q8_0 / Q4_0 / Q4_1 column blocks), plus each row's 1-bit delta:
//   y[m] = x[m] · dequant(W) + α_s ⊙ (x[m] · S_s),   s = slots[m]; s <= 0: the base only.
// W: `blocks.QuantizedKernel` column blocks: qs [K/32, 32|16, N] (q8_0 int8; q4 bytes holding
// weight j in the low nibble and j + 16 in the high one), d (and m for q4_1) f16 [K/32, N].
// Bank row s - first_slot holds slot s (first_slot 1: one variant's bits read in place); S_s in
// the group-local bit-plane layout (`pallas_kernels/bits.py`); α_s one f32 per column.
// x and y f32 (activations are not quantized: no ggml-style q8 activations).
//
// Why: a decode step reads every weight once for a handful of rows, so its time is the bytes
// of W; the blocks are 0.53-0.63 bytes per weight against 4 for f32. Each block is read once
// per call and dequantized in registers: per 16 columns, the block's 32 values become f32
// vectors (int8 or nibble → int32 → f32; q4_0's −8 applied on the bytes), the rows' partial sums
// over the block are FMA'd in registers and multiplied by d at the block's end (+ m·Σ_block x
// for q4_1, as ggml does). Up to kFuseRows rows take the values straight from registers; more
// rows dequantize the 32x16 tile once into an L1 buffer and run every row over it, so the
// dequantization is paid once per tile whatever the number of rows (prefill chunks).
// The delta: after the thread's block pass, each slot present adds α_s ⊙ (x · S_s) in one pass
// over its bit plane: per packed byte row (8 rows of K) and 16 columns, the bits are widened
// once and each of the 8 rows' ±α vector is a sign select; a slot costs its bits (1 bit per
// weight) and ~2 vector operations per 16 weights, plus one FMA per row.
// Threads: up to kSplitKRows rows split K (each thread streams a contiguous run of blocks
// front to back into its own [M, N] partials, summed at the end, as the f32 rows kernel); more
// rows split the columns (each thread writes its columns of y directly, no partials) and walk
// column panels sized so the panel's [M, NP] sums stay in L2.
//
// Numerics: f32 products and sums; per block Σ x·q in f32 (q exact), times d (f16 widened
// exactly), + m·Σx; the delta adds x·(±α) in f32. Agrees with the f64 definition to f32
// rounding of these sums. Vectors are GCC vector extensions (AVX-512 or AVX2 halves).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"  // pallas_kernels/native, on the include path (pallas_kernels/native/build.py)
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using bitdelta_native::Pool;

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint8_t b16v __attribute__((vector_size(16)));
typedef int8_t s16v __attribute__((vector_size(16)));

enum Format { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

constexpr int64_t kBlock = 32;
constexpr int kFuseRows = 4;      // rows whose values come straight from registers
constexpr int kRowTile = 4;       // rows per register tile over the L1 buffer
constexpr int64_t kSplitKRows = 16;  // up to this many rows: threads split K, else columns

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, 64); }

inline float half1(const uint16_t* p) {
  _Float16 h;
  std::memcpy(&h, p, 2);
  return float(h);
}

inline v16 half16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  v16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  alignas(64) float f[16];
  for (int i = 0; i < 16; ++i) f[i] = half1(p + i);
  return load16(f);
#endif
}

inline v16 widen_s8(s16v b) { return __builtin_convertvector(__builtin_convertvector(b, i16v), v16); }

// 16 int8 weights (q8_0)
inline v16 q8_16(const uint8_t* p) { s16v b; std::memcpy(&b, p, 16); return widen_s8(b); }

// 16 bytes → weights j (low nibbles) and j + 16 (high nibbles); q4_0 centred on the bytes
template <int F>
inline void q4_16(const uint8_t* p, v16* lo, v16* hi) {
  b16v b;
  std::memcpy(&b, p, 16);
  b16v l = b & 15, h = b >> 4;
  if constexpr (F == kQ4_0) {
    *lo = widen_s8(s16v(l) - 8);
    *hi = widen_s8(s16v(h) - 8);
  } else {
    *lo = widen_s8(s16v(l));  // 0..15: the same as unsigned
    *hi = widen_s8(s16v(h));
  }
}

// α where the bit in t's sign position is set, else −α
inline v16 sign_select(u16v t, v16 a, v16 na) {
#if defined(__AVX512F__)
  const __mmask16 k = _mm512_movepi32_mask((__m512i)t);
  return (v16)_mm512_mask_blend_ps(k, (__m512)na, (__m512)a);
#elif defined(__AVX2__)
  __m256 r[2];
  for (int h = 0; h < 2; ++h) {
    __m256 av, nv, tv;
    std::memcpy(&av, reinterpret_cast<const char*>(&a) + 32 * h, 32);
    std::memcpy(&nv, reinterpret_cast<const char*>(&na) + 32 * h, 32);
    std::memcpy(&tv, reinterpret_cast<const char*>(&t) + 32 * h, 32);
    r[h] = _mm256_blendv_ps(nv, av, tv);
  }
  v16 out;
  std::memcpy(&out, r, 64);
  return out;
#else
  return i16v(t) < 0 ? a : na;
#endif
}

struct Args {
  const float* x;      // [M, K]
  const float* sx;     // [M, K/32]: Σ_block x (q4_1)
  const uint8_t* qs;   // [K/32, QR, N]
  const uint16_t* d;   // [K/32, N] f16
  const uint16_t* m;   // [K/32, N] f16 (q4_1)
  const uint8_t* bits;  // [S, KP, N]
  const float* scale;   // [S, N]
  int64_t M, K, N, KP, G, first;
  const std::vector<std::pair<int64_t, std::vector<int64_t>>>* slots;  // (slot, rows), slot > 0
};

constexpr int QRows(int F) { return F == kQ8_0 ? 32 : 16; }

// acc[r, n:n+16] += block b's product for R rows (values dequantized on the fly). Chains: more
// independent partial sums for fewer rows (an FMA's latency, not its throughput, bounds one
// chain).
template <int F, int R>
inline void FusedTile(const Args& a, float* acc, const int64_t* rows, int64_t b, int64_t n) {
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
  const int64_t N = a.N, K = a.K, k = b * kBlock;
  const uint8_t* q = a.qs + b * QRows(F) * N + n;
  const float* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = a.x + rows[i] * K + k;
  v16 s[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) s[i][c] = v16{};
  if constexpr (F == kQ8_0) {
#pragma GCC unroll 32
    for (int j = 0; j < 32; ++j) {
      const v16 w = q8_16(q + j * N);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) s[i][j % C] += xr[i][j] * w;
    }
  } else {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      v16 lo, hi;
      q4_16<F>(q + j * N, &lo, &hi);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        s[i][(2 * j) % C] += xr[i][j] * lo;
        s[i][(2 * j + 1) % C] += xr[i][j + 16] * hi;
      }
    }
  }
  const v16 dv = half16(a.d + b * N + n);
  v16 mv{};
  if constexpr (F == kQ4_1) mv = half16(a.m + b * N + n);
  for (int i = 0; i < R; ++i) {
    v16 t = s[i][0];
    for (int c = 1; c < C; ++c) t += s[i][c];
    float* o = acc + rows[i] * N + n;
    v16 y = load16(o) + dv * t;
    if constexpr (F == kQ4_1) y += a.sx[rows[i] * (K / kBlock) + b] * mv;
    store16(o, y);
  }
}

// The tile's 32 values per column, dequantized once (d not applied) into an L1 buffer.
template <int F>
inline void DequantTile(const Args& a, int64_t b, int64_t n, v16* w) {
  const int64_t N = a.N;
  const uint8_t* q = a.qs + b * QRows(F) * N + n;
  if constexpr (F == kQ8_0) {
#pragma GCC unroll 32
    for (int j = 0; j < 32; ++j) w[j] = q8_16(q + j * N);
  } else {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) q4_16<F>(q + j * N, &w[j], &w[j + 16]);
  }
}

template <int F, int R>
inline void BufferTile(const Args& a, float* acc, const int64_t* rows, int64_t b, int64_t n,
                       const v16* w, v16 dv, v16 mv) {
  const int64_t N = a.N, K = a.K, k = b * kBlock;
  const float* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = a.x + rows[i] * K + k;
  v16 s[R][2];
  for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = v16{};
#pragma GCC unroll 32
  for (int j = 0; j < 32; ++j)
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) s[i][j & 1] += xr[i][j] * w[j];
  for (int i = 0; i < R; ++i) {
    float* o = acc + rows[i] * N + n;
    v16 y = load16(o) + dv * (s[i][0] + s[i][1]);
    if constexpr (F == kQ4_1) y += a.sx[rows[i] * (K / kBlock) + b] * mv;
    store16(o, y);
  }
}

// one column past the last full vector, block b, every row (scalar)
template <int F>
void ScalarColumn(const Args& a, float* acc, int64_t b, int64_t n) {
  const int64_t N = a.N, K = a.K;
  float w[32];
  const uint8_t* q = a.qs + b * QRows(F) * N + n;
  for (int j = 0; j < QRows(F); ++j) {
    if constexpr (F == kQ8_0) {
      w[j] = float(int8_t(q[j * N]));
    } else {
      const int off = F == kQ4_0 ? 8 : 0;
      w[j] = float(int(q[j * N] & 15) - off);
      w[j + 16] = float(int(q[j * N] >> 4) - off);
    }
  }
  const float dv = half1(a.d + b * N + n);
  const float mv = F == kQ4_1 ? half1(a.m + b * N + n) : 0.f;
  for (int64_t r = 0; r < a.M; ++r) {
    const float* xr = a.x + r * K + b * kBlock;
    float s = 0.f;
    for (int j = 0; j < 32; ++j) s += xr[j] * w[j];
    float y = acc[r * N + n] + dv * s;
    if constexpr (F == kQ4_1) y += mv * a.sx[r * (K / kBlock) + b];
    acc[r * N + n] = y;
  }
}

// acc[:, c0:c1] += x[:, blocks b0..b1] · dequant(W)[blocks b0..b1, c0:c1] (c0, c1 multiples of
// 16 or c1 = N: the columns past the last vector are scalar).
template <int F>
void BlockPass(const Args& a, float* acc, int64_t b0, int64_t b1, int64_t c0, int64_t c1,
               const int64_t* all_rows) {
  const int64_t N = a.N, M = a.M, QR = QRows(F);
  const int64_t v1 = std::min(c1, N / 16 * 16);
  // a panel of columns whose [M, NP] sums stay in L2 (decode: every column at once)
  const int64_t np = M <= kSplitKRows ? std::max<int64_t>(v1 - c0, 16)
                                      : std::max<int64_t>(16, (32768 / M) / 16 * 16);
  alignas(64) v16 w[32];
  for (int64_t p0 = c0; p0 < v1; p0 += np) {
    const int64_t p1 = std::min(v1, p0 + np);
    for (int64_t b = b0; b < b1; ++b) {
      const bool more = b + 1 < b1;
      for (int64_t n = p0; n < p1; n += 16) {
        if (more && (n & 63) == 0) {  // the next block's lines at these columns, into L2
          const uint8_t* nq = a.qs + (b + 1) * QR * N + n;
          for (int64_t j = 0; j < QR; ++j) __builtin_prefetch(nq + j * N, 0, 2);
          __builtin_prefetch(a.d + (b + 1) * N + n, 0, 2);
          if (F == kQ4_1) __builtin_prefetch(a.m + (b + 1) * N + n, 0, 2);
        }
        if (M <= kFuseRows) {
          switch (M) {
            case 1: FusedTile<F, 1>(a, acc, all_rows, b, n); break;
            case 2: FusedTile<F, 2>(a, acc, all_rows, b, n); break;
            case 3: FusedTile<F, 3>(a, acc, all_rows, b, n); break;
            default: FusedTile<F, 4>(a, acc, all_rows, b, n); break;
          }
          continue;
        }
        DequantTile<F>(a, b, n, w);
        const v16 dv = half16(a.d + b * N + n);
        v16 mv{};
        if constexpr (F == kQ4_1) mv = half16(a.m + b * N + n);
        int64_t i = 0;
        for (; i + kRowTile <= M; i += kRowTile)
          BufferTile<F, kRowTile>(a, acc, all_rows + i, b, n, w, dv, mv);
        switch (M - i) {
          case 1: BufferTile<F, 1>(a, acc, all_rows + i, b, n, w, dv, mv); break;
          case 2: BufferTile<F, 2>(a, acc, all_rows + i, b, n, w, dv, mv); break;
          case 3: BufferTile<F, 3>(a, acc, all_rows + i, b, n, w, dv, mv); break;
          default: break;
        }
      }
    }
  }
  if (c1 == N)
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t n = N / 16 * 16; n < N; ++n) ScalarColumn<F>(a, acc, b, n);
}

// acc[r, c0:c1] += α_s ⊙ (x[r, k0:k1] · S_s[k0:k1, c0:c1]) for every slot's rows: per packed
// byte row (rows g*G + j*P + p of K, j = 0..7) the 16 columns' bytes are widened once and bit
// j selects +α or −α; rows of K outside [k0, k1) count with x = 0.
void DeltaPass(const Args& a, float* acc, int64_t k0, int64_t k1, int64_t c0, int64_t c1) {
  const int64_t N = a.N, K = a.K, G = a.G, P = G / 8;
  const int64_t v1 = std::min(c1, N / 16 * 16);
  thread_local std::vector<float> xv_buf;
  for (const auto& [slot, rows] : *a.slots) {
    const int64_t nr = int64_t(rows.size());
    xv_buf.resize(nr * 8);
    float* xv = xv_buf.data();
    const uint8_t* plane = a.bits + (slot - a.first) * a.KP * N;
    const float* al = a.scale + (slot - a.first) * N;
    for (int64_t g = k0 / G; g * G < k1; ++g)
      for (int64_t p = 0; p < P; ++p) {
        bool any = false;
        for (int j = 0; j < 8; ++j) {
          const int64_t k = g * G + j * P + p;
          const bool in = k >= k0 && k < k1;
          any |= in;
          for (int64_t i = 0; i < nr; ++i) xv[i * 8 + j] = in ? a.x[rows[i] * K + k] : 0.f;
        }
        if (!any) continue;
        const uint8_t* br = plane + (g * P + p) * N;
        for (int64_t n = c0; n < v1; n += 16) {
          b16v bb;
          std::memcpy(&bb, br + n, 16);
          const u16v bw = __builtin_convertvector(bb, u16v);
          const v16 av = load16(al + n), na = -av;
          v16 sa[8];
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) sa[j] = sign_select(bw << (31 - j), av, na);
          for (int64_t i = 0; i < nr; ++i) {
            float* o = acc + rows[i] * N + n;
            const float* xi = xv + i * 8;
            v16 s0 = xi[0] * sa[0], s1 = xi[1] * sa[1];
#pragma GCC unroll 8
            for (int j = 2; j < 8; j += 2) {
              s0 += xi[j] * sa[j];
              s1 += xi[j + 1] * sa[j + 1];
            }
            store16(o, load16(o) + (s0 + s1));
          }
        }
        if (c1 == N)
          for (int64_t n = N / 16 * 16; n < N; ++n)
            for (int j = 0; j < 8; ++j) {
              const float s = (br[n] >> j) & 1 ? al[n] : -al[n];
              for (int64_t i = 0; i < nr; ++i) acc[rows[i] * N + n] += xv[i * 8 + j] * s;
            }
      }
  }
}

template <int F>
void Work(const Args& a, float* acc, int64_t b0, int64_t b1, int64_t c0, int64_t c1,
          const int64_t* all_rows) {
  for (int64_t r = 0; r < a.M; ++r) std::fill(acc + r * a.N + c0, acc + r * a.N + c1, 0.f);
  BlockPass<F>(a, acc, b0, b1, c0, c1, all_rows);
  if (!a.slots->empty()) DeltaPass(a, acc, b0 * kBlock, b1 * kBlock, c0, c1);
}

ffi::Error Run(int fmt, const Args& a0, float* y) {
  Args a = a0;
  const int64_t M = a.M, K = a.K, N = a.N, nb = K / kBlock;
  if (M == 0 || N == 0) return ffi::Error::Success();
  std::vector<int64_t> all_rows(M);
  for (int64_t r = 0; r < M; ++r) all_rows[r] = r;
  std::vector<float> sx;
  if (fmt == kQ4_1) {
    sx.resize(M * nb);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int j = 0; j < kBlock; ++j) s += a.x[r * K + b * kBlock + j];
        sx[r * nb + b] = s;
      }
    a.sx = sx.data();
  }
  auto work = [&](float* acc, int64_t b0, int64_t b1, int64_t c0, int64_t c1) {
    if (fmt == kQ8_0) Work<kQ8_0>(a, acc, b0, b1, c0, c1, all_rows.data());
    else if (fmt == kQ4_0) Work<kQ4_0>(a, acc, b0, b1, c0, c1, all_rows.data());
    else Work<kQ4_1>(a, acc, b0, b1, c0, c1, all_rows.data());
  };
  Pool& pool = Pool::get();
  const bool small = M * K * N < (int64_t(1) << 16);
  if (M > kSplitKRows) {  // columns per thread, in whole vectors; the last takes the tail
    const int64_t nv = N / 16;
    int chunks = small || nv == 0 ? 1 : int(std::min<int64_t>(pool.size(), nv));
    const int64_t per = (nv + chunks - 1) / std::max(chunks, 1);
    chunks = per == 0 ? 1 : int((nv + per - 1) / per);
    pool.run([&](int c) {
      const int64_t c0 = c * per * 16;
      const int64_t c1 = c == chunks - 1 ? N : std::min(N, (c + 1) * per * 16);
      work(y, 0, nb, c0, c1);
    }, std::max(chunks, 1));
    return ffi::Error::Success();
  }
  // K split into runs of whole blocks (of whole bit groups when there are enough of them)
  int chunks = small ? 1 : pool.size();
  int64_t unit = 1;
  const int64_t g_blocks = (a.G % kBlock == 0) ? a.G / kBlock : 0;
  if (!a.slots->empty() && g_blocks > 0 && nb / g_blocks >= chunks) unit = g_blocks;
  int64_t per = (nb + chunks - 1) / chunks;
  per = (per + unit - 1) / unit * unit;
  chunks = int((nb + per - 1) / per);
  thread_local std::vector<float> scratch;  // the partials of chunks 1.. (chunk 0's: y)
  const int64_t part = M * N;
  if (int64_t(scratch.size()) < (chunks - 1) * part) scratch.resize((chunks - 1) * part);
  float* parts = scratch.data();
  pool.run([&](int c) {
    work(c == 0 ? y : parts + (c - 1) * part, c * per, std::min(nb, (c + 1) * per), 0, N);
  }, chunks);
  for (int c = 1; c < chunks; ++c) {
    const float* p = parts + (c - 1) * part;
    for (int64_t i = 0; i < part; ++i) y[i] += p[i];
  }
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qs, ffi::Buffer<ffi::F16> d,
                ffi::Buffer<ffi::F16> m, ffi::Buffer<ffi::U8> bits, ffi::Buffer<ffi::F32> scale,
                ffi::Buffer<ffi::S32> slots, ffi::ResultBuffer<ffi::F32> y, int64_t fmt,
                int64_t group_k, int64_t first_slot, int64_t delta) {
  auto xd = x.dimensions();
  auto qd = qs.dimensions();
  auto dd = d.dimensions();
  if (fmt < 0 || fmt > 2) return ffi::Error::InvalidArgument("quant_rows: unknown format");
  const int64_t qr = fmt == kQ8_0 ? 32 : 16;
  if (xd.size() != 2 || qd.size() != 3 || qd[1] != qr || xd[1] != qd[0] * kBlock ||
      dd.size() != 2 || dd[0] != qd[0] || dd[1] != qd[2])
    return ffi::Error::InvalidArgument("quant_rows: expected x[M,K], qs[K/32,32|16,N], d[K/32,N]");
  const auto qt = qs.element_type();
  if (qt != (fmt == kQ8_0 ? ffi::DataType::S8 : ffi::DataType::U8))
    return ffi::Error::InvalidArgument("quant_rows: qs is int8 for q8_0, uint8 for q4_0/q4_1");
  if (fmt == kQ4_1 && (m.dimensions().size() != 2 || m.dimensions()[0] != dd[0] ||
                       m.dimensions()[1] != dd[1]))
    return ffi::Error::InvalidArgument("quant_rows: q4_1 needs m[K/32,N]");
  const int64_t M = xd[0], K = xd[1], N = qd[2];
  std::vector<std::pair<int64_t, std::vector<int64_t>>> groups;
  int64_t S = 0, KP = 0;
  if (delta) {
    auto bd = bits.dimensions();
    auto sd = scale.dimensions();
    if (bd.size() != 3 || bd[2] != N || bd[1] * 8 < K || sd.size() != 2 || sd[0] != bd[0] ||
        sd[1] != N || slots.dimensions().size() != 1 || slots.dimensions()[0] != M)
      return ffi::Error::InvalidArgument(
          "quant_rows: expected bits[S,KP,N], scale[S,N] and slots[M] matching x and W");
    if (first_slot < 0 || first_slot > 1)
      return ffi::Error::InvalidArgument("quant_rows: first_slot must be 0 or 1");
    if (group_k <= 0 || group_k % 8 || bd[1] % (group_k / 8))
      return ffi::Error::InvalidArgument("quant_rows: group_k must be a multiple of 8 dividing 8*KP");
    S = bd[0];
    KP = bd[1];
    const int32_t* sl = slots.typed_data();
    for (int64_t r = 0; r < M; ++r) {
      const int64_t s = sl[r];
      if (s <= 0) continue;
      if (s < first_slot || s - first_slot >= S)
        return ffi::Error::InvalidArgument("quant_rows: a slot id is past the bank");
      auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == s; });
      if (it == groups.end()) groups.push_back({s, {r}});
      else it->second.push_back(r);
    }
  }
  Args a{x.typed_data(), nullptr, static_cast<const uint8_t*>(qs.untyped_data()),
         reinterpret_cast<const uint16_t*>(d.untyped_data()),
         reinterpret_cast<const uint16_t*>(m.untyped_data()), bits.typed_data(),
         scale.typed_data(), M, K, N, KP, delta ? group_k : 8, first_slot, &groups};
  return Run(int(fmt), a, y->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaQuantRows, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // qs [K/32, 32|16, N]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // d [K/32, N]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // m [K/32, N] (q4_1) or d
                                  .Arg<ffi::Buffer<ffi::U8>>()   // bits [S, KP, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [S, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [M]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group_k")
                                  .Attr<int64_t>("first_slot")
                                  .Attr<int64_t>("delta"));
