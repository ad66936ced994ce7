// The replicated (DDP) engine's gradient reducer.
//
// [Note: bucket order]
// Parameters are registered in model order and assigned to buckets in REVERSE
// order (gradients of the last layers are ready first), per dtype/device, with a
// small first bucket (1 MiB) so communication starts early and a cap (25 MiB) for
// the rest. A bucket's all-reduce starts as soon as all its gradients are ready AND
// every earlier bucket has started, so every rank issues the collectives in the
// same order whatever order its hooks fire in (Gloo and NCCL match collectives by
// issue order).
//
// [Note: gradients are views into buckets]
// When a bucket's dtype equals the gradient's dtype, the gradient the optimizer
// sees (`target.grad`) IS a view into the bucket: the hook multiplies it by 1/N in
// place (or copies the fresh gradient into the view with the 1/N fused into that
// copy), the all-reduce SUMs the bucket, and no copy-out is needed. Autograd then
// accumulates the next micro-batches straight into the view. When the reduce
// dtype differs (e.g. bf16 reduction of fp32 grads), the bucket is a separate
// buffer and the reduced values are copied back at the end of backward.
//
// [Note: non-finite check in the copy-in]
// With check_nonfinite (bf16/fp32 policies: the engine's non-finite guard, see [Note:
// non-finite guard] in src/mixprec/engines/base.py), the pass that applies 1/N to a
// gradient (in place, or fused into its copy into the bucket) also checks it for inf/nan
// (kernels::scale_copy_and_check_), so the optimizer step needs no pass of its own. The
// flag is agreed without a collective of its own: the last bucket has one extra element
// that receives this rank's flag just before that bucket's all-reduce is launched (every
// other gradient has been checked by then: a bucket launches only after every earlier
// one), and the SUM makes it the number of ranks that saw inf/nan. The check is on the
// values each rank contributes (each already times 1/N, so their sum cannot overflow);
// it is active only when every bucket holds its gradients as views (no reduce-dtype cast,
// whose rounding to a narrower type it would not see): otherwise the engine checks the
// reduced gradients itself, as before. The flag covers the gradients the backward
// produced: one written into .grad afterwards by the caller is not checked again, and a
// backward without a sync (no_sync) leaves no flag, so the step then checks by itself.
//
// [Note: aligned bucket views]
// Each gradient's view starts at a 16-byte boundary of its bucket (a multiple of 4
// elements in fp32, 8 in bf16/fp16), so the .grad tensors the optimizer's multi-tensor
// kernels read are as aligned as separately allocated tensors and take the vectorised
// path (csrc/kernels/cuda/multi_tensor_apply.cuh, [Note: vectorised loads]). The gaps
// (at most 15 bytes per parameter) are zero from allocation, are written by no hook
// (views cover only their gradient) and all-reduce to zero; they are never part of a
// .grad. The flag element of [Note: non-finite check in the copy-in] follows the last
// view, unaligned: it is read by itself.
//
// [Note: low-precision parameters]
// A bf16/fp16 parameter with an fp32 master: its gradient is folded into the
// master's fp32 gradient by the hook on every backward (so accumulation across
// micro-batches is fp32), then dropped from the low-precision parameter.
#pragma once

#include "compat/torch_compat.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::engines {

struct ReducerOptions {
  int64_t bucket_cap_bytes = 25 * 1024 * 1024;
  int64_t first_bucket_cap_bytes = 1024 * 1024;
  // Reduce dtype; Undefined means "the gradient's own dtype".
  c10::ScalarType reduce_dtype = c10::ScalarType::Undefined;
  bool find_unused_parameters = false;
  bool check_nonfinite = false;  // [Note: non-finite check in the copy-in]
};

class Reducer {
 public:
  // params[i]: the model's leaf parameter whose gradient accumulator is hooked.
  // targets[i]: the tensor whose .grad the optimizer reads (params[i] itself, or its
  // fp32 master). names[i]: for error messages.
  Reducer(std::vector<at::Tensor> params, std::vector<at::Tensor> targets,
          std::vector<std::string> names, const std::string& group_name,
          const ReducerOptions& options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // false: hooks only accumulate locally (no_sync / accumulate()).
  void set_sync(bool sync);
  bool sync() const { return sync_; }

  // Introspection for tests and benchmarks.
  std::vector<std::vector<int64_t>> bucket_indices() const;
  int64_t bytes_reduced_last_backward() const { return bytes_last_; }
  int64_t world_size() const { return world_size_; }

  // [Note: non-finite check in the copy-in]: the agreed flag of the last synchronising
  // backward (1 element, > 0 when some rank saw inf/nan), once: a second call, or a call
  // after no checked backward, returns nothing (the caller then checks by itself).
  std::optional<at::Tensor> take_nonfinite_check();
  bool checks_nonfinite() const { return check_active_; }

 private:
  struct Slot {
    at::Tensor param;   // hooked leaf parameter
    at::Tensor target;  // whose .grad holds the reduced gradient
    std::string name;
    size_t bucket = 0;
    int64_t offset = 0;  // element offset in the bucket
    bool lowp = false;   // param is a low-precision copy of an fp32 master
    bool ready = false;  // gradient arrived in this backward
    at::Tensor view;     // view of the bucket for this slot, shaped like target
  };
  struct Bucket {
    at::Tensor storage;         // flat, reduce dtype (+1 flag element: last bucket, see above)
    int64_t grad_numel = 0;     // gradient elements in storage (alignment gaps not counted)
    std::vector<size_t> slots;  // indices into slots_
    size_t pending = 0;         // slots not ready yet in this backward
    bool grad_is_view = false;  // target grads are views of storage
    c10::intrusive_ptr<c10d::Work> work;
  };

  void build_buckets();
  void on_grad_ready(size_t index);
  void mark_ready_locked(size_t index);
  void launch_ready_locked();
  void finalize();
  void reset_locked();

  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<compat::NodePtr, uintptr_t>> hooks_;  // compat/torch_compat.h
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  ReducerOptions options_;
  int64_t world_size_ = 1;
  bool sync_ = true;
  bool callback_queued_ = false;
  size_t next_launch_ = 0;
  int64_t bytes_last_ = 0;
  int64_t bytes_running_ = 0;
  // [Note: non-finite check in the copy-in]
  bool check_active_ = false;  // check_nonfinite asked and every bucket holds views
  bool checked_ = false;       // agreed_flag_ is fresh (a checked backward finished)
  at::Tensor local_flag_;      // this rank's flag in the current backward (fp32, 1 element)
  at::Tensor agreed_flag_;     // after finalize: the sum of every rank's flag
  at::Tensor inv_world_;       // 1/N as an fp32 1-element tensor on the device
  int64_t flag_index_ = 0;     // the flag's element in the last bucket's storage
  std::mutex mutex_;
};

}  // namespace mixprec::engines
