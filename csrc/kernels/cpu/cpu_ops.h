// CPU implementations behind csrc/kernels/ops.cpp. Inputs are already checked
// there (device, dtype, contiguity, matching sizes); these only compute.
#pragma once

#include "kernels/multi_tensor.h"

namespace mixprec::kernels::cpu {

// Multiplies every tensor by inv_scale in place; true when any input was inf/nan.
bool unscale_and_check(const TensorVec& tensors, float inv_scale);

// Sum of squares of all elements: fp32 partial per chunk, partials added in
// double in chunk order, so the result does not depend on the thread count.
double sum_of_squares(const TensorVec& tensors);

// inv_scale: multiply grads by it first (1.0f with has_inv_scale false: skipped).
void adam(const TensorVec& params, const TensorVec& grads, const TensorVec& exp_avgs,
          const TensorVec& exp_avg_sqs, const TensorVec& lowp_params, const AdamOptions& opt,
          bool has_inv_scale, float inv_scale);

void sgd(const TensorVec& params, const TensorVec& grads, const TensorVec& momentum_buffers,
         const TensorVec& lowp_params, const SgdOptions& opt, bool has_inv_scale, float inv_scale);

void copy_cast(const TensorVec& dsts, const TensorVec& srcs);
// dsts[i] = srcs[i] * scale (same dtype; dsts[i] may be srcs[i]); true when any source
// element was inf/nan.
bool scale_copy_check(const TensorVec& dsts, const TensorVec& srcs, float scale);
// into_flat: tensors -> flat (packed back to back); otherwise flat -> tensors.
void flat_copy(const at::Tensor& flat, const TensorVec& tensors, bool into_flat);

}  // namespace mixprec::kernels::cpu
