// Gradient unscale + non-finite check, and the global L2 norm (CPU).
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/launcher.h"

namespace mixprec::kernels::cpu {
namespace {

// Matches torch's CPU _amp_foreach_non_finite_check_and_unscale_: the check is
// on the value before scaling, the product is one fp32 multiply rounded back.
template <class T>
C10_ALWAYS_INLINE bool unscale_range(T* p, int64_t n, const fVec& inv) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const fVec x = load_f(p + i, kW);
    acc = nonfinite_acc(acc, x);
    store_f(p + i, x * inv, kW);
  }
  if (i < n) {
    const fVec x = load_f(p + i, n - i);
    acc = nonfinite_acc(acc, x);
    store_f(p + i, x * inv, n - i);
  }
  return any_nonfinite(acc);
}

template <class T>
C10_ALWAYS_INLINE float sumsq_range(const T* p, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const fVec x = load_f(p + i, kW);
    acc = acc + x * x;
  }
  if (i < n) {
    const fVec x = load_f(p + i, n - i);
    acc = acc + x * x;
  }
  alignas(64) float lanes[kW];
  acc.store(lanes);
  float s = 0.f;
  for (int64_t k = 0; k < kW; ++k) s += lanes[k];
  return s;
}

MIXPREC_CPU_CLONES(unscale_items,
                   (const Plan<1>& plan, int64_t b, int64_t e, float inv_scale, uint8_t* found),
                   (plan, b, e, inv_scale, found), {
  const fVec inv(inv_scale);
  for (int64_t k = b; k < e; ++k) {
    const WorkItem& it = plan.items[k];
    const Slot& s = plan.slots[it.tensor][0];
    MIXPREC_FLOAT_SWITCH(s.dtype, T, found[k] = unscale_range(
        static_cast<T*>(s.ptr) + it.begin, it.end - it.begin, inv))
  }
})

MIXPREC_CPU_CLONES(sumsq_items, (const Plan<1>& plan, int64_t b, int64_t e, float* partial),
                   (plan, b, e, partial), {
  for (int64_t k = b; k < e; ++k) {
    const WorkItem& it = plan.items[k];
    const Slot& s = plan.slots[it.tensor][0];
    MIXPREC_FLOAT_SWITCH(s.dtype, T, partial[k] = sumsq_range(
        static_cast<const T*>(s.ptr) + it.begin, it.end - it.begin))
  }
})

}  // namespace

bool unscale_and_check(const TensorVec& tensors, float inv_scale) {
  const auto plan = make_plan<1>({&tensors});
  // One flag per item: no shared writes between threads, no atomics.
  std::vector<uint8_t> found(plan.items.size(), 0);
  parallel_items(plan.items, plan.total,
                 [&](int64_t b, int64_t e) { unscale_items(plan, b, e, inv_scale, found.data()); });
  for (uint8_t f : found) {
    if (f) return true;
  }
  return false;
}

double sum_of_squares(const TensorVec& tensors) {
  const auto plan = make_plan<1>({&tensors});
  std::vector<float> partial(plan.items.size(), 0.f);
  parallel_items(plan.items, plan.total,
                 [&](int64_t b, int64_t e) { sumsq_items(plan, b, e, partial.data()); });
  double total = 0.0;
  for (float p : partial) total += p;
  return total;
}

}  // namespace mixprec::kernels::cpu
