// CUDA implementations behind csrc/kernels/ops.cpp (compiled only when
// MIXPREC_WITH_CUDA). Inputs are checked there; `stream` is the current
// cudaStream_t of the tensors' device, passed as void* so that this header and
// the .cu files need no c10/cuda headers (see .ci/cuda_compile_check.sh).
// Nothing here synchronises with the host.
#pragma once

#include "kernels/multi_tensor.h"

namespace mixprec::kernels::cuda {

void unscale_and_check(const TensorVec& tensors, const at::Tensor& found_inf,
                       const at::Tensor& inv_scale, void* stream);

// Number of fp32 partial sums l2_norm writes (size of its `partials` buffer).
int64_t l2_norm_num_partials(const TensorVec& tensors);
// out: fp32 0-dim; found_inf may be null.
void l2_norm(const TensorVec& tensors, const at::Tensor& partials, const at::Tensor& out,
             const at::Tensor* found_inf, void* stream);

// steps: empty (bias corrections from opt.step) or one fp32 counter per param, already
// incremented, read on the device.
void adam(const TensorVec& params, const TensorVec& grads, const TensorVec& exp_avgs,
          const TensorVec& exp_avg_sqs, const TensorVec& lowp_params, const AdamOptions& opt,
          const at::Tensor* inv_scale, const at::Tensor* found_inf, const TensorVec& steps,
          void* stream);

void sgd(const TensorVec& params, const TensorVec& grads, const TensorVec& momentum_buffers,
         const TensorVec& lowp_params, const SgdOptions& opt, const at::Tensor* inv_scale,
         const at::Tensor* found_inf, void* stream);

void copy_cast(const TensorVec& dsts, const TensorVec& srcs, void* stream);
void flat_copy(const at::Tensor& flat, const TensorVec& tensors, bool into_flat, void* stream);

}  // namespace mixprec::kernels::cuda
