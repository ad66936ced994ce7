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
// The per-element code is simd/sgd_items.cpp.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/launcher.h"

namespace mixprec::kernels::cpu {

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
  // params: read and written; grads: read; momentum buffers: written (first step) or
  // read and written; lowp_params: written.
  const auto plan = make_plan<4>({&params, &grads, &momentum_buffers, &lowp_params},
                                 {2, 1, o.first_step ? 1 : 2, 1});
  const SgdItemsFn items = item_fns().sgd;
  parallel_items(plan, [&](int64_t b, int64_t e) { items(plan, b, e, s); });
}

}  // namespace mixprec::kernels::cpu
