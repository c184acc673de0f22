// Paged attention on the host CPU (decode lanes; packed prompt chunks below), read from the
// paged KV pools.
//
// Why: the jnp reference (`reference.decode_lanes`) gathers every lane's pages out of the pools
// (`k_pool[layer, pages]`, a copy) for a fixed number of blocks (the longest lane's), then
// contracts. Here each lane walks only its own lane's live pages through its
// page table, reads each key/value row where it lies in the pool, and keeps the query heads'
// online softmax in L1. A persistent thread pool splits the lanes (or, with fewer lanes than
// threads, the (lane, KV head) pairs).
// Numerics: scores q·k in f32 times the scale, online softmax in f32 per page (the reference
// rescales per block of pages: the same sums in another order, agreeing to rounding); for bf16
// pools the probabilities are rounded to bf16 before p·v, as the reference's
// `p.astype(v.dtype)` does, products and sums in f32. The f32 vectors are GCC generic vectors:
// AVX-512 code under -march=native on an AVX-512 machine, AVX2/SSE or scalar code elsewhere.
//
// `BitdeltaPagedWrite` stores new K/V rows into a pool in place (the result aliases the pool):
// XLA's CPU backend computes a bf16 scatter in f32, converting the whole pool there and back
// every layer, so a bf16 step's cost grew with the pool's size, not with the tokens written.
// `BitdeltaPagedPrefill` is the packed-prefill pass (`reference.packed_prefill`): each prompt
// token against its own sequence's pages only, a flash-attention loop (described at the kernel).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "pool.h"  // pallas_kernels/native, on the include path (native/build.py)
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));

using bitdelta_native::Pool;  // the process's one pool (pallas_kernels/native/pool.h)

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float round_bf16(float f) {  // round to nearest even, as XLA's f32 -> bf16 convert
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return f;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// A pool row as f32: f32 rows are used in place, bf16 rows widened into `tmp`.
inline const float* Row(const float* p, float*, int64_t) { return p; }
inline const float* Row(const uint16_t* p, float* tmp, int64_t d) {
  for (int64_t i = 0; i < d; ++i) tmp[i] = bf16_to_f32(p[i]);  // vectorized by the compiler
  return tmp;
}

// The sum of a vector's lanes as a tree (16 dependent scalar adds would be the bottleneck).
inline float HSum(v16 a) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 lo, hi;
  std::memcpy(&lo, &a, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + 32, 32);
  lo += hi;
  v4 l4, h4;
  std::memcpy(&l4, &lo, 16);
  std::memcpy(&h4, reinterpret_cast<const char*>(&lo) + 16, 16);
  l4 += h4;
  return (l4[0] + l4[2]) + (l4[1] + l4[3]);
}

inline float Dot(const float* a, const float* b, int64_t d) {
  v16 acc0 = {}, acc1 = {};
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    acc0 += load16(a + i) * load16(b + i);
    acc1 += load16(a + i + 16) * load16(b + i + 16);
  }
  for (; i + 16 <= d; i += 16) acc0 += load16(a + i) * load16(b + i);
  float s = HSum(acc0 + acc1);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void Prefetch(const void* k, const void* v, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) {
    __builtin_prefetch(static_cast<const char*>(k) + c);
    __builtin_prefetch(static_cast<const char*>(v) + c);
  }
}

struct Args {
  const float* q;        // [R, H, D] f32
  const void* k;         // [L, NP, PS, KV, D]
  const void* v;
  const int32_t* pages;  // [R, P]
  const int32_t* len;    // [R]
  float* out;            // [R, H, D] f32
  int64_t L, NP, PS, KV, D, G, P, layer, window;
  float scale;
};

// One lane's attention for the query heads of KV heads [h0, h1): the lane's live pages are
// walked once, each key/value row of those heads read where it lies in the pool.
template <typename T>
void Lane(const Args& a, int64_t r, int64_t h0, int64_t h1) {
  const int64_t G = a.G, D = a.D, PS = a.PS, NH = (h1 - h0) * G;  // NH query heads
  float* out = a.out + (r * a.KV + h0) * G * D;
  const float* q = a.q + (r * a.KV + h0) * G * D;
  const int64_t len = std::min<int64_t>(a.len[r], a.P * PS);
  const int64_t start = std::max<int64_t>(0, len - a.window);  // keys > (len - 1) - window
  if (len <= 0 || start >= len) {
    std::fill(out, out + NH * D, 0.f);
    return;
  }
  std::vector<float> buf(NH * D + NH * PS + 2 * NH + D);
  float* acc = buf.data();           // [NH, D]
  float* s = acc + NH * D;           // [NH, PS] scores, then probabilities
  float* mx = s + NH * PS;           // [NH] running max
  float* tot = mx + NH;              // [NH] running sum of exponentials
  float* tmp = tot + NH;             // [D] a widened bf16 row
  std::fill(mx, mx + NH, -std::numeric_limits<float>::infinity());
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  const int64_t row = a.KV * D;  // elements between consecutive keys of one page
  for (int64_t pi = start / PS; pi * PS < len; ++pi) {
    const int64_t page = std::clamp<int64_t>(a.pages[r * a.P + pi], 0, a.NP - 1);
    const int64_t t0 = std::max<int64_t>(start - pi * PS, 0);
    const int64_t t1 = std::min<int64_t>(len - pi * PS, PS);
    const int64_t base = ((a.layer * a.NP + page) * PS) * row;
    // The next page's rows are requested while this one is computed: pages lie anywhere in the
    // pool, and without this the loads wait on memory one cache line at a time.
    const bool more = (pi + 1) * PS < len;
    const int64_t next = more ? ((a.layer * a.NP + std::clamp<int64_t>(
        a.pages[r * a.P + pi + 1], 0, a.NP - 1)) * PS) * row : 0;
    for (int64_t t = t0; t < t1; ++t) {
      if (more) Prefetch(kp + next + t * row + h0 * D, vp + next + t * row + h0 * D,
                         (h1 - h0) * D * int64_t(sizeof(T)));
      for (int64_t h = h0; h < h1; ++h) {
        const float* kr = Row(kp + base + t * row + h * D, tmp, D);
        for (int64_t g = (h - h0) * G; g < (h - h0 + 1) * G; ++g)
          s[g * PS + t] = Dot(q + g * D, kr, D) * a.scale;
      }
    }
    for (int64_t g = 0; g < NH; ++g) {
      float* sg = s + g * PS;
      float m = mx[g];
      for (int64_t t = t0; t < t1; ++t) m = std::max(m, sg[t]);
      const float corr = std::isinf(mx[g]) ? 0.f : std::exp(mx[g] - m);
      float sum = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        const float p = std::exp(sg[t] - m);
        sum += p;
        sg[t] = sizeof(T) == 2 ? round_bf16(p) : p;
      }
      tot[g] = tot[g] * corr + sum;
      mx[g] = m;
      float* ag = acc + g * D;
      for (int64_t i = 0; i < D; ++i) ag[i] *= corr;
    }
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = h0; h < h1; ++h) {
        const float* vr = Row(vp + base + t * row + h * D, tmp, D);
        for (int64_t g = (h - h0) * G; g < (h - h0 + 1) * G; ++g) {
          const float p = s[g * PS + t];
          float* ag = acc + g * D;
          for (int64_t i = 0; i < D; ++i) ag[i] += p * vr[i];
        }
      }
  }
  for (int64_t g = 0; g < NH; ++g) {
    const float inv = std::max(tot[g], 1e-30f);
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = acc[g * D + i] / inv;
  }
}

template <typename T>
void Run(const Args& a, int64_t R) {
  int64_t work = 0;  // multiply-adds, to decide whether threads pay
  for (int64_t r = 0; r < R; ++r) work += std::max<int32_t>(a.len[r], 0);
  work *= a.KV * a.G * a.D * 2;
  if (work < (int64_t(1) << 17)) {
    for (int64_t r = 0; r < R; ++r) Lane<T>(a, r, 0, a.KV);
    return;
  }
  Pool& pool = Pool::get();
  if (R >= pool.size()) {  // a task per lane: each page is read once
    pool.run([&](int r) { Lane<T>(a, r, 0, a.KV); }, int(R));
  } else {  // few lanes: a task per (lane, KV head)
    pool.run([&](int i) { Lane<T>(a, i / a.KV, i % a.KV, i % a.KV + 1); }, int(R * a.KV));
  }
}

ffi::Error Impl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                ffi::Buffer<ffi::S32> len, ffi::Buffer<ffi::S32> window,
                ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto pd = pages.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2 || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: expected q[R,H,D], pools[L,NP,PS,KV,D] of one dtype, pages[R,P]");
  Args a;
  a.L = kd[0]; a.NP = kd[1]; a.PS = kd[2]; a.KV = kd[3]; a.D = kd[4];
  const int64_t R = qd[0], H = qd[1];
  if (qd[2] != a.D || H % a.KV != 0 || pd[0] != R || len.dimensions()[0] != R)
    return ffi::Error::InvalidArgument("paged_attention_cpu: inconsistent shapes");
  a.G = H / a.KV; a.P = pd[1];
  int64_t layer_i = layer.typed_data()[0];
  if (layer_i < 0) layer_i += a.L;  // jnp indexing: negative from the end, then clamped
  a.layer = std::clamp<int64_t>(layer_i, 0, a.L - 1);
  a.window = window.typed_data()[0];
  a.scale = scale;
  a.q = q.typed_data(); a.k = k.untyped_data(); a.v = v.untyped_data();
  a.pages = pages.typed_data(); a.len = len.typed_data(); a.out = out->typed_data();
  switch (k.element_type()) {
    case ffi::DataType::F32: Run<float>(a, R); break;
    case ffi::DataType::BF16: Run<uint16_t>(a, R); break;
    default: return ffi::Error::InvalidArgument("paged_attention_cpu: pools must be f32 or bf16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaPagedDecode, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [R, H, D]
                                  .Arg<ffi::AnyBuffer>()          // k_pool [L, NP, PS, KV, D]
                                  .Arg<ffi::AnyBuffer>()          // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lane_pages [R, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lane_len [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [R, H, D]
                                  .Attr<float>("scale"));

namespace {

// pool [..., W] viewed as rows of W elements; rows[t] >= 0 names the row src[t] replaces (rows
// out of range are skipped). The result is the pool's own buffer (input_output_aliases).
ffi::Error WriteImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer src,
                     ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions();
  auto sd = src.dimensions();
  const int64_t T = rows.element_count();
  if (pool.element_type() != src.element_type() || pd.size() < 2 || sd.size() < 1 ||
      sd[0] != T || pd[pd.size() - 1] != sd[sd.size() - 1])
    return ffi::Error::InvalidArgument(
        "paged_write_cpu: expected pool[..., W], rows[T], src[T, ..., W] of the pool's dtype");
  const int64_t total = pool.element_count();
  const int64_t width = T ? src.element_count() / T : 0;  // elements of one row
  if (width == 0 || total % width != 0)
    return ffi::Error::InvalidArgument("paged_write_cpu: pool rows do not match src rows");
  const int64_t n_rows = total / width;
  const size_t bytes = size_t(width) * ffi::ByteWidth(pool.element_type());
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data())  // not aliased (XLA keeps the alias; this is only a guard)
    std::memcpy(dst, pool.untyped_data(), size_t(total) * ffi::ByteWidth(pool.element_type()));
  const char* s = static_cast<const char*>(src.untyped_data());
  const int32_t* r = rows.typed_data();
  for (int64_t t = 0; t < T; ++t)
    if (r[t] >= 0 && r[t] < n_rows) std::memcpy(dst + size_t(r[t]) * bytes, s + t * bytes, bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaPagedWrite, WriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pool [L, NP, PS, KV, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows [T]
                                  .Arg<ffi::AnyBuffer>()          // src [T, KV, D]
                                  .Ret<ffi::AnyBuffer>());        // the pool, aliased

namespace {

// ---- Packed prefill: the prompt chunks' tokens against their own sequences' pages ----
//
// `reference.packed_prefill` scores every packed token against every page of the step (all
// sequences, the whole block loop) and masks; here each (tile of one sequence's tokens, KV head)
// walks only its sequence's pages, in order of position, up to the tile's last position: a
// flash-attention loop over chunks of 16 keys.
//   1. Every prompt page's keys and values are copied once per call as f32 into chunks of 16
//      rows (values with non-finite entries zeroed: the reference's P·V reads them as 0).
//   2. Tasks (tile, KV head), the longest first. The tile's queries are transposed (`Qᵀ
//      [D][rows]`) so that a vector spans 16 rows: Sᵀ for 16 rows x 16 keys is 16
//      accumulators of broadcast-FMAs, and the online softmax (masks, maxima, rescale factors,
//      exponentials, sums) is vector code across rows with no horizontal reduction. Then
//      acc = acc·corr + P·V for 4 rows x 64 columns at a time.
// Numerics: f32 scores times the scale, max-subtracted exponentials (a polynomial e^x good to
// ~2 ulp, `Exp16`; XLA's CPU exp is a polynomial too), probabilities rounded to bf16 for bf16
// pools before P·V (the reference's `p.astype(v.dtype)`), sums in another order: results agree
// with the reference to rounding. A key counts for a query iff same sequence, row < page_fill,
// position <= the query's and > position - window. A token with no key gets zeros.

typedef int32_t vi16 __attribute__((vector_size(64)));

inline v16 Splat(float f) { return v16{} + f; }

// e^x, 16 lanes (Cephes' expf): x = n·ln2 + r, e^r by a degree-6 polynomial, 2^n from the bits.
// Below -87.3 (and -inf) it is 0.
inline v16 Exp16(v16 x) {
  const vi16 under = x < Splat(-87.3365447504f);
  x = x > Splat(88.0f) ? Splat(88.0f) : x;
  x = x < Splat(-87.3365447504f) ? Splat(-87.3365447504f) : x;
  v16 n = x * 1.44269504088896341f + 12582912.f;  // round to nearest by the 1.5·2^23 trick
  n = n - 12582912.f;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 y = Splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 pw;
  std::memcpy(&pw, &e, 64);
  y = y * pw;
  return under ? Splat(0.f) : y;
}

inline v16 RoundBf16(v16 p) {  // round to nearest even, for finite lanes
  vi16 u;
  std::memcpy(&u, &p, 64);
  u = (u + 0x7fff + ((u >> 16) & 1)) & int32_t(0xffff0000u);
  std::memcpy(&p, &u, 64);
  return p;
}

constexpr int64_t kKeys = 16;    // keys per chunk (one vector of scores)
constexpr int64_t kTileRows = 64;  // query rows (tokens x heads of a group) per task, about

struct PrefillArgs {
  const float* q;  // [N, H, D]
  float* out;      // [N, H, D]
  const int32_t* pos;  // [N]
  int64_t H, KV, D, Dp, G, window, CP;  // Dp: D rounded up to 64; CP: chunks per page
  float scale;
  bool bf16;
  const float* kc;  // [pages, KV, CP, 16, D] keys
  const float* vs;  // [pages, KV, CP, 16, Dp] values, non-finite entries 0
};

struct SeqPage { int64_t start, fill, compact; };  // a prompt page, in position order

struct Tile {
  const int64_t* tok;  // the tile's tokens (indices into N), in position order
  int64_t n;
  const SeqPage* pages;  // its sequence's pages
  int64_t npages;
};

// Scratch grown once per thread (worker or caller) and kept: a call's buffers are a few MB.
inline float* Scratch(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

void PrefillTask(const PrefillArgs& a, const Tile& t, int64_t h) {
  const int64_t G = a.G, D = a.D, Dp = a.Dp, H = a.H;
  const int64_t rows = t.n * G, rp = (rows + 15) / 16 * 16;  // rows: (token, head) pairs
  thread_local std::vector<float> buf;
  float* qt = Scratch(buf, size_t(rp) * (D + Dp + kKeys + 3));
  float* acc = qt + D * rp;            // [rp, Dp] running P·V
  float* st = acc + rp * Dp;           // [16, rp] a chunk's scores, then probabilities
  float* mx = st + kKeys * rp;         // [rp] running max
  float* tot = mx + rp;                // [rp] running sum of exponentials
  float* rpos = tot + rp;              // [rp] each row's query position (padding: no key)
  std::fill(qt, qt + D * rp, 0.f);
  std::fill(acc, acc + rp * Dp, 0.f);
  std::fill(mx, mx + rp, -std::numeric_limits<float>::infinity());
  std::fill(tot, tot + rp, 0.f);
  std::fill(rpos, rpos + rp, -2.f * float(1 << 30));
  int64_t pmin = std::numeric_limits<int32_t>::max(), pmax = -1;
  for (int64_t i = 0; i < t.n; ++i) {  // Qᵀ: a column per row, so a vector spans 16 rows
    const int64_t n = t.tok[i];
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = a.q + (n * H + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) qt[d * rp + i * G + g] = qr[d];
      rpos[i * G + g] = float(a.pos[n]);
    }
    pmin = std::min<int64_t>(pmin, a.pos[n]);
    pmax = std::max<int64_t>(pmax, a.pos[n]);
  }
  const v16 ninf = Splat(-std::numeric_limits<float>::infinity()), zero = Splat(0.f);
  const float win = float(std::min<int64_t>(a.window, int64_t(1) << 30));
  for (int64_t pi = 0; pi < t.npages; ++pi) {
    const SeqPage& pg = t.pages[pi];
    if (pg.start > pmax) break;  // pages are in position order: every later key is too late
    for (int64_t c = 0; c < a.CP; ++c) {
      const int64_t k0 = pg.start + c * kKeys, nk = std::min<int64_t>(kKeys, pg.fill - c * kKeys);
      if (nk <= 0 || k0 > pmax) break;
      if (k0 + nk - 1 <= pmin - a.window) continue;  // older than every query's window
      // every key visible to every row: no mask
      const bool full = nk == kKeys && k0 + nk - 1 <= pmin && k0 > pmax - a.window;
      const int64_t blk = (pg.compact * a.KV + h) * a.CP + c;
      const float* kc = a.kc + blk * kKeys * D;
      const float* vs = a.vs + blk * kKeys * Dp;
      for (int64_t r0 = 0; r0 < rp; r0 += 16) {
        // Sᵀ for 16 rows: sc[j] = the rows' scores against key j
        v16 sc[kKeys] = {};
        for (int64_t d = 0; d < D; ++d) {
          const v16 qv = load16(qt + d * rp + r0);
          for (int j = 0; j < kKeys; ++j) sc[j] += kc[j * D + d] * qv;
        }
        const v16 rp16 = load16(rpos + r0);
        v16 m = ninf;
        for (int j = 0; j < kKeys; ++j) {
          sc[j] *= a.scale;
          if (!full) {
            const float kpos = float(k0 + j);
            const vi16 ok = (rp16 >= kpos) & (rp16 < kpos + win);
            sc[j] = j < nk ? (ok ? sc[j] : ninf) : ninf;
          }
          m = m > sc[j] ? m : sc[j];
        }
        // as the reference: a max still -inf subtracts 0; a previous max of -inf rescales by 0
        const v16 mo = load16(mx + r0);
        const v16 mn = mo > m ? mo : m;
        const v16 safe = (mn - mn) == 0 ? mn : zero;
        const v16 corr = (mo - mo) == 0 ? Exp16(mo - safe) : zero;
        v16 sum = zero;
        for (int j = 0; j < kKeys; ++j) {
          v16 p = Exp16(sc[j] - safe);  // masked: e^-inf = 0
          sum += p;  // the reference sums P before rounding it for P·V
          if (a.bf16) p = RoundBf16(p);
          std::memcpy(st + j * rp + r0, &p, 64);
        }
        const v16 tn = load16(tot + r0) * corr + sum;
        std::memcpy(tot + r0, &tn, 64);
        std::memcpy(mx + r0, &mn, 64);
        // acc = acc·corr + P·V, 4 rows x 64 columns at a time
        for (int64_t r1 = r0; r1 < r0 + 16; r1 += 4)
          for (int64_t dc = 0; dc < Dp; dc += 64) {
            v16 ac[4][4];
            for (int r = 0; r < 4; ++r)
              for (int i = 0; i < 4; ++i)
                ac[r][i] = load16(acc + (r1 + r) * Dp + dc + 16 * i) * corr[r1 - r0 + r];
            for (int64_t j = 0; j < nk; ++j) {
              const float* vr = vs + j * Dp + dc;
              const v16 v0 = load16(vr), v1 = load16(vr + 16), v2 = load16(vr + 32),
                        v3 = load16(vr + 48);
              for (int r = 0; r < 4; ++r) {
                const float p = st[j * rp + r1 + r];
                ac[r][0] += p * v0;
                ac[r][1] += p * v1;
                ac[r][2] += p * v2;
                ac[r][3] += p * v3;
              }
            }
            for (int r = 0; r < 4; ++r)
              for (int i = 0; i < 4; ++i)
                std::memcpy(acc + (r1 + r) * Dp + dc + 16 * i, &ac[r][i], 64);
          }
      }
    }
  }
  for (int64_t i = 0; i < t.n; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float inv = std::max(tot[r], 1e-30f);
      float* o = a.out + (t.tok[i] * H + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[r * Dp + d] / inv;
    }
}

// Step 1: page `pages[u]`'s keys and values of KV head h copied into 16-key chunks as f32 (rows
// past `fill` and columns past D zero, non-finite values 0).
template <typename T>
void PackPage(const PrefillArgs& a, const T* k, const T* v, int64_t base, int64_t fill,
              int64_t compact, int64_t h, float* kc_all, float* vs_all) {
  const int64_t D = a.D, Dp = a.Dp, row = a.KV * D;
  thread_local std::vector<float> tmp_buf;
  float* tmp = Scratch(tmp_buf, size_t(D));  // a widened bf16 row
  for (int64_t c = 0; c < a.CP; ++c) {
    const int64_t blk = (compact * a.KV + h) * a.CP + c;
    float* kc = kc_all + blk * kKeys * D;
    float* vs = vs_all + blk * kKeys * Dp;
    std::fill(kc, kc + D * kKeys, 0.f);
    std::fill(vs, vs + kKeys * Dp, 0.f);
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t t = c * kKeys + j;
      if (t >= fill) break;
      const float* kr = Row(k + base + t * row + h * D, tmp, D);
      std::memcpy(kc + j * D, kr, D * sizeof(float));
      const float* vr = Row(v + base + t * row + h * D, tmp, D);
      for (int64_t d = 0; d < D; ++d) vs[j * Dp + d] = std::isfinite(vr[d]) ? vr[d] : 0.f;
    }
  }
}

ffi::Error PrefillImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> token_seq,
                       ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> pages,
                       ffi::Buffer<ffi::S32> page_seq, ffi::Buffer<ffi::S32> page_start,
                       ffi::Buffer<ffi::S32> page_fill, ffi::Buffer<ffi::S32> window,
                       ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument(
        "paged_prefill_cpu: expected q[N,H,D], pools[L,NP,PS,KV,D] of one dtype");
  const int64_t N = qd[0], L = kd[0], NP = kd[1], PS = kd[2], U = pages.element_count();
  PrefillArgs a;
  a.H = qd[1]; a.KV = kd[3]; a.D = kd[4];
  if (qd[2] != a.D || a.H % a.KV != 0 || token_seq.element_count() != N ||
      positions.element_count() != N || page_seq.element_count() != U ||
      page_start.element_count() != U || page_fill.element_count() != U)
    return ffi::Error::InvalidArgument("paged_prefill_cpu: inconsistent shapes");
  const bool bf16 = k.element_type() == ffi::DataType::BF16;
  if (!bf16 && k.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("paged_prefill_cpu: pools must be f32 or bf16");
  a.G = a.H / a.KV; a.Dp = (a.D + 63) / 64 * 64; a.CP = (PS + kKeys - 1) / kKeys;
  a.window = window.typed_data()[0];
  a.scale = scale; a.bf16 = bf16;
  a.q = q.typed_data(); a.out = out->typed_data(); a.pos = positions.typed_data();
  int64_t li = layer.typed_data()[0];
  if (li < 0) li += L;
  li = std::clamp<int64_t>(li, 0, L - 1);
  std::fill(a.out, a.out + N * a.H * a.D, 0.f);
  // the prompt pages, by sequence then position; the prompt tokens, by sequence then position
  const int32_t *ps = page_seq.typed_data(), *pst = page_start.typed_data(),
                *pf = page_fill.typed_data(), *pgs = pages.typed_data(),
                *ts = token_seq.typed_data();
  std::vector<int64_t> pidx, tidx;
  for (int64_t u = 0; u < U; ++u)
    if (ps[u] >= 0 && pf[u] > 0) pidx.push_back(u);
  for (int64_t n = 0; n < N; ++n)
    if (ts[n] >= 0) tidx.push_back(n);
  if (pidx.empty() || tidx.empty()) return ffi::Error::Success();
  std::sort(pidx.begin(), pidx.end(), [&](int64_t x, int64_t y) {
    return ps[x] != ps[y] ? ps[x] < ps[y] : pst[x] != pst[y] ? pst[x] < pst[y] : x < y; });
  std::sort(tidx.begin(), tidx.end(), [&](int64_t x, int64_t y) {
    return ts[x] != ts[y] ? ts[x] < ts[y] : a.pos[x] != a.pos[y] ? a.pos[x] < a.pos[y] : x < y; });
  const int64_t P = int64_t(pidx.size());
  std::vector<SeqPage> sp(P);
  for (int64_t i = 0; i < P; ++i)
    sp[i] = {pst[pidx[i]], std::min<int64_t>(pf[pidx[i]], PS), i};
  // step 1: transpose keys, copy values (a task per page and KV head)
  thread_local std::vector<float> packed;
  const size_t kc_n = size_t(P) * a.KV * a.CP * a.D * kKeys;
  float* kc = Scratch(packed, kc_n + size_t(P) * a.KV * a.CP * kKeys * a.Dp);
  float* vs = kc + kc_n;
  a.kc = kc; a.vs = vs;
  const int64_t row_elems = PS * a.KV * a.D;
  auto pack = [&](int i) {
    const int64_t u = pidx[i / a.KV], h = i % a.KV;
    const int64_t page = std::clamp<int64_t>(pgs[u], 0, NP - 1);
    const int64_t base = (li * NP + page) * row_elems;
    if (bf16)
      PackPage(a, static_cast<const uint16_t*>(k.untyped_data()),
               static_cast<const uint16_t*>(v.untyped_data()), base, sp[i / a.KV].fill,
               i / a.KV, h, kc, vs);
    else
      PackPage(a, static_cast<const float*>(k.untyped_data()),
               static_cast<const float*>(v.untyped_data()), base, sp[i / a.KV].fill, i / a.KV,
               h, kc, vs);
  };
  Pool& pool = Pool::get();
  pool.run(pack, int(P * a.KV));
  // step 2: tiles of about kTileRows rows of one sequence's tokens, a task per (tile, KV head)
  const int64_t per_tile = std::max<int64_t>(1, kTileRows / a.G);
  std::vector<Tile> tiles;
  for (size_t i = 0, j = 0; i < tidx.size();) {
    const int32_t seq = ts[tidx[i]];
    size_t e = i;
    while (e < tidx.size() && ts[tidx[e]] == seq) ++e;
    while (j < size_t(P) && ps[pidx[j]] < seq) ++j;
    size_t je = j;
    while (je < size_t(P) && ps[pidx[je]] == seq) ++je;
    for (size_t b = i; b < e; b += per_tile)
      tiles.push_back({tidx.data() + b, std::min<int64_t>(per_tile, int64_t(e - b)),
                       sp.data() + j, int64_t(je - j)});
    i = e;
  }
  // the longest tiles first (their last position), so the pool's last tasks are short ones
  std::sort(tiles.begin(), tiles.end(), [&](const Tile& x, const Tile& y) {
    return a.pos[x.tok[x.n - 1]] > a.pos[y.tok[y.n - 1]]; });
  pool.run([&](int i) { PrefillTask(a, tiles[i / a.KV], i % a.KV); },
           int(tiles.size() * a.KV));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaPagedPrefill, PrefillImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [N, H, D]
                                  .Arg<ffi::AnyBuffer>()          // k_pool [L, NP, PS, KV, D]
                                  .Arg<ffi::AnyBuffer>()          // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // token_seq [N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions [N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages [U]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_seq [U]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_start [U]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_fill [U]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [N, H, D]
                                  .Attr<float>("scale"));
