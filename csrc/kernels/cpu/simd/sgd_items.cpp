// Fused SGD step, per element (see [Note: SGD op order] in ../sgd.cpp).
#include "kernels/cpu/simd/vec_io.h"  // first: its pragma must precede all inline code

namespace mixprec::kernels::cpu::CPU_CAPABILITY {
namespace {

template <class G, class L>
C10_ALWAYS_INLINE void sgd_vec(float* p, const G* g, float* buf, L* lp, int64_t n,
                               const SgdScalars& s) {
  fVec pv = load_f(p, n);
  fVec gv = functors::sgd_grad<VecArith>(load_f(g, n), pv, s);
  fVec bv = gv;
  if (s.has_momentum) {
    if (!s.first_step) bv = functors::sgd_momentum<VecArith>(gv, load_f(buf, n), s);
    store_f(buf, bv, n);
  }
  pv = functors::sgd_param<VecArith>(pv, functors::sgd_direction<VecArith>(gv, bv, s), s);
  store_f(p, pv, n);
  if constexpr (!std::is_same_v<L, NoLowp>) store_f(lp, pv, n);
}

template <class G, class L>
void sgd_range(const std::array<Slot, 4>& t, int64_t b, int64_t e,
                const SgdScalars& s_in) {
  // A local copy: the fp32 stores below cannot alias it, so the scalars and
  // flags stay in registers and the flag tests are hoisted out of the loop.
  const SgdScalars s = s_in;
  float* p = static_cast<float*>(t[0].ptr) + b;
  const G* g = static_cast<const G*>(t[1].ptr) + b;
  float* buf = s.has_momentum ? static_cast<float*>(t[2].ptr) + b : nullptr;
  L* lp = static_cast<L*>(t[3].ptr) + (std::is_same_v<L, NoLowp> ? 0 : b);
  const int64_t n = e - b;
  int64_t i = 0;
  for (; i + kW <= n; i += kW) sgd_vec(p + i, g + i, buf ? buf + i : nullptr, lp + i, kW, s);
  if (i < n) sgd_vec(p + i, g + i, buf ? buf + i : nullptr, lp + i, n - i, s);
}

}  // namespace

void sgd_items(const Plan<4>& plan, int64_t b, int64_t e, const SgdScalars& s) {
  for (int64_t k = b; k < e; ++k) {
    const WorkItem& it = plan.items[k];
    const auto& t = plan.slots[it.tensor];
    if (t[3].ptr == nullptr) {
      MIXPREC_FLOAT_SWITCH(t[1].dtype, G, sgd_range<G, NoLowp>(t, it.begin, it.end, s))
    } else if (t[3].dtype == at::kBFloat16) {
      MIXPREC_FLOAT_SWITCH(t[1].dtype, G, sgd_range<G, c10::BFloat16>(t, it.begin, it.end, s))
    } else {
      MIXPREC_FLOAT_SWITCH(t[1].dtype, G, sgd_range<G, c10::Half>(t, it.begin, it.end, s))
    }
  }
}

}  // namespace mixprec::kernels::cpu::CPU_CAPABILITY
