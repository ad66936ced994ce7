// The sharding core shared by the sharded engines (ZeRO stages; FSDP later).
//
// Owns, per rank: the fp32 master shard (flat, this rank's slice of every bucket),
// the fp32 gradient shard, the flat parameter buffers the model's parameters are views
// of, and the gradient buckets with their C++ hooks on the parameters' gradient
// accumulators. The layout is in layout.h ([Note: bucket order], [Note: even split]).
//
// [Note: what lives between steps]
// Only the fp32 master shard (and the optimizer's state, held by the optimizer) lives
// across steps on every stage; zero1/2 also keep the full parameters (the model's).
// * No low-precision copy of the shard: an all-gather of a bucket stored in bf16/fp16
//   sends its owned slice of the master rounded to the storage dtype, cast into a
//   temporary at the gather (as torch's fully_shard does). The rounding is the one the
//   fused update would have written, so the gathered values are the same bits.
// * The gradient shard is dropped by zero_grad(release=true) (the optimizer's
//   zero_grad(set_to_none=True), torch's default), and allocated again by the first
//   reduction that lands in it (grad_shard() is undefined, None in Python, until then);
//   each bucket's slice is zeroed when its first reduction lands ([Note: gradient shard
//   pages]). A bucket is freed once its reduction is folded into the shard, on every
//   stage (zero1 included). The masters' .grad are views of it that the
//   engine makes when it shows the gradients (after the reductions) and that the
//   optimizer's zero_grad drops, so the memory goes when they do; a .grad the user still
//   holds keeps its old values, as in torch.
//
// [Note: gradient shard pages]
// The fp32 gradient shard (4P/N) is allocated uninitialised (at::empty) and each bucket's
// slice is zeroed right before the bucket's first reduction is added into it; readers
// (grad_shard(), ensure_grad_shard()) zero the slices no reduction reached yet. The values
// are those of a shard allocated zeroed (0 + x, the same add), but the memory is touched
// bucket by bucket: on CPU the kernel gives a page to the process when it is first
// written, so the shard's resident size grows as the buckets are folded into it, while the
// folded full-size buckets are freed (freed memory of >= MALLOC_MMAP_THRESHOLD_ goes back
// to the OS). This is what keeps ZeRO-1's step at 4P + one bucket's slice instead of
// 4P + 4P/N: its reduce() folds the buckets one by one into the shard and frees each. A
// device caching allocator reserves the whole shard at once (no page-level saving there).
//
// [Note: bucket pages on first touch]
// On CPU a full-size fp32 gradient bucket is allocated uninitialised, and each parameter's
// slot is zeroed right before its first gradient is added (0 + x: the values of a bucket
// allocated zeroed); what no gradient reached (unused parameters, alignment gaps, the
// even-split tail) is zeroed before the bucket's collective reads it (filled_grads_of).
// So the bucket's pages become resident slot by slot as backward produces the gradients,
// while autograd frees the activations of the layers it is done with, instead of the whole
// bucket at once next to the activations of every layer still ahead. ZeRO-1's backward holds
// all its buckets at its end (4P, its ideal): allocated zeroed, the first 25 MiB bucket was
// resident at the start of backward, beside the whole forward's saved activations. A device
// caching allocator reserves a bucket whole, so on a device the bucket is allocated zeroed.
//
// [Note: bounded gathers]
// gather_params() (zero1/2, after each step) rounds a bucket's owned masters into a
// storage-dtype temporary and all-gathers it into the flat parameters, with at most two
// buckets' gathers in flight: the temporaries (and a collective's own buffers) exist for two
// buckets, not for all of them (2P/N with bf16 storage). On CPU (Gloo) one: Gloo's all-gather
// stages the whole output in a temporary (a full bucket in the storage dtype), and the
// gradient shard is still alive at this point, so a second gather in flight was ZeRO-1's
// peak (TinyLM, N=2: 31 MiB over the step's resident set against 16 with one; its
// collectives run one after another on 2 cores anyway).
//
// [Note: gradient reduction]
// A hook adds grad * (1/N) into the parameter's slot of its fp32 bucket (the 1/N
// is fused into that pass; the collective SUMs: never ReduceOp.AVG) and drops the
// parameter's own .grad. When reduce_in_backward is set (ZeRO-2) and the core is
// syncing, a bucket's collective starts once all its slots are ready AND every
// earlier bucket has started; it is completed (waited, its owned slice added into the
// gradient shard, the full-size bucket freed) while backward goes on, at most
// max_inflight_buckets being in flight ([Note: bounded gradient memory]); the
// end-of-backward callback completes the rest. Otherwise (ZeRO-1, or inside no_sync)
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
//
// [Note: bounded gradient memory]
// A full-size fp32 bucket (4 bytes per element of its parameters) is allocated by the
// first gradient added into it (grads_of) and freed when its reduction is completed.
// Completing only at the end of backward would keep every bucket, i.e. the full fp32
// gradient (4P bytes), alive at the end of each backward, which is what ZeRO-2/3 exist
// to avoid. So a syncing backward (reduce_in_backward, sync_) completes buckets early:
// every launch from a hook is pushed into an InflightWindow (inflight.h), and when more
// than max_inflight_buckets reductions are in flight, the hook that launched the last
// one waits for the oldest, adds its owned slice into the gradient shard and frees the
// bucket, before returning to autograd. Launches keep their order (bucket order, the
// same on every rank: collectives are matched by order), and a rank only waits for a
// collective it has issued. So there is no deadlock: every rank issues the same
// sequence, and the rank that has issued the fewest waits for one that every rank has
// issued, which the process group completes. On CPU/Gloo the wait blocks the autograd
// thread until the bucket is reduced (its communication overlapped the computation of
// the max_inflight_buckets buckets behind it); on CUDA, wait() makes the current stream wait for the collective's
// stream, the fold is queued behind it, and the process group keeps the bucket's memory
// from being reused before its stream is done with it (record_stream), exactly as at
// the end of backward before.
// The window is shared by all cores built from one CoreOptions: zero3/fsdp build one
// core per unit, and a unit's last buckets are completed as later units launch theirs,
// not at the end of backward.
// What bounds the number of ALLOCATED full-size buckets during a syncing backward:
//   in flight (<= max_inflight_buckets, shared by the cores of the engine)
//   + F, the buckets holding gradients that are not launched yet.
// (A launch moves a bucket from F to in flight, so the sum does not change while the
// hook drains the window back to the limit.) With kReduceScatter each in-flight bucket
// also has its 1/N-size output.
// F is 1 when gradients arrive in bucket order (reverse registration order, the
// usual backward order: [Note: bucket order]): the bucket being filled. It grows when
// autograd produces gradients out of that order (several buckets partially filled at
// once), and when a bucket waits to launch behind an earlier one that is not full (a
// full bucket is never launched out of order): in the worst case, a parameter of
// bucket 0 that gets its gradient last or never (unused on this rank: its bucket only
// launches in the end-of-backward callback), every bucket is allocated before any can
// launch, as without the window. Not bounded either: buckets accumulated under no_sync
// (accumulation needs the full fp32 sum; they launch in the next syncing backward, or
// all together in reduce()), ZeRO-1 (reduces at the step; reduce() frees each bucket as it
// folds it), free_grad_buckets=false.
// reduce() launches every bucket then completes them in order: the buckets were already
// all allocated by accumulation, so a window would not lower its peak.
// grad_bucket_peak_bytes() is the window's high-water mark of allocated bucket bytes
// (a check from inside); tests/distributed/test_grad_memory.py measures the process's
// resident set instead.
//
// [Note: agreed reductions]
// Collectives are matched by their position in each rank's sequence, so whether and when a
// rank launches a bucket's reduction must not depend on which gradients it got: a unit
// used on one rank only (a layer skipped on some ranks) must not make the ranks issue
// different collectives (a hang under NCCL, a desync under Gloo). No host sync decides it:
// every rank reduces every bucket of every core that a backward went through, contributing
// zeros where it has no gradient, at points that do not depend on the gradients:
// * Hook mode (zero2; launch_from_hooks, the default): a bucket launches when its
//   gradients are ready AND every earlier bucket has launched, else in the end-of-backward
//   callback, which launches every bucket left. One core per model, and no other
//   collective during backward, so the sequence is the bucket order on every rank.
// * Engine mode (zero3/fsdp units: set_launch_from_hooks(false)): the hooks only
//   accumulate; the unit runner (src/mixprec/engines/units.py, [Note: agreed launch
//   points]) calls launch_all() for a unit when another unit's backward starts that
//   began its forward before the unit started its own (so every gradient of the unit has
//   been produced), and end_backward() for every unit at the end of backward, in unit
//   order. Those points follow the units' backward gathers, which every rank issues
//   alike. A gradient reaching a unit after launch_all() in the same backward is refused.
// * reduce() (ZeRO-1 at the step, leaf units, buckets accumulated under no_sync): it
//   reduces when the core holds unreduced gradients OR any hook of the cores of its model
//   (share_backward_count()) fired since its last reduction, i.e. a backward went through
//   the model, which every rank's backward does alike. The count is per model, so a
//   second model that no backward reached is not reduced.
// A rank whose backward gives no gradient at all to a model (its loss ignores the model)
// still differs; every other case issues the same collectives on every rank.
#pragma once

#include "engines/sharded/inflight.h"
#include "engines/sharded/layout.h"

#include "compat/torch_compat.h"

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
  // [Note: bounded gradient memory]: reductions launched during backward and not yet
  // completed, at most (>= 1). Only with reduce_in_backward.
  int64_t max_inflight_buckets = 2;
  // [Note: low-precision reduction]: the dtype gradients travel in. kFloat (default)
  // reduces the fp32 buckets as they are. kBFloat16/kHalf: at launch the fp32 bucket
  // (already holding grad/N, accumulated in fp32 over micro-batches) is rounded once to
  // that dtype, the collective SUMs in it (half the bytes on the wire), and the owned
  // result is added into the fp32 gradient shard, so accumulation stays fp32 and only
  // the cross-rank sum is rounded (as FSDP2's reduce_dtype and DeepSpeed's
  // communication_data_type). The fp32 bucket is freed once rounded, at the launch.
  c10::ScalarType reduce_dtype = c10::ScalarType::Float;
  // Shared by every core built from this CoreOptions (copies share it); a core given
  // none makes its own.
  std::shared_ptr<InflightWindow> window;
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
  // Drop unreduced gradients and zero the gradient shard; release=true frees the shard's
  // memory instead, and the full-size fp32 buckets even where free_grad_buckets is off
  // (ZeRO-1) ([Note: what lives between steps]).
  void zero_grad(bool release = false);
  // Bytes of gradient-shard memory currently allocated (0 while released).
  int64_t grad_shard_bytes() const;
  // Allocate the released gradient shard, zeroed (a no-op when allocated): for a core
  // that got no gradient while others of the same optimizer did.
  void ensure_grad_shard();
  // True when a reduction landed in the gradient shard since the last zero_grad().
  bool has_grads() const { return has_grads_; }
  // [Note: agreed reductions]. false: the hooks only accumulate, and the engine launches the
  // buckets with launch_all() / end_backward() at points every rank agrees on.
  void set_launch_from_hooks(bool on);
  bool launch_from_hooks() const { return launch_from_hooks_; }
  // Launch every bucket not launched in this backward (zeros for parameters that got no
  // gradient on this rank); no-op outside a syncing reduce_in_backward core or when done.
  void launch_all();
  // launch_all(), then complete every reduction of this core, as the end-of-backward
  // callback does in hook mode.
  void end_backward();
  // Count backward hooks together with `other` (the cores of one model), for reduce().
  void share_backward_count(const ShardedCore& other);
  // All-gather every bucket's owned masters, rounded to the storage dtype, into the model's
  // parameters.
  void gather_params();
  // [Note: parameter sharding]. unshard(async_op=true) only launches the all-gathers
  // (prefetch); wait_unshard() finishes them. Both are no-ops when already gathered.
  void unshard(bool async_op);
  void wait_unshard();
  void reshard();
  bool unsharded() const { return unsharded_; }
  // Bytes of flat parameter buffers currently allocated on this rank.
  int64_t param_buffer_bytes() const;
  // Full fp32 value of every parameter (all-gathers the masters), in model order.
  std::vector<at::Tensor> full_masters();
  // [Note: one parameter's master, gathered]
  // The full fp32 value of parameter `index` (model order) alone, assembled from the owned
  // ranges of the master shards: a streaming save's unit (src/mixprec/engines/streamed.py),
  // where full_masters() would hold a whole core. The parameter's slot may lie in several
  // ranks' shards ([Note: even split]); each piece goes straight from its owner's master
  // shard into its place in the result, so the ranks that receive the tensor hold it once
  // and nothing else (no padded bucket, no staging copy), and the others hold nothing:
  // * dst >= 0 (a rank of the core's group): only rank dst receives it; every other owner
  //   sends its piece to dst (point-to-point, matched by order); the other ranks get an
  //   undefined tensor (None in Python);
  // * dst == -1: every rank receives it; each owner broadcasts its piece.
  // A collective: every rank of the group calls it with the same (index, dst), and the
  // calls of all ranks come in the same order. Not counted in comm_counters(), as
  // full_masters().
  at::Tensor gather_master(int64_t index, int64_t dst);

  // The model's parameters this core shards, in model order (as given).
  const std::vector<at::Tensor>& params() const { return params_; }
  const at::Tensor& master_shard() const { return master_; }
  // The gradient shard (undefined while released), every slice holding its value
  // ([Note: gradient shard pages]).
  at::Tensor grad_shard();
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
  // High-water mark of fp32 bucket bytes allocated by all cores sharing this core's window
  // since construction or reset_grad_bucket_peak() ([Note: bounded gradient memory]).
  int64_t grad_bucket_peak_bytes() const { return window_->peak_bucket_bytes(); }
  void reset_grad_bucket_peak() { window_->reset_peak(); }
  // Reductions launched during backward and not completed yet, over the shared window.
  int64_t inflight_buckets() const { return window_->inflight(); }

 private:
  struct Bucket {
    at::Tensor grads;        // fp32 [padded], allocated on first use
    at::Tensor reduced;      // owned slice after the collective (kReduceScatter output)
    at::Tensor sent;         // low-precision copy of grads being reduced (reduce_dtype != fp32)
    at::Tensor params_flat;  // storage dtype [padded]; the parameters are views of it
    size_t pending = 0;
    bool dirty = false;      // holds gradients not reduced yet
    bool filled = true;      // every element of grads holds its value ([Note: bucket pages on first touch])
    c10::intrusive_ptr<c10d::Work> work;
    uint64_t launch_id = 0;  // the window's id of the in-flight reduction (0: not in it)
    c10::intrusive_ptr<c10d::Work> gather;  // in-flight unshard all-gather
    at::Tensor gather_src;                  // its input, when cast from the master (kept alive)
  };

  bool on_grad_ready(size_t index);  // true: a bucket was pushed into the window
  void drain_window();
  void complete_if_inflight(size_t b, uint64_t launch_id);
  at::Tensor& grads_of(Bucket& bucket, size_t b);
  at::Tensor& filled_grads_of(Bucket& bucket, size_t b);  // grads_of, every element holding its value
  void release_grads(Bucket& bucket);
  void launch_locked(size_t b);
  bool launch_ready_locked();
  void complete_locked(size_t b);
  void finalize_backward();
  void reduce_locked();
  void unshard_locked(bool async_op);
  void wait_unshard_locked();
  void reshard_locked();
  at::Tensor gather_source(size_t b) const;
  void ensure_grad_shard_locked();
  at::Tensor grad_slice_locked(size_t b);  // bucket b's slice of grad_, zeroed on first use
  void materialize_grad_shard_locked();
  bool launch_all_locked();

  Layout layout_;
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<bool> ready_;
  at::Tensor master_;
  at::Tensor grad_;
  std::vector<bool> slot_written_;  // per parameter: its slot of an unfilled bucket holds a value
  std::vector<bool> slice_zeroed_;  // per bucket: its slice of grad_ holds a value
  std::vector<std::pair<compat::NodePtr, uintptr_t>> hooks_;  // compat/torch_compat.h
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  CoreOptions options_;
  std::shared_ptr<InflightWindow> window_;
  bool sync_ = true;
  bool callback_queued_ = false;
  bool has_grads_ = false;
  bool unsharded_ = true;
  size_t grads_seen_ = 0;  // gradients received since the last unshard (reshard_after_backward)
  // [Note: agreed reductions]
  bool launch_from_hooks_ = true;
  bool launched_all_ = false;  // launch_all() ran in this backward
  std::shared_ptr<std::atomic<uint64_t>> hooks_fired_ = std::make_shared<std::atomic<uint64_t>>(0);
  uint64_t hooks_reduced_ = 0;  // hooks_fired_ when this core last reduced (or dropped) gradients
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

// Gives `t`'s storage `nbytes` of fresh memory from its own allocator (0: releases it),
// allocated on `t`'s device: a DeviceGuard makes that device current first, because a device
// allocator (CUDA's caching allocator) allocates on the current device, which on a rank
// that drives several GPUs need not be the parameter's (issue 23, G8). Used to re-make the
// flat parameter buffers' storage (unshard/reshard).
void set_storage_bytes(const at::Tensor& t, size_t nbytes);

// What set_storage_bytes did on a fake device with two or more indices (a test seam, run by
// tests/test_gpu_paths.py on any CPU): the fake device's current index was `current_before`
// (0), a tensor on index `tensor_index` had its storage re-made, the allocator saw index
// `allocated_on` current while it allocated, and `current_after` was current afterwards.
struct StorageAllocationProbe {
  int64_t tensor_index, allocated_on, current_before, current_after;
};
StorageAllocationProbe probe_storage_allocation_device(int64_t index);

}  // namespace mixprec::engines::sharded
