#include "engines/step/optimizer_plan.h"

#include <c10/util/Exception.h>

namespace mixprec::engines {

namespace {

bool kernel_grad_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// A state tensor the kernels can update in place for `p`.
void check_state(const at::Tensor& s, const at::Tensor& p, const char* what) {
  TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat && s.is_contiguous() && s.device() == p.device() &&
                        s.sizes() == p.sizes(),
                    "OptimizerPlan: ", what, " must be fp32, contiguous, on the param's device and of its shape "
                    "(src/mixprec/kernels.py builds the plan only then)");
}

}  // namespace

OptimizerPlan::OptimizerPlan(bool adam, std::vector<PlanBucket> buckets)
    : adam_(adam), buckets_(std::move(buckets)) {
  for (const auto& b : buckets_) {
    const size_t n = b.params.size();
    TORCH_CHECK_VALUE(b.group >= 0, "OptimizerPlan: negative param group index");
    TORCH_CHECK_VALUE(b.state1.size() == n && (!adam_ || (b.state2.size() == n && b.steps.size() == n)),
                      "OptimizerPlan: a bucket's state lists must have one entry per param");
    TORCH_CHECK_VALUE(b.lowps.empty() || b.lowps.size() == n,
                      "OptimizerPlan: a bucket's low-precision targets are all given or none");
    for (size_t i = 0; i < n; ++i) {
      const auto& p = b.params[i];
      TORCH_CHECK_VALUE(p.defined() && p.scalar_type() == at::kFloat && p.is_contiguous(),
                        "OptimizerPlan: params must be fp32 and contiguous");
      if (b.state1[i].defined()) check_state(b.state1[i], p, adam_ ? "exp_avg" : "momentum_buffer");
      if (adam_) {
        TORCH_CHECK_VALUE(b.state1[i].defined() == b.state2[i].defined() &&
                              b.state1[i].defined() == b.steps[i].defined(),
                          "OptimizerPlan: Adam state is exp_avg, exp_avg_sq and step together");
        if (b.state2[i].defined()) {
          check_state(b.state2[i], p, "exp_avg_sq");
          TORCH_CHECK_VALUE(b.steps[i].scalar_type() == at::kFloat && b.steps[i].numel() == 1 &&
                                b.steps[i].device() == p.device(),
                            "OptimizerPlan: step counters are fp32 1-element tensors on the param's device");
        }
      }
      if (!b.lowps.empty()) {
        const auto& lp = b.lowps[i];
        TORCH_CHECK_VALUE(lp.defined() && (lp.scalar_type() == at::kBFloat16 || lp.scalar_type() == at::kHalf) &&
                              lp.is_contiguous() && lp.numel() == p.numel(),
                          "OptimizerPlan: low-precision targets are contiguous bf16/fp16 of the param's size");
      }
    }
    num_params_ += n;
  }
}

PlanStatus OptimizerPlan::collect(const std::vector<kernels::AdamOptions>& adam_options,
                                  const std::vector<kernels::SgdOptions>& sgd_options, StepPlan& out) const {
  // Check everything before filling anything: a declined plan leaves `out` as it was.
  for (const auto& b : buckets_) {
    const size_t options = adam_ ? adam_options.size() : sgd_options.size();
    TORCH_CHECK_VALUE(static_cast<size_t>(b.group) < options, "OptimizerPlan: options for param group ",
                      b.group, " missing (got ", options, ")");
    const bool needs_buffer = !adam_ && sgd_options[b.group].momentum != 0.0;
    for (size_t i = 0; i < b.params.size(); ++i) {
      const auto& p = b.params[i];
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      // p.data = ... or a gradient of another layout since the plan was built.
      if (p.scalar_type() != at::kFloat || !p.is_contiguous() || g.is_sparse() ||
          !kernel_grad_dtype(g.scalar_type()) || g.sizes() != p.sizes() || g.device() != p.device()) {
        return PlanStatus::kDeclined;
      }
      if ((adam_ || needs_buffer) && !b.state1[i].defined()) return PlanStatus::kNeedsState;
    }
  }
  for (const auto& b : buckets_) {
    const bool with_buffers = !adam_ && sgd_options[b.group].momentum != 0.0;
    kernels::TensorVec ps, gs, s1, s2, steps, lps;
    for (size_t i = 0; i < b.params.size(); ++i) {
      const auto& p = b.params[i];
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      ps.push_back(p);
      gs.push_back(g.is_contiguous() ? g : g.contiguous());
      if (adam_) {
        s1.push_back(b.state1[i]);
        s2.push_back(b.state2[i]);
        steps.push_back(b.steps[i]);
      } else if (with_buffers) {
        s1.push_back(b.state1[i]);
      }
      if (!b.lowps.empty()) lps.push_back(b.lowps[i]);
    }
    if (ps.empty()) continue;
    if (adam_) {
      out.adam.push_back(AdamGroup{std::move(ps), std::move(gs), std::move(s1), std::move(s2), std::move(lps),
                                   std::move(steps), adam_options[b.group]});
    } else {
      kernels::SgdOptions opt = sgd_options[b.group];
      opt.first_step = false;
      out.sgd.push_back(SgdGroup{std::move(ps), std::move(gs), std::move(s1), std::move(lps), opt});
    }
  }
  return PlanStatus::kReady;
}

kernels::TensorVec OptimizerPlan::grads() const {
  kernels::TensorVec out;
  out.reserve(num_params_);
  for (const auto& b : buckets_) {
    for (const auto& p : b.params) {
      const at::Tensor& g = p.grad();
      if (g.defined()) out.push_back(g);
    }
  }
  return out;
}

}  // namespace mixprec::engines
