// Cast-copies, per element: fp32 -> bf16/fp16 rounds to nearest-even with NaN
// kept NaN, as Tensor.copy_ (only NaN payloads may differ).
#include "kernels/cpu/simd/vec_io.h"  // first: its pragma must precede all inline code

namespace mixprec::kernels::cpu::CPU_CAPABILITY {
namespace {

template <class D, class S>
void copy_range(D* d, const S* s, int64_t n) {
  if constexpr (std::is_same_v<D, S>) {
    std::memcpy(d, s, n * sizeof(D));
  } else {
    int64_t i = 0;
    for (; i + 2 * kW <= n; i += 2 * kW) {
      const fVec a = load_full(s + i), b = load_full(s + i + kW);
      store_full(d + i, a);
      store_full(d + i + kW, b);
    }
    for (; i + kW <= n; i += kW) store_full(d + i, load_full(s + i));
    if (i < n) store_f(d + i, load_f(s + i, n - i), n - i);
  }
}

}  // namespace

// Same dtype on both sides (the caller checks). In place (d == s) is allowed.
void scale_copy_items(const Plan<2>& plan, int64_t b, int64_t e, float scale, uint8_t* found) {
  const fVec f(scale);
  for (int64_t k = b; k < e; ++k) {
    const WorkItem& it = plan.items[k];
    const auto& t = plan.slots[it.tensor];
    MIXPREC_FLOAT_SWITCH(t[0].dtype, T, found[k] = scale_copy_range(
        static_cast<T*>(t[0].ptr) + it.begin, static_cast<const T*>(t[1].ptr) + it.begin,
        it.end - it.begin, f))
  }
}

// Slot 0 is the destination, slot 1 the source.
void copy_items(const Plan<2>& plan, int64_t b, int64_t e) {
  for (int64_t k = b; k < e; ++k) {
    const WorkItem& it = plan.items[k];
    const auto& t = plan.slots[it.tensor];
    const int64_t n = it.end - it.begin;
    MIXPREC_FLOAT_SWITCH(t[0].dtype, D, {
      D* d = static_cast<D*>(t[0].ptr) + it.begin;
      MIXPREC_FLOAT_SWITCH(t[1].dtype, S, copy_range(d, static_cast<const S*>(t[1].ptr) + it.begin, n))
    })
  }
}

}  // namespace mixprec::kernels::cpu::CPU_CAPABILITY
