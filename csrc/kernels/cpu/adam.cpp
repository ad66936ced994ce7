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
// AVX512 build), ours is IEEE sqrt; see tests/kernels/test_kernels_optim.py.
// The per-element code is simd/adam_items.cpp.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/launcher.h"

#include <cmath>

namespace mixprec::kernels::cpu {

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

  // params, exp_avgs, exp_avg_sqs: read and written; grads: read; lowp_params: written.
  const auto plan = make_plan<5>({&params, &grads, &exp_avgs, &exp_avg_sqs, &lowp_params},
                                 {2, 1, 2, 2, 1});
  const AdamItemsFn items = item_fns().adam;
  parallel_items(plan, [&](int64_t b, int64_t e) { items(plan, b, e, s); });
}

}  // namespace mixprec::kernels::cpu
