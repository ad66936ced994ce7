// What a fused step reads, gathered once per optimizer ([Note: the step plan]).
//
// [Note: the step plan]
// A fused-eligible optimizer (torch Adam/AdamW/SGD over fp32 contiguous params, see
// src/mixprec/kernels.py) is stepped from a plan built once: its params in param-group
// order, their optimizer state tensors (Adam: exp_avg, exp_avg_sq and the device step
// counter; SGD: the momentum buffer), the low-precision tensor each update also writes,
// bucketed by (param group, device, has-low-precision-target) as the kernels want them.
// Per step Python hands over only the param groups' hyper-parameters (O(param groups));
// this class reads each param's gradient itself (a param without one is skipped, as torch
// does), checks that every param and gradient still fits the kernels, and fills the kernel
// groups of a StepPlan. Python keeps the plan while the optimizer's param_groups, its state
// dict and the low-precision targets are the same objects (src/mixprec/kernels.py,
// ``step_plan``); mixprec's own state loads drop it explicitly.
//
// What a param still needs the Python path for, collect() reports instead of doing:
// kDeclined (a gradient or param the kernels cannot take: nothing done, the generic
// optimizer steps) and kNeedsState (a param with a gradient but no optimizer state yet:
// the Python path creates it, then a new plan is built).
#pragma once

#include "engines/step/fused_step.h"

#include <vector>

namespace mixprec::engines {

// The params of one param group that share a device and whether they have a
// low-precision target: one kernel call.
struct PlanBucket {
  int64_t group = 0;  // index into optimizer.param_groups
  kernels::TensorVec params;
  kernels::TensorVec state1;  // Adam: exp_avg; SGD: momentum buffer (undefined: none yet)
  kernels::TensorVec state2;  // Adam: exp_avg_sq (undefined: none yet); SGD: unused
  kernels::TensorVec steps;   // Adam: the 1-element step counters; SGD: unused
  kernels::TensorVec lowps;   // all defined, or empty when this bucket has none
};

enum class PlanStatus : int { kReady = 0, kDeclined = 1, kNeedsState = 2 };

class OptimizerPlan {
 public:
  OptimizerPlan(bool adam, std::vector<PlanBucket> buckets);

  bool adam() const { return adam_; }
  size_t num_params() const { return num_params_; }

  // Fill out.adam / out.sgd with the params that hold a gradient, with the per-group
  // options (one per param group; Adam's ignore .step, SGD's first_step is false: every
  // param the plan steps has its buffer). Reads no device value.
  PlanStatus collect(const std::vector<kernels::AdamOptions>& adam_options,
                     const std::vector<kernels::SgdOptions>& sgd_options, StepPlan& out) const;

  // The defined gradients of the planned params, in plan order.
  kernels::TensorVec grads() const;


 private:
  bool adam_;
  std::vector<PlanBucket> buckets_;
  size_t num_params_ = 0;
};

}  // namespace mixprec::engines
