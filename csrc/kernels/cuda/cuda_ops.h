// CUDA implementations behind csrc/kernels/ops.cpp (compiled only when
// MIXPREC_WITH_CUDA): the fused optimizer steps. Unscale+check, the L2 norm and the
// copies call torch's own multi-tensor ops from ops.cpp instead ([Note: torch's foreach
// ops on CUDA] there). Inputs are checked in ops.cpp; `stream` is the current
// cudaStream_t of the tensors' device, passed as void* so that this header and the .cu
// files need no c10/cuda headers (see .ci/cuda_compile_check.sh). Nothing here
// synchronises with the host.
#pragma once

#include "kernels/multi_tensor.h"

namespace mixprec::kernels::cuda {

// steps: empty (bias corrections from opt.step) or one fp32 counter per param, already
// incremented, read on the device.
void adam(const TensorVec& params, const TensorVec& grads, const TensorVec& exp_avgs,
          const TensorVec& exp_avg_sqs, const TensorVec& lowp_params, const AdamOptions& opt,
          const at::Tensor* inv_scale, const at::Tensor* found_inf, const TensorVec& steps,
          void* stream);

void sgd(const TensorVec& params, const TensorVec& grads, const TensorVec& momentum_buffers,
         const TensorVec& lowp_params, const SgdOptions& opt, const at::Tensor* inv_scale,
         const at::Tensor* found_inf, void* stream);

}  // namespace mixprec::kernels::cuda
