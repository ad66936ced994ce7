// Fused Adam/AdamW and SGD steps (CUDA). Same op order and roundings as the
// CPU kernels ([Note: Adam op order], [Note: SGD op order]); a set found_inf
// makes every block return before writing ([Note: skipped steps]), so
// skipping needs no host sync.
#include <cmath>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/multi_tensor_apply.cuh"

namespace mixprec::kernels::cuda {
namespace {

struct AdamOp {
  const float* found_inf;
  const float* inv_scale;
  float decay, wd, w1, one_minus_w1, beta2, w2, bc2_sqrt, eps, neg_step_size;
  double lr, beta1_d, beta2_d;  // for bias corrections from a device step counter
  bool maximize, decoupled, has_wd, w1_small;

  // Slots: param, grad, exp_avg, exp_avg_sq, lowp (may be null), step counter (may be
  // null: then bc2_sqrt / neg_step_size were computed on the host from opt.step).
  __device__ void apply(const TensorListMeta<6>& m, int t, int64_t b, int64_t e, int64_t) const {
    if (found_inf != nullptr && *found_inf != 0.f) return;
    const float inv = inv_scale != nullptr ? *inv_scale : 1.f;
    float bc2s = bc2_sqrt, nss = neg_step_size;
    if (m.addr[5][t] != nullptr) {
      // Same double arithmetic as the host path (csrc/kernels/cpu/adam.cpp).
      const double step = static_cast<double>(*static_cast<const float*>(m.addr[5][t]));
      const double bc1 = 1.0 - pow(beta1_d, step);
      const double bc2 = 1.0 - pow(beta2_d, step);
      bc2s = static_cast<float>(pow(bc2, 0.5));
      nss = static_cast<float>(-(lr / bc1));
    }
    float* p = static_cast<float*>(m.addr[0][t]);
    float* ea = static_cast<float*>(m.addr[2][t]);
    float* es = static_cast<float*>(m.addr[3][t]);
    void* lp = m.addr[4][t];
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
      float g = load_f(m.addr[1][t], i, m.code[1][t]);
      if (inv_scale != nullptr) g = __fmul_rn(g, inv);
      if (maximize) g = -g;
      float pv = p[i];
      if (has_wd) {
        if (decoupled) pv = __fmul_rn(pv, decay);
        else g = __fmaf_rn(pv, wd, g);
      }
      float mv = ea[i];
      const float diff = __fsub_rn(g, mv);
      mv = w1_small ? __fmaf_rn(w1, diff, mv) : __fmaf_rn(-diff, one_minus_w1, g);
      float vv = __fmul_rn(es[i], beta2);
      vv = __fmaf_rn(__fmul_rn(w2, g), g, vv);
      const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv), bc2s), eps);
      pv = __fadd_rn(pv, __fdiv_rn(__fmul_rn(nss, mv), denom));
      p[i] = pv;
      ea[i] = mv;
      es[i] = vv;
      if (lp != nullptr) store_f(lp, i, m.code[4][t], pv);
    }
  }
};

struct SgdOp {
  const float* found_inf;
  const float* inv_scale;
  float wd, momentum, one_minus_dampening, neg_lr;
  bool maximize, has_wd, has_momentum, nesterov, first_step;

  // Slots: param, grad, momentum buffer (null without momentum), lowp (may be null).
  __device__ void apply(const TensorListMeta<4>& m, int t, int64_t b, int64_t e, int64_t) const {
    if (found_inf != nullptr && *found_inf != 0.f) return;
    const float inv = inv_scale != nullptr ? *inv_scale : 1.f;
    float* p = static_cast<float*>(m.addr[0][t]);
    float* buf = static_cast<float*>(m.addr[2][t]);
    void* lp = m.addr[3][t];
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
      float g = load_f(m.addr[1][t], i, m.code[1][t]);
      if (inv_scale != nullptr) g = __fmul_rn(g, inv);
      if (maximize) g = -g;
      float pv = p[i];
      if (has_wd) g = __fmaf_rn(pv, wd, g);
      if (has_momentum) {
        const float bv =
            first_step ? g : __fmaf_rn(g, one_minus_dampening, __fmul_rn(buf[i], momentum));
        buf[i] = bv;
        g = nesterov ? __fmaf_rn(bv, momentum, g) : bv;
      }
      pv = __fmaf_rn(g, neg_lr, pv);
      p[i] = pv;
      if (lp != nullptr) store_f(lp, i, m.code[3][t], pv);
    }
  }
};

}  // namespace

void adam(const TensorVec& params, const TensorVec& grads, const TensorVec& exp_avgs,
          const TensorVec& exp_avg_sqs, const TensorVec& lowp_params, const AdamOptions& o,
          const at::Tensor* inv_scale, const at::Tensor* found_inf, const TensorVec& steps,
          void* stream) {
  const double bc1 = 1.0 - std::pow(o.beta1, o.step);
  const double bc2 = 1.0 - std::pow(o.beta2, o.step);
  AdamOp op;
  op.found_inf = f32_ptr(found_inf);
  op.inv_scale = f32_ptr(inv_scale);
  op.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  op.wd = static_cast<float>(o.weight_decay);
  op.w1 = static_cast<float>(1.0 - o.beta1);
  op.one_minus_w1 = 1.0f - op.w1;
  op.beta2 = static_cast<float>(o.beta2);
  op.w2 = static_cast<float>(1.0 - o.beta2);
  op.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  op.eps = static_cast<float>(o.eps);
  op.neg_step_size = static_cast<float>(-(o.lr / bc1));
  op.lr = o.lr;
  op.beta1_d = o.beta1;
  op.beta2_d = o.beta2;
  op.maximize = o.maximize;
  op.decoupled = o.decoupled;
  op.has_wd = o.weight_decay != 0.0;
  op.w1_small = std::abs(op.w1) < 0.5f;
  std::vector<std::array<Slot, 6>> slots;
  std::vector<int64_t> numels;
  make_slots<6>({&params, &grads, &exp_avgs, &exp_avg_sqs, &lowp_params, &steps}, &slots,
                &numels);
  multi_tensor_apply<6>(slots, numels, op, stream);
}

void sgd(const TensorVec& params, const TensorVec& grads, const TensorVec& momentum_buffers,
         const TensorVec& lowp_params, const SgdOptions& o, const at::Tensor* inv_scale,
         const at::Tensor* found_inf, void* stream) {
  SgdOp op;
  op.found_inf = f32_ptr(found_inf);
  op.inv_scale = f32_ptr(inv_scale);
  op.wd = static_cast<float>(o.weight_decay);
  op.momentum = static_cast<float>(o.momentum);
  op.one_minus_dampening = static_cast<float>(1.0 - o.dampening);
  op.neg_lr = static_cast<float>(-o.lr);
  op.maximize = o.maximize;
  op.has_wd = o.weight_decay != 0.0;
  op.has_momentum = o.momentum != 0.0;
  op.nesterov = o.nesterov;
  op.first_step = o.first_step;
  std::vector<std::array<Slot, 4>> slots;
  std::vector<int64_t> numels;
  make_slots<4>({&params, &grads, &momentum_buffers, &lowp_params}, &slots, &numels);
  multi_tensor_apply<4>(slots, numels, op, stream);
}

}  // namespace mixprec::kernels::cuda
