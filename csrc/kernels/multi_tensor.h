// Multi-tensor kernels: one entry point per op, dispatched by device.
//
// [Note: multi-tensor kernels]
// Optimizer steps and gradient unscaling touch hundreds of tensors per step.
// Launching one op per tensor costs a dispatcher round-trip, a TensorIterator
// and (on CPU) a parallel region per tensor, and every extra op re-reads the
// same memory. These kernels take whole lists, cut them into fixed-size
// chunks and run one parallel region (CPU) or a few launches (CUDA) over all
// chunks, doing every element-wise step of an update in a single pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace mixprec::kernels {

using TensorVec = std::vector<at::Tensor>;
using OptTensor = std::optional<at::Tensor>;

// Same semantics as torch._amp_foreach_non_finite_check_and_unscale_.
void unscale_and_check_(const TensorVec& tensors, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale);

// Global L2 norm over all elements of all tensors, fp32 0-dim on the tensors' device.
at::Tensor l2_norm(const TensorVec& tensors, const OptTensor& found_inf);

struct AdamOptions {
  double lr, beta1, beta2, eps, weight_decay, step;
  bool decoupled, maximize;
};
// `steps` (optional): one fp32 1-element step counter per param, on the params' device
// (torch's fused-Adam state layout). When given, each counter is incremented unless
// found_inf is set and the bias corrections use its new value, so a skipped step leaves
// the counters untouched without the host reading found_inf ([Note: device step
// counters]); opt.step is then ignored.
void fused_adam_(const TensorVec& params, const TensorVec& grads, const TensorVec& exp_avgs,
                 const TensorVec& exp_avg_sqs, const TensorVec& lowp_params,
                 const AdamOptions& opt, const OptTensor& inv_scale, const OptTensor& found_inf,
                 const TensorVec& steps = {});

// Advances `steps` (one fp32 1-element counter each, on one device) by 1, or by 0 when
// found_inf (0-dim or 1-element fp32, same device) is nonzero, without reading found_inf
// on the host: what fused_adam_ does to its `steps` on CUDA ([Note: device step
// counters]). Any device.
void advance_step_counters_(const TensorVec& steps, const OptTensor& found_inf);

struct SgdOptions {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize, first_step;
};
void fused_sgd_(const TensorVec& params, const TensorVec& grads, const TensorVec& momentum_buffers,
                const TensorVec& lowp_params, const SgdOptions& opt, const OptTensor& inv_scale,
                const OptTensor& found_inf);

void copy_cast_(const TensorVec& dsts, const TensorVec& srcs);
// dsts[i] = srcs[i] * scale (same dtypes; dsts[i] may be srcs[i]), setting found_inf to
// 1.0 when a source element is inf/nan: a copy with the scale and the non-finite check
// in its one pass (the ddp Reducer's copy into its buckets, [Note: non-finite check in
// the copy-in] in engines/replicated/reducer.h).
void scale_copy_and_check_(const TensorVec& dsts, const TensorVec& srcs,
                           const at::Tensor& found_inf, const at::Tensor& scale);
void flat_copy_in_(const at::Tensor& flat, const TensorVec& srcs);
void flat_copy_out_(const TensorVec& dsts, const at::Tensor& flat);

// The CPU launcher's work threshold: a call opens a parallel region only when the bytes
// it moves reach this ([Note: inline below the parallel threshold] in cpu/launcher.h).
int64_t cpu_parallel_min_bytes();
// How many parallel regions the CPU kernels have opened in this process (diagnostics).
int64_t cpu_parallel_regions();

}  // namespace mixprec::kernels
