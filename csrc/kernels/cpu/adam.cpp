// Fused Adam / AdamW step (CPU): one pass reads param, grad, exp_avg,
// exp_avg_sq and writes param, exp_avg, exp_avg_sq and the low-precision copy.
//
// [Note: Adam op order]
// The per-element sequence and every scalar mirror torch.optim.adam
// _single_tensor_adam (torch 2.13, capturable=False) on CPU:
//   g = grad * inv_scale; g = -g if maximize
//   AdamW: p = p * f32(1 - lr*wd)            (param.mul_)
//   Adam:  g = fma(p, f32(wd), g)            (grad.add(param, alpha=wd))
//   m = lerp(m, g, f32(1 - beta1))           (fma form of at::native::lerp)
//   v = v * f32(beta2); v = fma(f32(1-beta2) * g, g, v)   (mul_, addcmul_)
//   denom = sqrt(v) / f32(sqrt(bc2)) + f32(eps)
//   p = p + (f32(-step_size) * m) / denom    (addcdiv_)
// with bc1 = 1 - beta1**step, bc2 = 1 - beta2**step, step_size = lr / bc1 and
// sqrt(bc2) = bc2**0.5, all in double as Python computes them, rounded to fp32
// when they reach the kernel. The one known difference: torch's vectorised
// CPU sqrt is not correctly rounded (up to 1 ulp off on ~20% of lanes in the
// AVX512 build), ours is IEEE sqrt; see tests/kernels/test_kernels_adam.py.
// launcher.h first: its optimize pragma must precede every inline function
// of the TU, or GCC refuses to inline across the option mismatch.
#include "kernels/cpu/launcher.h"
#include "kernels/cpu/cpu_ops.h"

namespace mixprec::kernels::cpu {
namespace {

struct NoLowp {};

struct AdamScalars {
  float inv_scale, decay, wd, w1, one_minus_w1, beta2, w2, bc2_sqrt, eps, neg_step_size;
  bool has_inv_scale, maximize, decoupled, has_wd, w1_small;
};

template <class G, class L>
C10_ALWAYS_INLINE void adam_vec(float* p, const G* g, float* m, float* v, L* lp, int64_t n,
                                const AdamScalars& s) {
  fVec gv = load_f(g, n);
  if (s.has_inv_scale) gv = gv * fVec(s.inv_scale);
  if (s.maximize) gv = gv.neg();
  fVec pv = load_f(p, n);
  if (s.has_wd) {
    if (s.decoupled) {
      pv = pv * fVec(s.decay);
    } else {
      gv = fma_exact(pv, fVec(s.wd), gv);
    }
  }
  fVec mv = load_f(m, n);
  const fVec diff = gv - mv;
  mv = s.w1_small ? fma_exact(fVec(s.w1), diff, mv) : fma_exact(diff.neg(), fVec(s.one_minus_w1), gv);
  fVec vv = load_f(v, n) * fVec(s.beta2);
  vv = fma_exact(fVec(s.w2) * gv, gv, vv);
  const fVec denom = vv.sqrt() / fVec(s.bc2_sqrt) + fVec(s.eps);
  pv = pv + (fVec(s.neg_step_size) * mv) / denom;
  store_f(p, pv, n);
  store_f(m, mv, n);
  store_f(v, vv, n);
  if constexpr (!std::is_same_v<L, NoLowp>) store_f(lp, pv, n);
}

template <class G, class L>
C10_ALWAYS_INLINE void adam_range(const std::array<Slot, 5>& t, int64_t b, int64_t e,
                                  const AdamScalars& s) {
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

MIXPREC_CPU_CLONES(adam_items, (const Plan<5>& plan, int64_t b, int64_t e, const AdamScalars& s),
                   (plan, b, e, s), {
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
})

}  // namespace

void adam(const TensorVec& params, const TensorVec& grads, const TensorVec& exp_avgs,
          const TensorVec& exp_avg_sqs, const TensorVec& lowp_params, const AdamOptions& o,
          bool has_inv_scale, float inv_scale) {
  const double bc1 = 1.0 - std::pow(o.beta1, o.step);
  const double bc2 = 1.0 - std::pow(o.beta2, o.step);
  const double step_size = o.lr / bc1;
  AdamScalars s;
  s.inv_scale = inv_scale;
  s.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  s.wd = static_cast<float>(o.weight_decay);
  s.w1 = static_cast<float>(1.0 - o.beta1);
  s.one_minus_w1 = 1.0f - s.w1;  // at::native::lerp computes 1 - weight in fp32
  s.beta2 = static_cast<float>(o.beta2);
  s.w2 = static_cast<float>(1.0 - o.beta2);
  s.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));  // Python's bc2**0.5 is pow()
  s.eps = static_cast<float>(o.eps);
  s.neg_step_size = static_cast<float>(-step_size);
  s.has_inv_scale = has_inv_scale;
  s.maximize = o.maximize;
  s.decoupled = o.decoupled;
  s.has_wd = o.weight_decay != 0.0;
  s.w1_small = std::abs(s.w1) < 0.5f;

  const auto plan = make_plan<5>({&params, &grads, &exp_avgs, &exp_avg_sqs, &lowp_params});
  parallel_items(plan.items, plan.total,
                 [&](int64_t b, int64_t e) { adam_items(plan, b, e, s); });
}

}  // namespace mixprec::kernels::cpu
