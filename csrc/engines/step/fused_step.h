// The post-backward optimizer step in one call ([Note: one call per step]).
//
// [Note: one call per step]
// A fused-eligible step (torch Adam/AdamW/SGD, see src/mixprec/kernels.py) crosses from
// Python into C++ once per optimizer: src/mixprec/engines/base.py (Engine.step) decides,
// from what it already knows on the host, which of these the step still owes, and this
// call runs them in order without returning to Python and without reading a device value:
//   1. the inf/nan check of the gradients, with the unscale (fp16: x 1/scale, in place;
//      bf16/fp32: x 1), setting found_inf, when the clip ([Note: clip inside the update]
//      in engines/base.py) did not do it already; on ddp, the flags the Reducers agreed
//      during backward ([Note: non-finite check in the copy-in] in
//      engines/replicated/reducer.h) replace the pass when every Reducer has one;
//   2. the agreement of found_inf across ranks (all-reduce MAX on the device flag): the
//      sharded engines, whose ranks each checked only their shard;
//   3. the fused update of every group, the gradients times grad_scale (the clip's
//      factor) inside it, skipped on the device when found_inf is set, the low-precision
//      copies written in the same pass;
//   4. the all-gather of the updated shards (zero1/zero2; zero3/fsdp gather at the next
//      forward);
//   5. the loss scaler's update, when this step ends the iteration ([Note: one scaler
//      update per iteration] in engines/base.py).
// The reduction of the gradients (zero: ShardedCore::reduce) is finished before, by the
// clip or the step's own fold, since the optimizer reads the reduced shards by name.
#pragma once

#include "engines/replicated/reducer.h"
#include "engines/sharded/core.h"
#include "kernels/multi_tensor.h"
#include "precision/grad_scaler.h"

#include <optional>
#include <string>
#include <vector>

namespace mixprec::engines {

// One fused Adam/AdamW kernel call (its tensors share a device and a step count layout).
struct AdamGroup {
  kernels::TensorVec params, grads, exp_avgs, exp_avg_sqs, lowp_params, steps;
  kernels::AdamOptions opt;
};

// One fused SGD kernel call.
struct SgdGroup {
  kernels::TensorVec params, grads, momentum_buffers, lowp_params;
  kernels::SgdOptions opt;
};

struct StepPlan {
  std::vector<AdamGroup> adam;
  std::vector<SgdGroup> sgd;
  kernels::OptTensor found_inf;        // the step's flag (None: decided on the host already)
  bool check = false;                  // 1. check (and unscale by scaler) the gradients first
  std::vector<Reducer*> reducers;      //    ... unless every one of these has a fresh flag
  std::string agree_group;             // 2. all-reduce MAX found_inf over this group
  kernels::OptTensor grad_scale;       // 3. the update's gradient factor (None: x 1)
  std::vector<sharded::ShardedCore*> gather;  // 4. gather_params(false) after the update
  precision::GradScaler* scaler = nullptr;    // fp16: unscale by it in 1
  bool update_scaler = false;                 // 5. scaler->update() at the end
  // What the step's result reports, kept before step 5 clears the flag and moves the
  // scale: found_inf after 2 is copied into keep_found_inf, the scale the step used into
  // keep_scale (both optional, 1-element).
  kernels::OptTensor keep_found_inf, keep_scale;
};

void fused_step(const StepPlan& plan);

// [Note: non-finite check in the copy-in]: take every reducer's fresh agreed flag and OR
// it into found_inf (on the device). False when some reducer has none (its model had no
// synchronising backward since): the caller then checks the gradients itself.
bool merge_nonfinite_checks(const std::vector<Reducer*>& reducers, const at::Tensor& found_inf);

// Finish every core's pending reductions (ShardedCore::reduce, in the given order, the same
// on every rank) and say which cores hold gradients: the sharded engines' wait for their
// reductions, one call for all cores.
std::vector<bool> finish_reductions(const std::vector<sharded::ShardedCore*>& cores);

}  // namespace mixprec::engines
