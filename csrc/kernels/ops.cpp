// Entry points of the multi-tensor ops: check the inputs once, then run the
// CPU or CUDA implementation for the tensors' device.
#include "kernels/checks.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/launcher.h"
#include "kernels/multi_tensor.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

#if MIXPREC_WITH_CUDA
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/stack.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/cuda_ops.h"
#endif

namespace mixprec::kernels {

namespace {

// Runs cpu_fn() for CPU tensors, cuda_fn(stream) for CUDA ones (device guarded).
template <class CpuFn, class CudaFn>
void on_device(const char* op, const at::Device& device, const CpuFn& cpu_fn,
               const CudaFn& cuda_fn) {
  if (device.is_cpu()) {
    cpu_fn();
    return;
  }
#if MIXPREC_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    cuda_fn(static_cast<void*>(c10::cuda::getCurrentCUDAStream(device.index()).stream()));
    return;
  }
#endif
  TORCH_CHECK_VALUE(false, "mixprec.", op, ": tensors on ", device,
                    " are not supported by this build (CPU",
                    MIXPREC_WITH_CUDA ? " and CUDA" : " only; rebuild with MIXPREC_CUDA=ON for CUDA",
                    ")");
}

float cpu_scalar(const at::Tensor& t) { return *static_cast<const float*>(t.data_ptr()); }

void check_optional_scalars(const char* op, const OptTensor& inv_scale, const OptTensor& found_inf,
                            const at::Device& device) {
  if (inv_scale) check_scalar_tensor(op, "inv_scale", *inv_scale, device);
  if (found_inf) check_scalar_tensor(op, "found_inf", *found_inf, device);
}

// dsts[i] and srcs[i]: same sizes, one device, floating dtypes. Returns that device.
at::Device check_pairs(const char* op, const TensorVec& dsts, const TensorVec& srcs) {
  check_same_sizes(op, "dsts", dsts, "srcs", srcs);
  const auto device = list_device(dsts);
  check_list(op, "dsts", dsts, device, Dtypes::kFloating);
  check_list(op, "srcs", srcs, device, Dtypes::kFloating);
  return device;
}

void check_hyper(const char* op, const char* name, double v, double lo) {
  TORCH_CHECK_VALUE(std::isfinite(v) && v >= lo, "mixprec.", op, ": ", name,
                    " must be a finite number >= ", lo, ", got ", v);
}

void check_step_counters(const char* op, const TensorVec& steps, size_t num_params,
                         const at::Device& device) {
  TORCH_CHECK_VALUE(steps.size() == num_params, "mixprec.", op, ": got ", steps.size(),
                    " step counters for ", num_params, " params; give one per param");
  for (const auto& t : steps) check_scalar_tensor(op, "steps[i]", t, device);
}

// Adds 1 to every counter, or 0 where found_inf is nonzero, on the counters' device (no
// host read). found_inf: 0-dim or shape [1] (the scalers' flags are [1]: kernels.py,
// precision/grad_scaler.cpp); at::_foreach_add_(list, Tensor) wants a 0-dim tensor, so the
// increment goes through the List overload, one view of it per counter.
void add_step_increments(const TensorVec& steps, const OptTensor& found_inf) {
  const at::NoGradGuard no_grad;  // counters are optimizer state, never part of a graph
  if (!found_inf) {
    at::_foreach_add_(steps, 1);
    return;
  }
  const at::Tensor inc = found_inf->reshape({}).eq(0).to(at::kFloat);
  TensorVec incs;
  incs.reserve(steps.size());
  for (const auto& t : steps) incs.push_back(inc.view(t.sizes()));
  at::_foreach_add_(steps, incs);
}

#if MIXPREC_WITH_CUDA
// [Note: torch's foreach ops on CUDA] unscale+check, norm and copies call torch's own
// multi-tensor ops (same results, full bandwidth). Those take their fast path only for
// lists of one dtype (one dtype pair for copies); otherwise they fall back to one kernel
// per tensor. So the lists are split by dtype first, in order of first appearance.
std::vector<std::pair<TensorVec, TensorVec>> group_by_dtypes(const TensorVec& a,
                                                             const TensorVec& b) {
  std::vector<std::pair<TensorVec, TensorVec>> groups;
  std::vector<std::pair<at::ScalarType, at::ScalarType>> keys;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto key = std::make_pair(a[i].scalar_type(), b.empty() ? a[i].scalar_type()
                                                                  : b[i].scalar_type());
    size_t g = 0;
    while (g < keys.size() && keys[g] != key) ++g;
    if (g == keys.size()) {
      keys.push_back(key);
      groups.emplace_back();
    }
    groups[g].first.push_back(a[i]);
    if (!b.empty()) groups[g].second.push_back(b[i]);
  }
  return groups;
}

// dsts[i].copy_(srcs[i]) through at::_foreach_copy_: the same conversion as copy_ and
// Tensor.to (round to nearest-even). Both sides are flattened (contiguous, equal numels
// are checked by the callers), so copy_'s broadcasting never applies.
void foreach_copy(const TensorVec& dsts, const TensorVec& srcs) {
  const at::NoGradGuard no_grad;  // dsts may be leaf parameters
  TensorVec d, s;
  for (size_t i = 0; i < dsts.size(); ++i) {
    d.push_back(dsts[i].view(-1));
    s.push_back(srcs[i].view(-1));
  }
  for (const auto& [gd, gs] : group_by_dtypes(d, s)) at::_foreach_copy_(gd, gs);
}

// at::_amp_foreach_non_finite_check_and_unscale_: t *= inv_scale in fp32, found_inf set
// to 1.0 when an element is inf/nan (never cleared), as this op's CPU path. torch's CUDA op
// takes fp32, fp64 and fp16 only (torch 2.11 raises "not implemented for 'BFloat16'", seen on
// an H200): any other dtype is done here with the same arithmetic, an in-place multiply by
// the fp32 inv_scale (computed in fp32, rounded once to the tensor's dtype), and found_inf
// set from the values before the multiply (as the op checks them), without reading the flag
// on the host.
void foreach_unscale(const TensorVec& tensors, const at::Tensor& found_inf,
                     const at::Tensor& inv_scale) {
  const at::NoGradGuard no_grad;
  at::Tensor flag = found_inf;  // the op takes a non-const handle
  for (const auto& group : group_by_dtypes(tensors, {})) {
    const auto dtype = group.first.front().scalar_type();
    if (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf) {
      at::_amp_foreach_non_finite_check_and_unscale_(group.first, flag, inv_scale);
      continue;
    }
    for (const auto& t : group.first) {
      flag.masked_fill_(t.isfinite().all().logical_not(), 1.0);
      t.mul_(inv_scale);
    }
  }
}
#endif

}  // namespace

void advance_step_counters_(const TensorVec& steps, const OptTensor& found_inf) {
  constexpr const char* op = "advance_step_counters_";
  if (steps.empty()) return;
  const auto device = list_device(steps);
  check_step_counters(op, steps, steps.size(), device);
  if (found_inf) check_scalar_tensor(op, "found_inf", *found_inf, device);
  add_step_increments(steps, found_inf);
}

void unscale_and_check_(const TensorVec& tensors, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale) {
  constexpr const char* op = "unscale_and_check_";
  if (tensors.empty()) return;
  const auto device = list_device(tensors);
  check_list(op, "tensors", tensors, device, Dtypes::kFloating);
  check_scalar_tensor(op, "found_inf", found_inf, device);
  check_scalar_tensor(op, "inv_scale", inv_scale, device);
  on_device(
      op, device,
      [&] {
        if (cpu::unscale_and_check(tensors, cpu_scalar(inv_scale))) {
          *static_cast<float*>(found_inf.data_ptr()) = 1.0f;
        }
      },
      [&](void* stream) {
#if MIXPREC_WITH_CUDA
        foreach_unscale(tensors, found_inf, inv_scale);
#endif
      });
  bump_versions({&tensors});
}

at::Tensor l2_norm(const TensorVec& tensors, const OptTensor& found_inf) {
  constexpr const char* op = "l2_norm";
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  if (tensors.empty()) {
    return at::zeros({}, f32.device(found_inf ? found_inf->device() : at::Device(at::kCPU)));
  }
  const auto device = list_device(tensors);
  check_list(op, "tensors", tensors, device, Dtypes::kFloating);
  if (found_inf) check_scalar_tensor(op, "found_inf", *found_inf, device);
  at::Tensor out = at::empty({}, f32.device(device));
  on_device(
      op, device,
      [&] {
        const float norm = static_cast<float>(std::sqrt(cpu::sum_of_squares(tensors)));
        *static_cast<float*>(out.data_ptr()) = norm;
        if (found_inf && !std::isfinite(norm)) *static_cast<float*>(found_inf->data_ptr()) = 1.0f;
      },
      [&](void* stream) {
#if MIXPREC_WITH_CUDA
        // Per-tensor fp32 norms (at::_foreach_norm), then the norm of those: deterministic
        // (no atomics in either), fp32 0-dim, all on the device.
        const at::NoGradGuard no_grad;
        TensorVec norms;
        for (const auto& group : group_by_dtypes(tensors, {})) {
          for (auto& n : at::_foreach_norm(group.first, 2, at::kFloat)) norms.push_back(n);
        }
        out = at::linalg_vector_norm(at::stack(norms), 2);
        if (found_inf) found_inf->masked_fill_(out.isfinite().logical_not(), 1.0);
#endif
      });
  return out;
}

void fused_adam_(const TensorVec& params, const TensorVec& grads, const TensorVec& exp_avgs,
                 const TensorVec& exp_avg_sqs, const TensorVec& lowp_params,
                 const AdamOptions& opt, const OptTensor& inv_scale, const OptTensor& found_inf,
                 const TensorVec& steps) {
  constexpr const char* op = "fused_adam_";
  check_hyper(op, "lr", opt.lr, 0.0);
  check_hyper(op, "eps", opt.eps, 0.0);
  check_hyper(op, "weight_decay", opt.weight_decay, 0.0);
  if (steps.empty()) check_hyper(op, "step", opt.step, 1.0);
  TORCH_CHECK_VALUE(opt.beta1 >= 0.0 && opt.beta1 < 1.0, "mixprec.", op,
                    ": beta1 must be in [0, 1), got ", opt.beta1);
  TORCH_CHECK_VALUE(opt.beta2 >= 0.0 && opt.beta2 < 1.0, "mixprec.", op,
                    ": beta2 must be in [0, 1), got ", opt.beta2);
  if (params.empty()) return;
  const auto device = list_device(params);
  check_list(op, "params", params, device, Dtypes::kFloat32);
  check_list(op, "grads", grads, device, Dtypes::kFloating);
  check_list(op, "exp_avgs", exp_avgs, device, Dtypes::kFloat32);
  check_list(op, "exp_avg_sqs", exp_avg_sqs, device, Dtypes::kFloat32);
  check_same_sizes(op, "params", params, "grads", grads);
  check_same_sizes(op, "params", params, "exp_avgs", exp_avgs);
  check_same_sizes(op, "params", params, "exp_avg_sqs", exp_avg_sqs);
  if (!lowp_params.empty()) {
    check_list(op, "lowp_params", lowp_params, device, Dtypes::kLowp);
    check_same_sizes(op, "params", params, "lowp_params", lowp_params);
  }
  check_optional_scalars(op, inv_scale, found_inf, device);
  if (!steps.empty()) check_step_counters(op, steps, params.size(), device);
  // Every argument is checked above: nothing below raises for a bad one, so a failed call
  // leaves params, moments and counters as they were.
  on_device(
      op, device,
      [&] {
        // [Note: skipped steps] checked once, before anything is written.
        if (found_inf && cpu_scalar(*found_inf) != 0.0f) return;
        const float inv = inv_scale ? cpu_scalar(*inv_scale) : 1.0f;
        if (steps.empty()) {
          cpu::adam(params, grads, exp_avgs, exp_avg_sqs, lowp_params, opt,
                    inv_scale.has_value(), inv);
          return;
        }
        // [Note: device step counters] fp32 += 1 as torch's `state_steps += 1`; params
        // whose counters differ (a group that gained params later) run as separate calls.
        std::vector<float> values(steps.size());
        for (size_t i = 0; i < steps.size(); ++i) {
          float* c = static_cast<float*>(steps[i].data_ptr());
          *c += 1.0f;
          values[i] = *c;
        }
        std::vector<bool> done(steps.size(), false);
        for (size_t i = 0; i < steps.size(); ++i) {
          if (done[i]) continue;
          TensorVec p, g, m, v, lp;
          for (size_t j = i; j < steps.size(); ++j) {
            if (done[j] || values[j] != values[i]) continue;
            done[j] = true;
            p.push_back(params[j]);
            g.push_back(grads[j]);
            m.push_back(exp_avgs[j]);
            v.push_back(exp_avg_sqs[j]);
            if (!lowp_params.empty()) lp.push_back(lowp_params[j]);
          }
          AdamOptions o = opt;
          o.step = values[i];
          cpu::adam(p, g, m, v, lp, o, inv_scale.has_value(), inv);
        }
      },
      [&](void* stream) {
#if MIXPREC_WITH_CUDA
        // Counters advance on the device (+1, +0 for a skipped step); the kernel reads them.
        if (!steps.empty()) add_step_increments(steps, found_inf);
        cuda::adam(params, grads, exp_avgs, exp_avg_sqs, lowp_params, opt,
                   inv_scale ? &*inv_scale : nullptr, found_inf ? &*found_inf : nullptr, steps,
                   stream);
#endif
      });
  bump_versions({&params, &exp_avgs, &exp_avg_sqs, &lowp_params});
  if (!steps.empty()) bump_versions({&steps});
}

void fused_sgd_(const TensorVec& params, const TensorVec& grads, const TensorVec& momentum_buffers,
                const TensorVec& lowp_params, const SgdOptions& opt, const OptTensor& inv_scale,
                const OptTensor& found_inf) {
  constexpr const char* op = "fused_sgd_";
  check_hyper(op, "lr", opt.lr, 0.0);
  check_hyper(op, "momentum", opt.momentum, 0.0);
  check_hyper(op, "weight_decay", opt.weight_decay, 0.0);
  TORCH_CHECK_VALUE(std::isfinite(opt.dampening), "mixprec.", op,
                    ": dampening must be finite, got ", opt.dampening);
  TORCH_CHECK_VALUE(!opt.nesterov || (opt.momentum > 0 && opt.dampening == 0), "mixprec.", op,
                    ": nesterov needs momentum > 0 and dampening == 0 (as torch.optim.SGD)");
  if (params.empty()) return;
  const auto device = list_device(params);
  check_list(op, "params", params, device, Dtypes::kFloat32);
  check_list(op, "grads", grads, device, Dtypes::kFloating);
  check_same_sizes(op, "params", params, "grads", grads);
  if (opt.momentum != 0.0) {
    check_list(op, "momentum_buffers", momentum_buffers, device, Dtypes::kFloat32);
    check_same_sizes(op, "params", params, "momentum_buffers", momentum_buffers);
  } else {
    TORCH_CHECK_VALUE(momentum_buffers.empty(), "mixprec.", op,
                      ": momentum is 0 so momentum_buffers must be an empty list, got ",
                      momentum_buffers.size(), " tensors");
  }
  if (!lowp_params.empty()) {
    check_list(op, "lowp_params", lowp_params, device, Dtypes::kLowp);
    check_same_sizes(op, "params", params, "lowp_params", lowp_params);
  }
  check_optional_scalars(op, inv_scale, found_inf, device);
  on_device(
      op, device,
      [&] {
        if (found_inf && cpu_scalar(*found_inf) != 0.0f) return;  // [Note: skipped steps]
        cpu::sgd(params, grads, momentum_buffers, lowp_params, opt, inv_scale.has_value(),
                 inv_scale ? cpu_scalar(*inv_scale) : 1.0f);
      },
      [&](void* stream) {
#if MIXPREC_WITH_CUDA
        cuda::sgd(params, grads, momentum_buffers, lowp_params, opt,
                  inv_scale ? &*inv_scale : nullptr, found_inf ? &*found_inf : nullptr, stream);
#endif
      });
  bump_versions({&params, &momentum_buffers, &lowp_params});
}

void scale_copy_and_check_(const TensorVec& dsts, const TensorVec& srcs,
                           const at::Tensor& found_inf, const at::Tensor& scale) {
  constexpr const char* op = "scale_copy_and_check_";
  if (dsts.empty() && srcs.empty()) return;
  const auto device = check_pairs(op, dsts, srcs);
  for (size_t i = 0; i < dsts.size(); ++i) {
    TORCH_CHECK_VALUE(dsts[i].scalar_type() == srcs[i].scalar_type(), "mixprec.", op,
                      ": dsts[", i, "] is ", dsts[i].scalar_type(), " but srcs[", i, "] is ",
                      srcs[i].scalar_type(), "; give the same dtype (use copy_cast_ to cast)");
  }
  check_scalar_tensor(op, "found_inf", found_inf, device);
  check_scalar_tensor(op, "scale", scale, device);
  on_device(
      op, device,
      [&] {
        if (cpu::scale_copy_check(dsts, srcs, cpu_scalar(scale))) {
          *static_cast<float*>(found_inf.data_ptr()) = 1.0f;
        }
      },
      [&](void* stream) {
#if MIXPREC_WITH_CUDA
        // Two passes on CUDA (copy, then the in-place unscale, which checks the copied
        // source values before scaling): same results as the CPU's one pass.
        TensorVec to_copy, from;
        for (size_t i = 0; i < dsts.size(); ++i) {
          if (dsts[i].is_same(srcs[i])) continue;
          to_copy.push_back(dsts[i]);
          from.push_back(srcs[i]);
        }
        foreach_copy(to_copy, from);
        foreach_unscale(dsts, found_inf, scale);
#endif
      });
  bump_versions({&dsts});
}

void copy_cast_(const TensorVec& dsts, const TensorVec& srcs) {
  constexpr const char* op = "copy_cast_";
  if (dsts.empty() && srcs.empty()) return;
  const auto device = check_pairs(op, dsts, srcs);
  on_device(
      op, device, [&] { cpu::copy_cast(dsts, srcs); },
      [&](void* stream) {
#if MIXPREC_WITH_CUDA
        foreach_copy(dsts, srcs);
#endif
      });
  bump_versions({&dsts});
}

namespace {

void flat_copy(const char* op, const at::Tensor& flat, const TensorVec& tensors, bool into_flat) {
  const char* name = into_flat ? "srcs" : "dsts";
  const auto device = flat.device();
  check_list(op, "flat", {flat}, device, Dtypes::kFloating);
  TORCH_CHECK_VALUE(flat.dim() == 1, "mixprec.", op, ": flat must be 1-D, got sizes ",
                    flat.sizes(), "; pass flat.view(-1)");
  check_list(op, name, tensors, device, Dtypes::kFloating);
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  TORCH_CHECK_VALUE(total == flat.numel(), "mixprec.", op, ": flat has ", flat.numel(),
                    " elements but the ", tensors.size(), " ", name, " hold ", total,
                    "; size flat to the sum of their numels");
  on_device(
      op, device, [&] { cpu::flat_copy(flat, tensors, into_flat); },
      [&](void* stream) {
#if MIXPREC_WITH_CUDA
        // The flat buffer's slices, back to back, as the CPU path (cpu::flat_copy).
        TensorVec slices;
        int64_t offset = 0;
        for (const auto& t : tensors) {
          slices.push_back(flat.narrow(0, offset, t.numel()));
          offset += t.numel();
        }
        if (into_flat) {
          foreach_copy(slices, tensors);
        } else {
          foreach_copy(tensors, slices);
        }
#endif
      });
}

}  // namespace

int64_t cpu_parallel_min_bytes() { return cpu::kParallelMinBytes; }

int64_t cpu_parallel_regions() { return cpu::parallel_regions(); }

void flat_copy_in_(const at::Tensor& flat, const TensorVec& srcs) {
  flat_copy("flat_copy_in_", flat, srcs, true);
  flat.unsafeGetTensorImpl()->bump_version();
}

void flat_copy_out_(const TensorVec& dsts, const at::Tensor& flat) {
  flat_copy("flat_copy_out_", flat, dsts, false);
  bump_versions({&dsts});
}

}  // namespace mixprec::kernels
