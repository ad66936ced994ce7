// Gradient unscale + non-finite check, and sums of squares, per element.
#include "kernels/cpu/simd/vec_io.h"  // first: its pragma must precede all inline code

namespace mixprec::kernels::cpu::CPU_CAPABILITY {
namespace {

// Four independent accumulators: 4x shorter fp32 sums per lane (a 64K chunk
// is 2K terms per lane) and no serial dependency between vector adds.
template <class T>
float sumsq_range(const T* p, int64_t n) {
  fVec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
  int64_t i = 0;
  for (; i + 4 * kW <= n; i += 4 * kW) {
    const fVec x0 = load_full(p + i), x1 = load_full(p + i + kW);
    const fVec x2 = load_full(p + i + 2 * kW), x3 = load_full(p + i + 3 * kW);
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

}  // namespace

void unscale_items(const Plan<1>& plan, int64_t b, int64_t e, float inv_scale, uint8_t* found) {
  const fVec inv(inv_scale);
  for (int64_t k = b; k < e; ++k) {
    const WorkItem& it = plan.items[k];
    const Slot& s = plan.slots[it.tensor][0];
    MIXPREC_FLOAT_SWITCH(s.dtype, T, {
      T* p = static_cast<T*>(s.ptr) + it.begin;
      found[k] = scale_copy_range(p, p, it.end - it.begin, inv);
    })
  }
}

void sumsq_items(const Plan<1>& plan, int64_t b, int64_t e, float* partial) {
  for (int64_t k = b; k < e; ++k) {
    const WorkItem& it = plan.items[k];
    const Slot& s = plan.slots[it.tensor][0];
    MIXPREC_FLOAT_SWITCH(s.dtype, T, partial[k] = sumsq_range(
        static_cast<const T*>(s.ptr) + it.begin, it.end - it.begin))
  }
}

}  // namespace mixprec::kernels::cpu::CPU_CAPABILITY
