// Fused SGD step, per element (see [Note: SGD op order] in ../sgd.cpp).
#include "kernels/cpu/simd/vec_io.h"  // first: its pragma must precede all inline code

namespace mixprec::kernels::cpu::CPU_CAPABILITY {
namespace {

template <class G, class L>
C10_ALWAYS_INLINE void sgd_vec(float* p, const G* g, float* buf, L* lp, int64_t n,
                               const SgdScalars& s) {
  fVec gv = load_f(g, n);
  if (s.has_inv_scale) gv = gv * fVec(s.inv_scale);
  if (s.maximize) gv = gv.neg();
  fVec pv = load_f(p, n);
  if (s.has_wd) gv = fma_exact(pv, fVec(s.wd), gv);
  if (s.has_momentum) {
    fVec bv = s.first_step
                  ? gv
                  : fma_exact(gv, fVec(s.one_minus_dampening), load_f(buf, n) * fVec(s.momentum));
    store_f(buf, bv, n);
    gv = s.nesterov ? fma_exact(bv, fVec(s.momentum), gv) : bv;
  }
  pv = fma_exact(gv, fVec(s.neg_lr), pv);
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
