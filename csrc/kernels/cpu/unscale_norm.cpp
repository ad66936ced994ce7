// Gradient unscale + non-finite check, and the global L2 norm (CPU).
// launcher.h first: its optimize pragma must precede every inline function
// of the TU, or GCC refuses to inline across the option mismatch.
#include "kernels/cpu/launcher.h"
#include "kernels/cpu/cpu_ops.h"

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

// Four independent accumulators: 4x shorter fp32 sums per lane (a 64K chunk
// is 2K terms per lane) and no serial dependency between vector adds.
template <class T>
C10_ALWAYS_INLINE float sumsq_range(const T* p, int64_t n) {
  fVec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
  int64_t i = 0;
  for (; i + 4 * kW <= n; i += 4 * kW) {
    const fVec x0 = load_f(p + i, kW), x1 = load_f(p + i + kW, kW);
    const fVec x2 = load_f(p + i + 2 * kW, kW), x3 = load_f(p + i + 3 * kW, kW);
    a0 = a0 + x0 * x0;
    a1 = a1 + x1 * x1;
    a2 = a2 + x2 * x2;
    a3 = a3 + x3 * x3;
  }
  for (; i < n; i += kW) {
    const fVec x = load_f(p + i, std::min(kW, n - i));
    a0 = a0 + x * x;
  }
  alignas(64) float lanes[kW];
  ((a0 + a1) + (a2 + a3)).store(lanes);
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
