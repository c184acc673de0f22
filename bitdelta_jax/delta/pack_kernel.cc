// Compression hot loop: for HF-layout rows [R, K] of a base and a fine-tune (bf16 or f32),
// one pass computes Δ = ft − base in f32, packs sign bits along K in the group-bitplane layout
// (docs/FORMAT.md), and accumulates Σ|Δ| and ΣΔ² per row. Rows are split over threads.
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include <cmath>

namespace {

inline float load(const void* p, int64_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;  // bf16
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int BD, int FD>
void rows_kernel(const void* base, const void* ft, int64_t r0, int64_t r1, int64_t k,
                 int64_t group_k, uint8_t* bits, double* abs_sum, double* sq_sum, int* changed) {
  const int64_t p = group_k / 8;
  const int64_t k_pad = (k + group_k - 1) / group_k * group_k;
  const int64_t out_row = k_pad / 8;
  std::vector<float> d(k_pad, -1.0f);  // padded rows: bit 0
  int any = 0;
  constexpr int L = 16;  // independent partial sums: lets the compiler vectorise the reductions
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t off = r * k;
    double da = 0.0, ds = 0.0;
    for (int64_t i0 = 0; i0 < k; i0 += 1024) {
      const int64_t i1 = std::min(k, i0 + 1024);
      float sa[L] = {0}, ss[L] = {0};
      int64_t i = i0;
      for (; i + L <= i1; i += L) {
        for (int l = 0; l < L; ++l) {
          const float b = load(base, off + i + l, BD), f = load(ft, off + i + l, FD);
          const float x = f - b;
          d[i + l] = x;
          any |= (f != b);
          sa[l] += std::fabs(x);
          ss[l] += x * x;
        }
      }
      for (; i < i1; ++i) {
        const float b = load(base, off + i, BD), f = load(ft, off + i, FD);
        const float x = f - b;
        d[i] = x;
        any |= (f != b);
        sa[0] += std::fabs(x);
        ss[0] += x * x;
      }
      for (int l = 0; l < L; ++l) { da += sa[l]; ds += ss[l]; }
    }
    abs_sum[r] = da;
    sq_sum[r] = ds;
    uint8_t* out = bits + r * out_row;
    for (int64_t g = 0; g < k_pad / group_k; ++g) {
      const float* dg = d.data() + g * group_k;
      uint8_t* og = out + g * p;
      for (int64_t q = 0; q < p; ++q) og[q] = 0;
      for (int j = 0; j < 8; ++j) {
        const float* plane = dg + j * p;  // bit plane j: a contiguous run of p rows
        for (int64_t q = 0; q < p; ++q) og[q] |= static_cast<uint8_t>(plane[q] >= 0.f) << j;
      }
    }
  }
  if (any) *changed = 1;
}

}  // namespace

extern "C" int bitdelta_pack_rows(const void* base, int base_dtype, const void* ft, int ft_dtype,
                                  int64_t rows, int64_t k, int64_t group_k, int threads,
                                  uint8_t* bits, double* abs_sum, double* sq_sum, int* changed) {
  if (group_k <= 0 || group_k % 8 || base_dtype < 0 || base_dtype > 1 || ft_dtype < 0 ||
      ft_dtype > 1)
    return 1;
  auto run = [&](int64_t a, int64_t b) {
    if (base_dtype == 1 && ft_dtype == 1)
      rows_kernel<1, 1>(base, ft, a, b, k, group_k, bits, abs_sum, sq_sum, changed);
    else if (base_dtype == 1 && ft_dtype == 0)
      rows_kernel<1, 0>(base, ft, a, b, k, group_k, bits, abs_sum, sq_sum, changed);
    else if (base_dtype == 0 && ft_dtype == 1)
      rows_kernel<0, 1>(base, ft, a, b, k, group_k, bits, abs_sum, sq_sum, changed);
    else
      rows_kernel<0, 0>(base, ft, a, b, k, group_k, bits, abs_sum, sq_sum, changed);
  };
  if (threads < 1) threads = 1;
  if (threads == 1 || rows < 2 * threads) {
    run(0, rows);
    return 0;
  }
  std::vector<std::thread> pool;
  const int64_t step = (rows + threads - 1) / threads;
  for (int64_t a = 0; a < rows; a += step) pool.emplace_back(run, a, std::min(rows, a + step));
  for (auto& t : pool) t.join();
  return 0;
}
