// Fused Adam/AdamW and SGD steps (CUDA). The per-element arithmetic is the CPU
// kernels' own (kernels/functors.h, [Note: shared functors]); a set found_inf
// makes every block return before writing ([Note: skipped steps]), so
// skipping needs no host sync.
#include <cmath>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/multi_tensor_apply.cuh"
#include "kernels/functors.h"

namespace mixprec::kernels::cuda {
namespace {

// The arithmetic policy of kernels/functors.h on the device: every op rounded once,
// explicitly, so nvcc cannot contract a multiply and an add ([Note: shared functors]).
struct CudaArith {
  using V = float;
  static __device__ __forceinline__ V splat(float x) { return x; }
  static __device__ __forceinline__ V mul(V a, V b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ V add(V a, V b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ V sub(V a, V b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ V div(V a, V b) { return __fdiv_rn(a, b); }
  static __device__ __forceinline__ V fma(V a, V b, V c) { return __fmaf_rn(a, b, c); }
  static __device__ __forceinline__ V neg(V a) { return -a; }
  static __device__ __forceinline__ V sqrt(V a) { return __fsqrt_rn(a); }
};

struct AdamOp {
  const float* found_inf;
  const float* inv_scale;
  AdamScalars s;                // inv_scale / bias terms filled in per block below
  double lr, beta1, beta2;      // for bias corrections from a device step counter

  // Slots: param, grad, exp_avg, exp_avg_sq, lowp (may be null), step counter (may be
  // null: then s.bc2_sqrt / s.neg_step_size were computed on the host from opt.step).
  __device__ void apply(const TensorListMeta<6>& m, int t, int64_t b, int64_t e, int64_t) const {
    if (found_inf != nullptr && *found_inf != 0.f) return;
    AdamScalars ls = s;
    if (inv_scale != nullptr) ls.inv_scale = *inv_scale;
    if (m.addr[5][t] != nullptr) {
      // The double arithmetic of the host path (csrc/kernels/cpu/adam.cpp).
      const double step = static_cast<double>(*static_cast<const float*>(m.addr[5][t]));
      const double bc1 = 1.0 - pow(beta1, step);
      const double bc2 = 1.0 - pow(beta2, step);
      ls.bc2_sqrt = static_cast<float>(pow(bc2, 0.5));
      ls.neg_step_size = static_cast<float>(-(lr / bc1));
    }
    float* p = static_cast<float*>(m.addr[0][t]);
    float* ea = static_cast<float*>(m.addr[2][t]);
    float* es = static_cast<float*>(m.addr[3][t]);
    void* lp = m.addr[4][t];
    int64_t tail = b;
    if (vec_aligned(p, b, kF32) && vec_aligned(m.addr[1][t], b, m.code[1][t]) &&
        vec_aligned(ea, b, kF32) && vec_aligned(es, b, kF32) &&
        vec_aligned(lp, b, m.code[4][t])) {  // [Note: vectorised loads]
      const int64_t n_vec = (e - b) / kVec * kVec;
      for (int64_t i = b + kVec * threadIdx.x; i < b + n_vec; i += kVec * blockDim.x) {
        float pv[kVec], gv[kVec], mv[kVec], vv[kVec];
        load4(p, i, kF32, pv);
        load4(m.addr[1][t], i, m.code[1][t], gv);
        load4(ea, i, kF32, mv);
        load4(es, i, kF32, vv);
#pragma unroll
        for (int k = 0; k < kVec; ++k) functors::adam<CudaArith>(pv[k], gv[k], mv[k], vv[k], ls);
        store4(p, i, kF32, pv);
        store4(ea, i, kF32, mv);
        store4(es, i, kF32, vv);
        if (lp != nullptr) store4(lp, i, m.code[4][t], pv);
      }
      tail = b + n_vec;
    }
    for (int64_t i = tail + threadIdx.x; i < e; i += blockDim.x) {
      float pv = p[i], mv = ea[i], vv = es[i];
      functors::adam<CudaArith>(pv, load_f(m.addr[1][t], i, m.code[1][t]), mv, vv, ls);
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
  SgdScalars s;

  // Slots: param, grad, momentum buffer (null without momentum), lowp (may be null).
  __device__ void apply(const TensorListMeta<4>& m, int t, int64_t b, int64_t e, int64_t) const {
    if (found_inf != nullptr && *found_inf != 0.f) return;
    SgdScalars ls = s;
    if (inv_scale != nullptr) ls.inv_scale = *inv_scale;
    float* p = static_cast<float*>(m.addr[0][t]);
    float* buf = static_cast<float*>(m.addr[2][t]);
    void* lp = m.addr[3][t];
    int64_t tail = b;
    if (vec_aligned(p, b, kF32) && vec_aligned(m.addr[1][t], b, m.code[1][t]) &&
        vec_aligned(buf, b, kF32) && vec_aligned(lp, b, m.code[3][t])) {
      const int64_t n_vec = (e - b) / kVec * kVec;  // [Note: vectorised loads]
      for (int64_t i = b + kVec * threadIdx.x; i < b + n_vec; i += kVec * blockDim.x) {
        float pv[kVec], gv[kVec], bv[kVec];
        load4(p, i, kF32, pv);
        load4(m.addr[1][t], i, m.code[1][t], gv);
        if (ls.has_momentum && !ls.first_step) load4(buf, i, kF32, bv);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float g = functors::sgd_grad<CudaArith>(gv[k], pv[k], ls);
          float nb = g;
          if (ls.has_momentum && !ls.first_step) nb = functors::sgd_momentum<CudaArith>(g, bv[k], ls);
          bv[k] = nb;
          pv[k] = functors::sgd_param<CudaArith>(pv[k], functors::sgd_direction<CudaArith>(g, nb, ls), ls);
        }
        if (ls.has_momentum) store4(buf, i, kF32, bv);
        store4(p, i, kF32, pv);
        if (lp != nullptr) store4(lp, i, m.code[3][t], pv);
      }
      tail = b + n_vec;
    }
    for (int64_t i = tail + threadIdx.x; i < e; i += blockDim.x) {
      float pv = p[i];
      const float g = functors::sgd_grad<CudaArith>(load_f(m.addr[1][t], i, m.code[1][t]), pv, ls);
      float bv = g;
      if (ls.has_momentum) {
        if (!ls.first_step) bv = functors::sgd_momentum<CudaArith>(g, buf[i], ls);
        buf[i] = bv;
      }
      pv = functors::sgd_param<CudaArith>(pv, functors::sgd_direction<CudaArith>(g, bv, ls), ls);
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
  AdamScalars& s = op.s;
  s.inv_scale = 1.0f;
  s.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  s.wd = static_cast<float>(o.weight_decay);
  s.w1 = static_cast<float>(1.0 - o.beta1);
  s.one_minus_w1 = 1.0f - s.w1;
  s.beta2 = static_cast<float>(o.beta2);
  s.w2 = static_cast<float>(1.0 - o.beta2);
  s.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  s.eps = static_cast<float>(o.eps);
  s.neg_step_size = static_cast<float>(-(o.lr / bc1));
  s.has_inv_scale = inv_scale != nullptr;
  s.maximize = o.maximize;
  s.decoupled = o.decoupled;
  s.has_wd = o.weight_decay != 0.0;
  s.w1_small = std::abs(s.w1) < 0.5f;
  op.lr = o.lr;
  op.beta1 = o.beta1;
  op.beta2 = o.beta2;
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
  SgdScalars& s = op.s;
  s.inv_scale = 1.0f;
  s.wd = static_cast<float>(o.weight_decay);
  s.momentum = static_cast<float>(o.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - o.dampening);
  s.neg_lr = static_cast<float>(-o.lr);
  s.has_inv_scale = inv_scale != nullptr;
  s.maximize = o.maximize;
  s.has_wd = o.weight_decay != 0.0;
  s.has_momentum = o.momentum != 0.0;
  s.nesterov = o.nesterov;
  s.first_step = o.first_step;
  std::vector<std::array<Slot, 4>> slots;
  std::vector<int64_t> numels;
  make_slots<4>({&params, &grads, &momentum_buffers, &lowp_params}, &slots, &numels);
  multi_tensor_apply<4>(slots, numels, op, stream);
}

}  // namespace mixprec::kernels::cuda
