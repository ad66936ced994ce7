// The sharding core shared by the sharded engines (ZeRO stages; FSDP later).
//
// Owns, per rank: the fp32 master shard (flat, this rank's slice of every bucket),
// the fp32 gradient shard, low-precision shards for buckets stored in bf16/fp16,
// the flat parameter buffers the model's parameters are views of, and the
// gradient buckets with their C++ hooks on the parameters' gradient accumulators.
// The layout is in layout.h ([Note: bucket order], [Note: even split]).
//
// [Note: gradient reduction]
// A hook adds grad * (1/N) into the parameter's slot of its fp32 bucket (the 1/N
// is fused into that pass; the collective SUMs: never ReduceOp.AVG) and drops the
// parameter's own .grad. When reduce_in_backward is set (ZeRO-2) and the core is
// syncing, a bucket's collective starts once all its slots are ready AND every
// earlier bucket has started; the end-of-backward callback finishes them and adds
// the owned slice into the gradient shard. Otherwise (ZeRO-1, or inside no_sync)
// the buckets keep accumulating in fp32 and reduce() launches them all, in bucket
// order, when the engine needs the gradients (optimizer step, clipping, the end
// of coalesce_grad_reduction()).
//
// [Note: which collective]
// kReduceScatter uses the group's reduce_scatter_single; kAllReduce all-reduces
// the bucket and keeps the owned slice. Both SUM the same fp32 values, so the
// owned result is identical; on Gloo the all-reduce is faster (see docs/zero.md).
//
// [Note: parameter sharding]
// With shard_params (ZeRO-3 / FSDP, one core per unit) the flat parameter buffers
// are freed between uses: their storage is released (0 bytes) while the parameters
// stay the same leaf tensors, views of that storage, so their shapes, names and
// gradient accumulators (hence the hooks above) never change. unshard() allocates
// the storage again and all-gathers the owned shards (storage dtype) into it; the
// views see the data with no set_data. reshard() releases it. The collective writes
// bypass the autograd version counter, so tensors saved for backward that alias the
// parameters are valid again once the unit is gathered before its backward. With
// reshard_after_backward the hook that receives the unit's last gradient of a
// backward releases the storage: every node using a parameter has run before its
// AccumulateGrad fires.
#pragma once

#include "engines/sharded/layout.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace mixprec::engines::sharded {

enum class Collective { kAllReduce, kReduceScatter };

struct CoreOptions {
  int64_t bucket_cap_bytes = 25 * 1024 * 1024;
  int64_t first_bucket_cap_bytes = 1024 * 1024;
  bool reduce_in_backward = true;  // ZeRO-2: reduce-scatter while backward runs
  bool free_grad_buckets = true;   // release full-size fp32 buckets after each reduction
  Collective collective = Collective::kReduceScatter;
  bool shard_params = false;            // ZeRO-3/FSDP: flat parameter buffers freed between uses
  bool reshard_after_backward = false;  // free them when the unit's last gradient arrives
};

class ShardedCore {
 public:
  // params: the model's trainable leaf parameters in model order (their current
  // values become the fp32 masters, exactly); storage_dtypes[i]: the dtype the
  // parameter is stored and gathered in from now on.
  ShardedCore(std::vector<at::Tensor> params, std::vector<std::string> names,
              std::vector<c10::ScalarType> storage_dtypes, const std::string& group_name,
              const CoreOptions& options);
  ~ShardedCore();
  ShardedCore(const ShardedCore&) = delete;
  ShardedCore& operator=(const ShardedCore&) = delete;

  // false: hooks only accumulate into the fp32 buckets (no_sync / accumulate()).
  void set_sync(bool sync);
  bool sync() const { return sync_; }

  // Launch and finish every bucket holding unreduced gradients (same order on all ranks).
  void reduce();
  // Zero the gradient shard and drop unreduced gradients.
  void zero_grad();
  // True when a reduction landed in the gradient shard since the last zero_grad().
  bool has_grads() const { return has_grads_; }
  // All-gather every bucket's owned parameters (storage dtype) into the model's parameters.
  // refresh_lowp: first round the fp32 master shard into the low-precision shards.
  void gather_params(bool refresh_lowp);
  // [Note: parameter sharding]. unshard(async_op=true) only launches the all-gathers
  // (prefetch); wait_unshard() finishes them. Both are no-ops when already gathered.
  void unshard(bool async_op);
  void wait_unshard();
  void reshard();
  bool unsharded() const { return unsharded_; }
  // Round the fp32 master shard into the low-precision shards (no gather).
  void refresh_lowp();
  // Bytes of flat parameter buffers currently allocated on this rank.
  int64_t param_buffer_bytes() const;
  // Full fp32 value of every parameter (all-gathers the masters), in model order.
  std::vector<at::Tensor> full_masters();

  const at::Tensor& master_shard() const { return master_; }
  const at::Tensor& grad_shard() const { return grad_; }
  // Per bucket: the low-precision shard (undefined when the bucket is stored in fp32).
  const std::vector<at::Tensor>& lowp_shards() const { return lowp_; }
  const Layout& layout() const { return layout_; }
  // (param index, bucket, shard offset, param offset, numel) for what this rank owns.
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> owned_ranges() const;
  int64_t bytes_reduced_last() const { return bytes_reduced_last_; }
  int64_t bytes_gathered_last() const { return bytes_gathered_last_; }
  // [Note: communication counters]
  // Cumulative payload handed to collectives since the last reset_comm_counters() (or
  // construction): every gradient-bucket reduction (reduce-scatter or all-reduce; the
  // bucket's full padded fp32 buffer) and every parameter all-gather (gather_params()
  // after a ZeRO-1/2 step, and each unshard() that actually gathers: the forward and the
  // backward gathers of a ZeRO-3/FSDP unit, prefetches included; the gathered padded
  // buffer in the storage dtype). Counted when the collective is launched. Not counted:
  // full_masters() (state-dict gathers, outside the training step), and the engine's
  // own small all-reduces in Python (found_inf, clip norm) and buffer broadcasts.
  struct CommCounters {
    int64_t bytes_reduced = 0;
    int64_t elements_reduced = 0;
    int64_t reductions = 0;  // bucket collectives launched
    int64_t bytes_gathered = 0;
    int64_t elements_gathered = 0;
    int64_t gathers = 0;  // bucket all-gathers launched
  };
  CommCounters comm_counters() const;
  void reset_comm_counters();
  int64_t grad_bucket_bytes() const;  // fp32 bucket memory currently allocated

 private:
  struct Bucket {
    at::Tensor grads;        // fp32 [padded], allocated on first use
    at::Tensor reduced;      // owned slice after the collective (kReduceScatter output)
    at::Tensor params_flat;  // storage dtype [padded]; the parameters are views of it
    size_t pending = 0;
    bool dirty = false;      // holds gradients not reduced yet
    c10::intrusive_ptr<c10d::Work> work;
    c10::intrusive_ptr<c10d::Work> gather;  // in-flight unshard all-gather
  };

  void on_grad_ready(size_t index);
  at::Tensor& grads_of(Bucket& bucket, size_t b);
  void launch_locked(size_t b);
  void launch_ready_locked();
  void complete_locked(size_t b);
  void finalize_backward();
  void reduce_locked();
  void unshard_locked(bool async_op);
  void wait_unshard_locked();
  void reshard_locked();

  Layout layout_;
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<bool> ready_;
  at::Tensor master_;
  at::Tensor grad_;
  std::vector<at::Tensor> lowp_;
  std::vector<std::pair<c10::intrusive_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  CoreOptions options_;
  bool sync_ = true;
  bool callback_queued_ = false;
  bool has_grads_ = false;
  bool unsharded_ = true;
  size_t grads_seen_ = 0;  // gradients received since the last unshard (reshard_after_backward)
  size_t next_launch_ = 0;
  int64_t bytes_reduced_running_ = 0;
  int64_t bytes_reduced_last_ = 0;
  int64_t bytes_gathered_last_ = 0;
  // [Note: communication counters]; atomics so they can be read without the core's lock.
  std::atomic<int64_t> bytes_reduced_total_{0};
  std::atomic<int64_t> elements_reduced_total_{0};
  std::atomic<int64_t> reductions_total_{0};
  std::atomic<int64_t> bytes_gathered_total_{0};
  std::atomic<int64_t> elements_gathered_total_{0};
  std::atomic<int64_t> gathers_total_{0};
  void count_gather(const at::Tensor& flat);
  std::mutex mutex_;
};

}  // namespace mixprec::engines::sharded
