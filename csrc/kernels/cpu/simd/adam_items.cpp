// Fused Adam / AdamW step, per element (see [Note: Adam op order] in ../adam.cpp).
#include "kernels/cpu/simd/vec_io.h"  // first: its pragma must precede all inline code

namespace mixprec::kernels::cpu::CPU_CAPABILITY {
namespace {

template <class G, class L>
C10_ALWAYS_INLINE void adam_vec(float* p, const G* g, float* m, float* v, L* lp, int64_t n,
                                const AdamScalars& s) {
  fVec pv = load_f(p, n), mv = load_f(m, n), vv = load_f(v, n);
  functors::adam<VecArith>(pv, load_f(g, n), mv, vv, s);
  store_f(p, pv, n);
  store_f(m, mv, n);
  store_f(v, vv, n);
  if constexpr (!std::is_same_v<L, NoLowp>) store_f(lp, pv, n);
}

template <class G, class L>
void adam_range(const std::array<Slot, 5>& t, int64_t b, int64_t e,
                const AdamScalars& s_in) {
  // A local copy: the fp32 stores below cannot alias it, so the scalars and
  // flags stay in registers and the flag tests are hoisted out of the loop.
  const AdamScalars s = s_in;
  float* p = static_cast<float*>(t[0].ptr) + b;
  const G* g = static_cast<const G*>(t[1].ptr) + b;
  float* m = static_cast<float*>(t[2].ptr) + b;
  float* v = static_cast<float*>(t[3].ptr) + b;
  L* lp = static_cast<L*>(t[4].ptr) + (std::is_same_v<L, NoLowp> ? 0 : b);
  const int64_t n = e - b;
  int64_t i = 0;
  for (; i + kW <= n; i += kW) adam_vec(p + i, g + i, m + i, v + i, lp + i, kW, s);
  if (i < n) adam_vec(p + i, g + i, m + i, v + i, lp + i, n - i, s);
}

}  // namespace

void adam_items(const Plan<5>& plan, int64_t b, int64_t e, const AdamScalars& s) {
  for (int64_t k = b; k < e; ++k) {
    const WorkItem& it = plan.items[k];
    const auto& t = plan.slots[it.tensor];
    if (t[4].ptr == nullptr) {
      MIXPREC_FLOAT_SWITCH(t[1].dtype, G, adam_range<G, NoLowp>(t, it.begin, it.end, s))
    } else if (t[4].dtype == at::kBFloat16) {
      MIXPREC_FLOAT_SWITCH(t[1].dtype, G, adam_range<G, c10::BFloat16>(t, it.begin, it.end, s))
    } else {
      MIXPREC_FLOAT_SWITCH(t[1].dtype, G, adam_range<G, c10::Half>(t, it.begin, it.end, s))
    }
  }
}

}  // namespace mixprec::kernels::cpu::CPU_CAPABILITY
