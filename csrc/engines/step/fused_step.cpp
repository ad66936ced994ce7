#include "engines/step/fused_step.h"

#include "comm/process_group.h"

#include <ATen/ops/maximum.h>
#include <ATen/ops/ones.h>
#include <c10/util/Exception.h>

namespace mixprec::engines {

void fused_step(const StepPlan& plan) {
  // [Note: one call per step] (fused_step.h): the steps in their order.
  bool check = plan.check;
  if (check && !plan.reducers.empty()) {
    TORCH_CHECK_VALUE(plan.found_inf.has_value(), "fused_step: reducers need found_inf");
    // every gradient was checked in the copy-in when each reducer has a flag
    check = !merge_nonfinite_checks(plan.reducers, *plan.found_inf);
  }
  if (check) {
    TORCH_CHECK_VALUE(plan.found_inf.has_value(), "fused_step: check=True needs found_inf");
    kernels::TensorVec grads;
    for (const auto& g : plan.adam) grads.insert(grads.end(), g.grads.begin(), g.grads.end());
    for (const auto& g : plan.sgd) grads.insert(grads.end(), g.grads.begin(), g.grads.end());
    if (!grads.empty()) {
      const at::Tensor inv = plan.scaler != nullptr ? plan.scaler->inv_scale()
                                                    : at::ones({1}, plan.found_inf->options());
      kernels::unscale_and_check_(grads, *plan.found_inf, inv);
    }
  }
  if (!plan.agree_group.empty()) {
    TORCH_CHECK_VALUE(plan.found_inf.has_value(), "fused_step: agree_group needs found_inf");
    std::vector<at::Tensor> flag{*plan.found_inf};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    comm::resolve(plan.agree_group)->allreduce(flag, opts)->wait();
  }
  if (plan.keep_found_inf.has_value() && plan.found_inf.has_value()) {
    plan.keep_found_inf->copy_(*plan.found_inf);
  }
  for (const auto& g : plan.adam) {
    kernels::fused_adam_(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.lowp_params, g.opt,
                         plan.grad_scale, plan.found_inf, g.steps);
  }
  for (const auto& g : plan.sgd) {
    kernels::fused_sgd_(g.params, g.grads, g.momentum_buffers, g.lowp_params, g.opt,
                        plan.grad_scale, plan.found_inf);
  }
  // A skipped update left the shards as they were: gathering them rewrites the same
  // values, so the gather needs no host decision either.
  for (auto* core : plan.gather) core->gather_params();
  if (plan.scaler != nullptr && plan.keep_scale.has_value()) {
    plan.keep_scale->copy_(plan.scaler->scale());
  }
  if (plan.update_scaler) {
    TORCH_CHECK_VALUE(plan.scaler != nullptr, "fused_step: update_scaler needs the scaler");
    plan.scaler->update();
  }
}

bool merge_nonfinite_checks(const std::vector<Reducer*>& reducers, const at::Tensor& found_inf) {
  std::vector<at::Tensor> flags;
  for (auto* r : reducers) {
    auto f = r->take_nonfinite_check();
    if (f.has_value()) flags.push_back(*f);
  }
  if (reducers.empty() || flags.size() != reducers.size()) return false;
  for (const auto& f : flags) {
    found_inf.copy_(at::maximum(found_inf, f.gt(0).to(found_inf.scalar_type())));
  }
  return true;
}

std::vector<bool> finish_reductions(const std::vector<sharded::ShardedCore*>& cores) {
  std::vector<bool> have;
  have.reserve(cores.size());
  for (auto* core : cores) {
    core->reduce();
    have.push_back(core->has_grads());
  }
  return have;
}

}  // namespace mixprec::engines
