// One slot's effective weight on the CPU: W_eff = W + α_s ⊙ S_s, f32 [K, N].
//
// Why: a prefill chunk of one variant's prompt multiplies hundreds of rows by every W. XLA's CPU
// dot (YNNPACK) runs that GEMM ~1.45x faster than the merged delta kernel's own micro-kernel,
// so for such a chunk the layer expands the slot's W_eff once (reads W and the bits, writes
// W_eff: ~2 weight-sized transfers, a few percent of the GEMM) and hands it to XLA's dot.
// W_eff is a transient buffer of the step; decode steps never take this path.
//
// Layout: the group-local bit planes of `pallas_kernels/bits.py` (byte bits[s, g*P + p,
// n], bit j: the sign of row g*G + j*P + p). The K rows are split across the pool's threads.
#include <algorithm>
#include <cstdint>

#include "pool.h"  // pallas_kernels/native, on the include path (native/build.py)
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using bitdelta_native::Pool;

ffi::Error Impl(ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::U8> bits, ffi::Buffer<ffi::F32> scale,
                ffi::Buffer<ffi::S32> slot, ffi::ResultBuffer<ffi::F32> out, int64_t group_k) {
  auto wd = w.dimensions();
  auto bd = bits.dimensions();
  auto sd = scale.dimensions();
  if (wd.size() != 2 || bd.size() != 3 || bd[2] != wd[1] || bd[1] * 8 < wd[0] ||
      sd.size() != 2 || sd[0] != bd[0] || sd[1] != wd[1] || slot.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "delta_expand: expected W[K,N], bits[S,KP,N], scale[S,N] and one slot id");
  if (group_k <= 0 || group_k % 8 || bd[1] % (group_k / 8))
    return ffi::Error::InvalidArgument("delta_expand: group_k must be a multiple of 8 dividing 8*KP");
  const int64_t K = wd[0], N = wd[1], KP = bd[1], G = group_k, P = G / 8;
  const int64_t s = slot.typed_data()[0];
  if (s < 0 || s >= bd[0]) return ffi::Error::InvalidArgument("delta_expand: slot id out of range");
  const float* wp = w.typed_data();
  const uint8_t* b = bits.typed_data() + s * KP * N;
  const float* al = scale.typed_data() + s * N;
  float* o = out->typed_data();
  Pool& pool = Pool::get();
  const int chunks = K * N < (int64_t(1) << 16) ? 1 : pool.size() * 4;
  const int64_t per = (K + chunks - 1) / chunks;
  pool.run([&](int c) {
    const int64_t k0 = c * per, k1 = std::min(K, k0 + per);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t r = k % G;
      const uint8_t* br = b + (k / G * P + r % P) * N;
      const int bit = int(r / P);
      const float* wr = wp + k * N;
      float* orow = o + k * N;
      for (int64_t n = 0; n < N; ++n) orow[n] = wr[n] + ((br[n] >> bit) & 1 ? al[n] : -al[n]);
    }
  }, std::max<int>(1, int(std::min<int64_t>(chunks, K))));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BitdeltaDeltaExpand, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // W [K, N]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // bits [S, KP, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [S, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // W_eff [K, N]
                                  .Attr<int64_t>("group_k"));
