// Fused SGD step (CPU), with momentum / dampening / nesterov / weight decay.
//
// [Note: SGD op order]
// Mirrors torch.optim.sgd _single_tensor_sgd on CPU (each `add(x, alpha=a)`
// of torch is one fused multiply-add there, see [Note: vectorisation and FMA]):
//   g = grad * inv_scale; g = -g if maximize
//   g = fma(p, f32(wd), g)                              (grad.add(param, alpha=wd))
//   first step: buf = g                                 (grad.clone())
//   later:      buf = fma(g, f32(1-dampening), buf * f32(momentum))
//   nesterov:   g = fma(buf, f32(momentum), g)   else g = buf
//   p = fma(g, f32(-lr), p)                             (param.add_(grad, alpha=-lr))
// so the result is bitwise equal to torch.optim.SGD(foreach=False) on CPU.
// launcher.h first: its optimize pragma must precede every inline function
// of the TU, or GCC refuses to inline across the option mismatch.
#include "kernels/cpu/launcher.h"
#include "kernels/cpu/cpu_ops.h"

namespace mixprec::kernels::cpu {
namespace {

struct NoLowp {};

struct SgdScalars {
  float inv_scale, wd, momentum, one_minus_dampening, neg_lr;
  bool has_inv_scale, maximize, has_wd, has_momentum, nesterov, first_step;
};

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
C10_ALWAYS_INLINE void sgd_range(const std::array<Slot, 4>& t, int64_t b, int64_t e,
                                 const SgdScalars& s) {
  float* p = static_cast<float*>(t[0].ptr) + b;
  const G* g = static_cast<const G*>(t[1].ptr) + b;
  float* buf = s.has_momentum ? static_cast<float*>(t[2].ptr) + b : nullptr;
  L* lp = static_cast<L*>(t[3].ptr) + (std::is_same_v<L, NoLowp> ? 0 : b);
  const int64_t n = e - b;
  int64_t i = 0;
  for (; i + kW <= n; i += kW) sgd_vec(p + i, g + i, buf ? buf + i : nullptr, lp + i, kW, s);
  if (i < n) sgd_vec(p + i, g + i, buf ? buf + i : nullptr, lp + i, n - i, s);
}

MIXPREC_CPU_CLONES(sgd_items, (const Plan<4>& plan, int64_t b, int64_t e, const SgdScalars& s),
                   (plan, b, e, s), {
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
})

}  // namespace

void sgd(const TensorVec& params, const TensorVec& grads, const TensorVec& momentum_buffers,
         const TensorVec& lowp_params, const SgdOptions& o, bool has_inv_scale, float inv_scale) {
  SgdScalars s;
  s.inv_scale = inv_scale;
  s.wd = static_cast<float>(o.weight_decay);
  s.momentum = static_cast<float>(o.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - o.dampening);
  s.neg_lr = static_cast<float>(-o.lr);
  s.has_inv_scale = has_inv_scale;
  s.maximize = o.maximize;
  s.has_wd = o.weight_decay != 0.0;
  s.has_momentum = o.momentum != 0.0;
  s.nesterov = o.nesterov;
  s.first_step = o.first_step;
  const auto plan = make_plan<4>({&params, &grads, &momentum_buffers, &lowp_params});
  parallel_items(plan.items, plan.total, [&](int64_t b, int64_t e) { sgd_items(plan, b, e, s); });
}

}  // namespace mixprec::kernels::cpu
