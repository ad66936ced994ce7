#include "engines/sharded/core.h"

#include "comm/process_group.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace mixprec::engines::sharded {

namespace {

// [Note: a folded bucket gives its pages back first]
// Folding a reduced bucket copies its owned 1/N into the gradient shard, whose pages are
// new (zeroed when first used, [Note: gradient shard pages]); the bucket is freed after.
// For a moment the process would hold the whole bucket plus its slice. On ZeRO-1 every
// bucket is full when the step folds them (4P), so that moment is the step's peak: 4P +
// the first bucket / N (12.5 MiB of a 25 MiB bucket at N=2). Once the collective is done
// only the owned range of an all-reduced bucket is read again, so on Linux the pages of a
// CPU bucket outside that range are returned to the OS (MADV_DONTNEED) before the slice is
// written: the fold never holds more than the buckets did. Only a tensor that is the sole
// user of its storage is touched (no view can see the zeros that the released pages read
// as), only whole pages strictly inside its bytes, and the allocation is still freed as
// usual afterwards. Values are not changed: the owned range is read as before.
#if defined(__linux__)
// Whole pages strictly inside elements [from, to) of `t`, when `t` may give them back: a
// contiguous CPU tensor that is the sole user of its storage (no view can see the zeros the
// released pages read as). Returns false when it may not (then nothing is released).
bool release_pages(const at::Tensor& t, int64_t from, int64_t to) {
  if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous() || t.storage().use_count() != 1) return false;
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const auto elem = static_cast<uintptr_t>(t.element_size());
  const uintptr_t a = (base + static_cast<uintptr_t>(from) * elem + page - 1) / page * page;
  const uintptr_t b = (base + static_cast<uintptr_t>(to) * elem) / page * page;
  if (b > a) (void)madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED);  // advisory
  return true;
}
#else
bool release_pages(const at::Tensor&, int64_t, int64_t) { return false; }
#endif

void release_pages_outside(const at::Tensor& t, int64_t keep_begin, int64_t keep_end) {
  if (release_pages(t, 0, keep_begin)) release_pages(t, keep_end, t.numel());
}

constexpr int64_t kChunk = 1 << 18;  // elements: 1 MiB of fp32

// dst += alpha * src over flat tensors. A low-precision src is promoted to fp32 inside add_,
// on CPU into a temporary as large as src in fp32 (a bf16 gradient as large as a weight, a
// bf16-reduced bucket's owned slice at the fold); chunks bound it. The same element-wise sums.
void add_promoting_in_chunks(const at::Tensor& dst, const at::Tensor& src, double alpha) {
  if (src.scalar_type() == dst.scalar_type()) {
    dst.add_(src, alpha);
    return;
  }
  for (int64_t at = 0; at < src.numel(); at += kChunk) {
    const auto n = std::min(kChunk, src.numel() - at);
    dst.narrow(0, at, n).add_(src.narrow(0, at, n), alpha);
  }
}

// [Note: rounding a bucket page by page]
// With reduce_dtype bf16/fp16 the fp32 bucket is rounded into the copy the collective sends,
// then freed. Rounded whole, the bucket and its copy coexist (1.5x the bucket); ZeRO-1
// rounds every bucket at the step, next to all the others (4P + half the largest bucket).
// On CPU the rounding goes in chunks of 256K elements, and the fp32 pages a chunk has been
// read from are given back at once (release_pages): the two never hold much more than the
// bucket did. `release` false (the bucket is kept, or shared): one copy, as before. The
// values are those of a whole-tensor cast (the same element-wise rounding).
at::Tensor rounded_copy(const at::Tensor& fp32, c10::ScalarType dtype, bool release) {
  auto out = at::empty(fp32.sizes(), fp32.options().dtype(dtype));
  if (!release || !fp32.device().is_cpu()) return out.copy_(fp32);
  int64_t done = 0;  // fp32 elements given back so far
  for (int64_t at = 0; at < fp32.numel(); at += kChunk) {
    const auto n = std::min(kChunk, fp32.numel() - at);
    out.narrow(0, at, n).copy_(fp32.narrow(0, at, n));
    if (!release_pages(fp32, done, at + n)) {  // not the sole user: the rest in one copy
      out.narrow(0, at + n, fp32.numel() - at - n).copy_(fp32.narrow(0, at + n, fp32.numel() - at - n));
      break;
    }
    done = at + n;
  }
  return out;
}

std::vector<LayoutParam> describe(const std::vector<at::Tensor>& params,
                                  const std::vector<std::string>& names,
                                  const std::vector<c10::ScalarType>& dtypes) {
  TORCH_CHECK_VALUE(params.size() == names.size() && params.size() == dtypes.size(),
                    "ShardedCore: got ", params.size(), " params, ", names.size(), " names and ",
                    dtypes.size(), " storage dtypes; they must match one to one");
  std::vector<LayoutParam> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK_VALUE(p.requires_grad() && p.is_leaf() && p.is_floating_point(), "parameter '",
                      names[i], "' must be a floating leaf tensor that requires grad to be sharded");
    TORCH_CHECK_VALUE(at::isFloatingType(dtypes[i]), "parameter '", names[i],
                      "': storage dtype ", dtypes[i], " is not a floating dtype");
    out.push_back({names[i], p.sizes().vec(), p.numel(), dtypes[i], p.device()});
  }
  return out;
}

}  // namespace

// See core.h. Views keep the storage object, so they see the new memory ([Note: parameter
// sharding] in core.h).
void set_storage_bytes(const at::Tensor& t, size_t nbytes) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (nbytes == 0) {
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  } else {
    auto* allocator = impl->allocator();
    if (allocator == nullptr) allocator = c10::GetAllocator(t.device().type());
    // Device allocators (CUDA's caching allocator) allocate on the current device.
    const c10::DeviceGuard guard(t.device());
    impl->set_data_ptr_noswap(allocator->allocate(nbytes));
  }
  impl->set_nbytes(nbytes);
}

ShardedCore::ShardedCore(std::vector<at::Tensor> params, std::vector<std::string> names,
                         std::vector<c10::ScalarType> storage_dtypes,
                         const std::string& group_name, const CoreOptions& options)
    : layout_(describe(params, names, storage_dtypes),
              comm::resolve(group_name)->getSize(), comm::resolve(group_name)->getRank(),
              options.bucket_cap_bytes, options.first_bucket_cap_bytes),
      params_(std::move(params)),
      group_(comm::resolve(group_name)),
      options_(options),
      window_(options.window ? options.window
                             : std::make_shared<InflightWindow>(options.max_inflight_buckets)) {
  TORCH_CHECK_VALUE(options_.max_inflight_buckets >= 1 &&
                        options_.max_inflight_buckets == window_->limit(),
                    "max_inflight_buckets=", options_.max_inflight_buckets,
                    " must be >= 1 and equal to its shared window's limit (", window_->limit(),
                    ")");
  const auto device = params_.front().device();
  for (const auto& p : params_) {
    TORCH_CHECK_VALUE(p.device() == device, "all sharded parameters must be on one device; got ",
                      device, " and ", p.device());
  }
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  master_ = at::zeros({layout_.shard_numel()}, f32);
  // grad_ is allocated by the first reduction ([Note: what lives between steps]).
  // Masters come from the values given, before any cast, so they keep every fp32 bit.
  for (const auto& r : layout_.owned(layout_.rank())) {
    master_.narrow(0, r.shard_offset, r.numel)
        .copy_(params_[r.param].detach().reshape({-1}).narrow(0, r.param_offset, r.numel));
  }
  const auto& lb = layout_.buckets();
  buckets_.resize(lb.size());
  for (size_t b = 0; b < lb.size(); ++b) {
    auto& bucket = buckets_[b];
    // [Note: a sharded core reads only its slices]
    // With shard_params the flat buffer is never written here: it is allocated uninitialised
    // (untouched pages cost nothing on the CPU), the parameters become views of it, and it
    // is freed right after (its views hold no memory until the first unshard). The
    // parameters' values are read only where this rank owns them (the master copy above):
    // a parameter backed by a memory-mapped checkpoint is never read whole, and building a
    // unit's core never holds the unit twice. Without shard_params (zero1/2) the buffer is
    // the model's storage and takes every value.
    bucket.params_flat = options_.shard_params
                             ? at::empty({lb[b].padded}, f32.dtype(lb[b].storage_dtype))
                             : at::zeros({lb[b].padded}, f32.dtype(lb[b].storage_dtype));
    for (size_t k = 0; k < lb[b].params.size(); ++k) {
      auto& p = params_[lb[b].params[k]];
      auto slot = bucket.params_flat.narrow(0, lb[b].offsets[k], p.numel());
      if (!options_.shard_params) slot.copy_(p.detach().reshape({-1}));
      // The parameter becomes a view of the flat buffer, so the all-gather after each
      // step writes the model's weights directly (no copy-out). Its former storage is
      // released here unless something else holds it.
      p.set_data(slot.view(p.sizes()));
    }
    if (options_.shard_params) set_storage_bytes(bucket.params_flat, 0);
    bucket.pending = lb[b].params.size();
  }
  ready_.assign(params_.size(), false);
  slot_written_.assign(params_.size(), true);
  // Hooks after set_data: an accumulator made for the old dtype would be stale.
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(acc, "no gradient accumulator for parameter '", layout_.params()[i].name, "'");
    auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list& /*inputs*/) {
          // Outside the core's lock: completing may take another core's lock.
          if (on_grad_ready(i)) drain_window();
          return outputs;
        }));
    hooks_.emplace_back(std::move(acc), key);
  }
  if (options_.shard_params) unsharded_ = false;  // built resharded (the Note above)
}

ShardedCore::~ShardedCore() {
  for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
  // The window may outlive this core (other cores share it): leave no entry pointing here,
  // and give back the bytes counted for its buckets (an in-flight Work keeps its own
  // reference to a bucket's buffer, so dropping ours is safe).
  window_->forget(this);
  for (auto& bucket : buckets_) release_grads(bucket);
}

void ShardedCore::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = sync;
}

at::Tensor& ShardedCore::grads_of(Bucket& bucket, size_t b) {
  if (!bucket.grads.defined()) {
    const auto& info = layout_.buckets()[b];
    // [Note: bucket pages on first touch]
    if (master_.device().is_cpu()) {
      bucket.grads = at::empty({info.padded}, master_.options());
      bucket.filled = false;
      for (const auto i : info.params) slot_written_[i] = false;
    } else {
      bucket.grads = at::zeros({info.padded}, master_.options());
      bucket.filled = true;
    }
    window_->add_bucket_bytes(static_cast<int64_t>(bucket.grads.nbytes()));
  }
  return bucket.grads;
}

at::Tensor& ShardedCore::filled_grads_of(Bucket& bucket, size_t b) {
  auto& grads = grads_of(bucket, b);
  if (bucket.filled) return grads;
  // [Note: bucket pages on first touch]: the slots no gradient reached, the alignment gaps
  // and the even-split tail are zero, as in a bucket allocated zeroed.
  const auto& info = layout_.buckets()[b];
  int64_t end = 0;  // the first element not known to hold a value
  for (size_t k = 0; k < info.params.size(); ++k) {
    const auto i = info.params[k];
    const int64_t at = info.offsets[k];
    if (at > end) grads.narrow(0, end, at - end).zero_();
    if (!slot_written_[i]) grads.narrow(0, at, params_[i].numel()).zero_();
    end = at + params_[i].numel();
  }
  if (info.padded > end) grads.narrow(0, end, info.padded - end).zero_();
  bucket.filled = true;
  return grads;
}

void ShardedCore::release_grads(Bucket& bucket) {
  if (!bucket.grads.defined()) return;
  window_->add_bucket_bytes(-static_cast<int64_t>(bucket.grads.nbytes()));
  bucket.grads = at::Tensor();
}

bool ShardedCore::on_grad_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& g = params_[index].mutable_grad();
  if (!g.defined()) return false;
  // [Note: agreed reductions] in core.h.
  hooks_fired_->fetch_add(1);
  TORCH_CHECK(!(launched_all_ && sync_ && options_.reduce_in_backward), "parameter '",
              layout_.params()[index].name, "' received its gradient after its sharding unit's "
              "reductions were launched in this backward (the unit runner launches a unit once "
              "a unit that ran its forward earlier starts its backward): a parameter of the unit "
              "is used outside the unit's forward. Make the module using it part of the unit "
              "(or a leaf module), or use units=[]");
  const size_t b = layout_.bucket_of(index);
  auto& bucket = buckets_[b];
  // [Note: gradient reduction]: 1/N fused into the fp32 accumulation into the bucket.
  const double inv = 1.0 / static_cast<double>(layout_.world_size());
  auto slot = grads_of(bucket, b).narrow(0, layout_.offset_of(index), g.numel());
  if (!bucket.filled && !slot_written_[index]) {
    slot.zero_();  // [Note: bucket pages on first touch]: 0 + x, the same add as before
    slot_written_[index] = true;
  }
  add_promoting_in_chunks(slot, g.reshape({-1}), inv);
  g = at::Tensor();  // the full gradient is not kept: the bucket (then the shard) holds it
  bucket.dirty = true;
  if (options_.reshard_after_backward && ++grads_seen_ == params_.size()) reshard_locked();
  if (!sync_ || !options_.reduce_in_backward) return false;
  TORCH_CHECK(!ready_[index], "parameter '", layout_.params()[index].name,
              "' received its gradient twice in one backward; the sharded engine reduces each "
              "parameter once per backward (reentrant/double backward through the same parameter "
              "is not supported; use no_sync() for the earlier passes)");
  if (!launch_from_hooks_) {
    ready_[index] = true;  // launched by launch_all() / end_backward() ([Note: agreed reductions])
    return false;
  }
  if (!callback_queued_) {
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
    callback_queued_ = true;
  }
  ready_[index] = true;
  return --bucket.pending == 0 && launch_ready_locked();
}

bool ShardedCore::launch_ready_locked() {
  bool launched = false;
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    launch_locked(next_launch_);
    buckets_[next_launch_].launch_id = window_->push(this, next_launch_);
    ++next_launch_;
    launched = true;
  }
  return launched;
}

void ShardedCore::drain_window() {
  // [Note: bounded gradient memory]: complete the oldest reductions beyond the limit,
  // whichever core launched them.
  for (const auto& e : window_->take_overflow()) e.core->complete_if_inflight(e.bucket, e.id);
}

void ShardedCore::complete_if_inflight(size_t b, uint64_t launch_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The id does not match when the end-of-backward callback already completed it.
  if (buckets_[b].work && buckets_[b].launch_id == launch_id) complete_locked(b);
}

void ShardedCore::launch_locked(size_t b) {
  auto& bucket = buckets_[b];
  const auto& info = layout_.buckets()[b];
  auto& fp32_grads = filled_grads_of(bucket, b);
  // [Note: low-precision reduction] in core.h.
  if (options_.reduce_dtype != at::kFloat) {
    // [Note: rounding a bucket page by page]
    bucket.sent = rounded_copy(fp32_grads, options_.reduce_dtype, options_.free_grad_buckets);
    // The rounded copy is all the reduction needs: the fp32 bucket goes now, not at the
    // completion (its bytes would otherwise sit beside the copy while it is in flight).
    if (options_.free_grad_buckets) release_grads(bucket);
  }
  at::Tensor& grads = options_.reduce_dtype != at::kFloat ? bucket.sent : bucket.grads;
  if (options_.collective == Collective::kReduceScatter) {
    bucket.reduced = at::empty({info.shard}, grads.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;  // never AVG: the 1/N is in the fp32 accumulation
    bucket.work = compat::reduce_scatter_single(*group_, bucket.reduced, grads, opts);
  } else {
    std::vector<at::Tensor> tensors{grads};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    bucket.work = group_->allreduce(tensors, opts);
  }
  bytes_reduced_running_ += static_cast<int64_t>(grads.nbytes());
  // [Note: communication counters]
  bytes_reduced_total_ += static_cast<int64_t>(grads.nbytes());
  elements_reduced_total_ += grads.numel();
  ++reductions_total_;
}

void ShardedCore::count_gather(const at::Tensor& flat) {
  // [Note: communication counters]
  bytes_gathered_total_ += static_cast<int64_t>(flat.nbytes());
  elements_gathered_total_ += flat.numel();
  ++gathers_total_;
}

ShardedCore::CommCounters ShardedCore::comm_counters() const {
  CommCounters c;
  c.bytes_reduced = bytes_reduced_total_.load();
  c.elements_reduced = elements_reduced_total_.load();
  c.reductions = reductions_total_.load();
  c.bytes_gathered = bytes_gathered_total_.load();
  c.elements_gathered = elements_gathered_total_.load();
  c.gathers = gathers_total_.load();
  return c;
}

void ShardedCore::reset_comm_counters() {
  bytes_reduced_total_ = 0;
  elements_reduced_total_ = 0;
  reductions_total_ = 0;
  bytes_gathered_total_ = 0;
  elements_gathered_total_ = 0;
  gathers_total_ = 0;
}

void ShardedCore::complete_locked(size_t b) {
  auto& bucket = buckets_[b];
  const auto& info = layout_.buckets()[b];
  TORCH_CHECK(bucket.work, "bucket ", b, " has no reduction in flight to complete");
  bucket.work->wait();
  bucket.work.reset();
  bucket.launch_id = 0;
  at::Tensor owned;
  if (options_.collective == Collective::kReduceScatter) {
    owned = bucket.reduced;
    // The collective's input is not read again: it goes before the shard slice is touched.
    bucket.sent = at::Tensor();
    if (options_.free_grad_buckets) release_grads(bucket);
  } else {
    const at::Tensor& reduced_full = bucket.sent.defined() ? bucket.sent : bucket.grads;
    const int64_t begin = layout_.rank() * info.shard;
    // [Note: a folded bucket gives its pages back first] (before the view below exists)
    if (options_.free_grad_buckets) release_pages_outside(reduced_full, begin, begin + info.shard);
    owned = reduced_full.narrow(0, begin, info.shard);
  }
  add_promoting_in_chunks(grad_slice_locked(b), owned, 1.0);  // into fp32
  bucket.reduced = at::Tensor();
  bucket.sent = at::Tensor();
  if (options_.free_grad_buckets) {
    release_grads(bucket);
  } else {
    bucket.grads.zero_();
  }
  bucket.dirty = false;
  has_grads_ = true;
}

void ShardedCore::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Parameters that got no gradient on this rank count as zero (the bucket slot stays 0);
  // every rank still launches every bucket, in order.
  for (auto& bucket : buckets_) bucket.pending = 0;
  launch_ready_locked();
  // This core completes its own remaining reductions ([Note: bounded gradient memory]);
  // the ones a hook completed already have no work.
  window_->forget(this);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].work) complete_locked(b);
  }
  bytes_reduced_last_ = bytes_reduced_running_;
  bytes_reduced_running_ = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].pending = layout_.buckets()[b].params.size();
  }
  std::fill(ready_.begin(), ready_.end(), false);
  next_launch_ = 0;
  callback_queued_ = false;
  launched_all_ = false;
  hooks_reduced_ = hooks_fired_->load();  // [Note: agreed reductions]
}

void ShardedCore::reduce() {
  std::lock_guard<std::mutex> lock(mutex_);
  reduce_locked();
}

void ShardedCore::reduce_locked() {
  bool any = false;
  for (const auto& bucket : buckets_) any = any || bucket.dirty;
  // [Note: agreed reductions]: `any` alone is this rank's view (a unit skipped here may
  // hold gradients on another rank); a hook of the model's cores since the last reduction
  // means a backward went through the model on every rank. All buckets go.
  const uint64_t fired = hooks_fired_->load();
  if (!any && fired == hooks_reduced_) return;
  hooks_reduced_ = fired;
  for (size_t b = 0; b < buckets_.size(); ++b) launch_locked(b);
  for (size_t b = 0; b < buckets_.size(); ++b) complete_locked(b);
  bytes_reduced_last_ = bytes_reduced_running_;
  bytes_reduced_running_ = 0;
}

void ShardedCore::ensure_grad_shard_locked() {
  // [Note: what lives between steps]: a released shard is allocated again; each bucket's
  // slice is zeroed when first used ([Note: gradient shard pages]).
  if (!grad_.defined()) {
    grad_ = at::empty({layout_.shard_numel()}, master_.options());
    slice_zeroed_.assign(buckets_.size(), false);
  }
}

at::Tensor ShardedCore::grad_slice_locked(size_t b) {
  // [Note: gradient shard pages]
  ensure_grad_shard_locked();
  const auto& info = layout_.buckets()[b];
  auto slice = grad_.narrow(0, info.shard_offset, info.shard);
  if (!slice_zeroed_[b]) {
    slice.zero_();
    slice_zeroed_[b] = true;
  }
  return slice;
}

void ShardedCore::materialize_grad_shard_locked() {
  ensure_grad_shard_locked();
  for (size_t b = 0; b < buckets_.size(); ++b) grad_slice_locked(b);
}

void ShardedCore::ensure_grad_shard() {
  std::lock_guard<std::mutex> lock(mutex_);
  materialize_grad_shard_locked();
}

at::Tensor ShardedCore::grad_shard() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Every slice a reader can see holds its value: zeros where no reduction landed yet.
  if (grad_.defined()) materialize_grad_shard_locked();
  return grad_;
}

int64_t ShardedCore::grad_shard_bytes() const {
  return grad_.defined() ? static_cast<int64_t>(grad_.nbytes()) : 0;
}

void ShardedCore::zero_grad(bool release) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (release) {
    grad_ = at::Tensor();  // freed unless the user still holds a .grad view of it
  } else if (grad_.defined()) {
    grad_.zero_();
    slice_zeroed_.assign(buckets_.size(), true);
  }
  for (auto& bucket : buckets_) {
    if (bucket.grads.defined()) {
      if (options_.free_grad_buckets || release) {
        release_grads(bucket);
      } else {
        bucket.grads.zero_();
        bucket.filled = true;
      }
    }
    bucket.dirty = false;
  }
  has_grads_ = false;
  hooks_reduced_ = hooks_fired_->load();  // dropped: nothing left to reduce
}

at::Tensor ShardedCore::gather_source(size_t b) const {
  // [Note: what lives between steps]: the owned masters, rounded to the storage dtype.
  const auto& info = layout_.buckets()[b];
  auto master = master_.narrow(0, info.shard_offset, info.shard);
  return info.storage_dtype == at::kFloat ? master : master.to(info.storage_dtype);
}

void ShardedCore::gather_params() {
  std::lock_guard<std::mutex> lock(mutex_);
  // [Note: bounded gathers]: at most `in_flight` buckets' rounded sources (and the
  // collectives' own buffers) exist at once, not one per bucket.
  const size_t in_flight = master_.device().is_cpu() ? 1 : 2;
  std::deque<std::pair<c10::intrusive_ptr<c10d::Work>, at::Tensor>> inflight;  // work, its input
  int64_t bytes = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (inflight.size() >= in_flight) {
      inflight.front().first->wait();
      inflight.pop_front();  // frees the oldest input
    }
    auto input = gather_source(b);
    auto work = compat::all_gather_single(*group_, buckets_[b].params_flat, input,
                                          c10d::AllgatherOptions());
    inflight.emplace_back(std::move(work), std::move(input));
    bytes += static_cast<int64_t>(buckets_[b].params_flat.nbytes());
    count_gather(buckets_[b].params_flat);
  }
  for (auto& [work, input] : inflight) work->wait();
  bytes_gathered_last_ = bytes;
}

void ShardedCore::unshard(bool async_op) {
  std::lock_guard<std::mutex> lock(mutex_);
  unshard_locked(async_op);
}

void ShardedCore::unshard_locked(bool async_op) {
  grads_seen_ = 0;
  if (!unsharded_) {
    int64_t bytes = 0;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      auto& flat = buckets_[b].params_flat;
      set_storage_bytes(flat, flat.nbytes());
      buckets_[b].gather_src = gather_source(b);
      buckets_[b].gather = compat::all_gather_single(*group_, flat, buckets_[b].gather_src,
                                                     c10d::AllgatherOptions());
      bytes += static_cast<int64_t>(flat.nbytes());
      count_gather(flat);
    }
    bytes_gathered_last_ = bytes;
    unsharded_ = true;
  }
  if (!async_op) wait_unshard_locked();
}

void ShardedCore::wait_unshard() {
  std::lock_guard<std::mutex> lock(mutex_);
  wait_unshard_locked();
}

void ShardedCore::wait_unshard_locked() {
  for (auto& bucket : buckets_) {
    if (bucket.gather) {
      bucket.gather->wait();
      bucket.gather.reset();
      bucket.gather_src = at::Tensor();
    }
  }
}

void ShardedCore::reshard() {
  std::lock_guard<std::mutex> lock(mutex_);
  reshard_locked();
}

void ShardedCore::reshard_locked() {
  TORCH_CHECK(options_.shard_params, "reshard() needs a core built with shard_params "
              "(backend='zero3' or 'fsdp'); zero1/zero2 keep full parameters");
  if (!unsharded_) return;
  wait_unshard_locked();  // never free memory a collective is still writing
  for (auto& bucket : buckets_) set_storage_bytes(bucket.params_flat, 0);
  unsharded_ = false;
}

int64_t ShardedCore::param_buffer_bytes() const {
  int64_t total = 0;
  for (const auto& bucket : buckets_) {
    total += static_cast<int64_t>(bucket.params_flat.storage().nbytes());
  }
  return total;
}

std::vector<at::Tensor> ShardedCore::full_masters() {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto& lb = layout_.buckets();
  std::vector<at::Tensor> out(params_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    auto full = at::empty({lb[b].padded}, master_.options());
    auto input = master_.narrow(0, lb[b].shard_offset, lb[b].shard);
    compat::all_gather_single(*group_, full, input, c10d::AllgatherOptions())->wait();
    for (size_t k = 0; k < lb[b].params.size(); ++k) {
      const auto i = lb[b].params[k];
      out[i] = full.narrow(0, lb[b].offsets[k], params_[i].numel()).view(params_[i].sizes()).clone();
    }
  }
  return out;
}

std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> ShardedCore::owned_ranges()
    const {
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> out;
  for (const auto& r : layout_.owned(layout_.rank())) {
    out.emplace_back(static_cast<int64_t>(r.param),
                     static_cast<int64_t>(layout_.bucket_of(r.param)), r.shard_offset,
                     r.param_offset, r.numel);
  }
  return out;
}

void ShardedCore::set_launch_from_hooks(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  launch_from_hooks_ = on;
}

bool ShardedCore::launch_all_locked() {
  // [Note: agreed reductions]: parameters without a gradient here count as zero.
  for (auto& bucket : buckets_) bucket.pending = 0;
  launched_all_ = true;
  return launch_ready_locked();
}

void ShardedCore::launch_all() {
  bool pushed = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!sync_ || !options_.reduce_in_backward || launched_all_) return;
    pushed = launch_all_locked();
  }
  if (pushed) drain_window();  // outside the lock, as from a hook
}

void ShardedCore::end_backward() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!sync_ || !options_.reduce_in_backward) return;
  }
  finalize_backward();
}

void ShardedCore::share_backward_count(const ShardedCore& other) {
  std::lock_guard<std::mutex> lock(mutex_);
  hooks_fired_ = other.hooks_fired_;
  hooks_reduced_ = hooks_fired_->load();
}

int64_t ShardedCore::grad_bucket_bytes() const {
  int64_t total = 0;
  for (const auto& bucket : buckets_) {
    if (bucket.grads.defined()) total += static_cast<int64_t>(bucket.grads.nbytes());
  }
  return total;
}

// [Note: one parameter's master, gathered] in core.h.
at::Tensor ShardedCore::gather_master(int64_t index, int64_t dst) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t n = static_cast<int64_t>(params_.size());
  const int64_t world = layout_.world_size();
  const int64_t me = layout_.rank();
  TORCH_CHECK_INDEX(index >= 0 && index < n, "gather_master(index=", index, "): this core shards ",
                    n, " parameter(s); give an index in [0, ", n, ")");
  TORCH_CHECK_VALUE(dst >= -1 && dst < world, "gather_master(dst=", dst, "): give a rank of the ",
                    "core's group in [0, ", world, ") to receive the tensor, or -1 for every rank");
  const auto& bucket = layout_.buckets()[layout_.bucket_of(index)];
  const int64_t start = layout_.offset_of(index);  // in the bucket's padded space
  const int64_t numel = params_[index].numel();
  const bool receives = dst < 0 || me == dst;
  at::Tensor out;
  if (receives) out = at::empty({numel}, master_.options());
  if (numel > 0) {
    const int64_t shard = bucket.shard;
    for (int64_t r = start / shard; r <= (start + numel - 1) / shard; ++r) {
      const int64_t lo = std::max(start, r * shard);
      const int64_t hi = std::min(start + numel, (r + 1) * shard);
      at::Tensor place = receives ? out.narrow(0, lo - start, hi - lo) : at::Tensor();
      at::Tensor mine = me == r ? master_.narrow(0, bucket.shard_offset + lo - r * shard, hi - lo)
                                : at::Tensor();
      if (dst < 0) {
        std::vector<at::Tensor> tensors{me == r ? mine : place};
        c10d::BroadcastOptions opts;
        opts.rootRank = r;
        group_->broadcast(tensors, opts)->wait();
        if (me == r) place.copy_(mine);
      } else if (r == dst) {
        if (me == dst) place.copy_(mine);
      } else if (me == r) {
        std::vector<at::Tensor> tensors{mine};
        group_->send(tensors, static_cast<int>(dst), 0)->wait();
      } else if (me == dst) {
        std::vector<at::Tensor> tensors{place};
        group_->recv(tensors, static_cast<int>(r), 0)->wait();
      }
    }
  }
  return receives ? out.view(params_[index].sizes()) : out;
}

}  // namespace mixprec::engines::sharded
