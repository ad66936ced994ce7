// Gradient unscale + non-finite check, and the global L2 norm (CPU).
// The per-element code is simd/unscale_norm_items.cpp.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/launcher.h"

namespace mixprec::kernels::cpu {

bool unscale_and_check(const TensorVec& tensors, float inv_scale) {
  const auto plan = make_plan<1>({&tensors}, {2});  // read and written back
  // One flag per item: no shared writes between threads, no atomics.
  std::vector<uint8_t> found(plan.items.size(), 0);
  const UnscaleItemsFn items = item_fns().unscale;
  parallel_items(plan, [&](int64_t b, int64_t e) { items(plan, b, e, inv_scale, found.data()); });
  for (uint8_t f : found) {
    if (f) return true;
  }
  return false;
}

// The lane count of the vector sums (8 for DEFAULT/AVX2, 16 for AVX512) sets
// the fp32 summation order inside a chunk: the result depends on the CPU
// capability, never on the thread count.
double sum_of_squares(const TensorVec& tensors) {
  const auto plan = make_plan<1>({&tensors}, {1});  // read
  std::vector<float> partial(plan.items.size(), 0.f);
  const SumsqItemsFn items = item_fns().sumsq;
  parallel_items(plan, [&](int64_t b, int64_t e) { items(plan, b, e, partial.data()); });
  double total = 0.0;
  for (float p : partial) total += p;
  return total;
}

}  // namespace mixprec::kernels::cpu
