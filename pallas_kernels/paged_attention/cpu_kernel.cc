// Decode-lane attention on the host CPU, read in place from the paged KV pools.
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
// `BitdeltaPagedGather` copies some pages of one layer out of a pool (the packed-prefill pass's
// `k_pool[layer, pages]`), which XLA would likewise compute from an f32 copy of the whole pool.
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

// out[i] = pool[layer, clamp(pages[i])]: whole pages of one layer (indices clamped, as XLA's
// gather does).
ffi::Error GatherImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                      ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions();
  if (pd.size() != 5 || out->element_type() != pool.element_type())
    return ffi::Error::InvalidArgument("paged_gather_cpu: expected pool[L, NP, PS, KV, D]");
  const int64_t L = pd[0], NP = pd[1], n = pages.element_count();
  if (out->element_count() != n * pd[2] * pd[3] * pd[4])
    return ffi::Error::InvalidArgument("paged_gather_cpu: out must be [n, PS, KV, D]");
  const size_t bytes = size_t(pd[2] * pd[3] * pd[4]) * ffi::ByteWidth(pool.element_type());
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  const char* src = static_cast<const char*>(pool.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* pg = pages.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t page = std::clamp<int64_t>(pg[i], 0, NP - 1);
    std::memcpy(dst + i * bytes, src + size_t(l * NP + page) * bytes, bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaPagedGather, GatherImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pool [L, NP, PS, KV, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages [n]
                                  .Ret<ffi::AnyBuffer>());        // [n, PS, KV, D]
