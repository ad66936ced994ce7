#include "engines/replicated/reducer.h"

#include "comm/process_group.h"
#include "kernels/multi_tensor.h"

#include <ATen/ops/full.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <sstream>
#if defined(__linux__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

namespace mixprec::engines {

namespace {

bool same_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() &&
         a.scalar_type() == b.scalar_type();
}

}  // namespace

namespace {

// [Note: zero pages until the first backward]
// A bucket must read as zeros before any gradient lands in it, but on the CPU writing those
// zeros at construction makes every page resident at prepare(): the whole gradient, while
// the model is still being loaded. A fresh private anonymous mapping reads as zeros and
// costs nothing until a page is written, so a CPU bucket of at least 1 MiB is one (freed by
// munmap with its storage); its pages become resident as the first backward writes them, as
// with at::zeros after that point. Smaller buckets, other devices and other systems use
// at::zeros.
at::Tensor zeroed(at::IntArrayRef sizes, const at::TensorOptions& options) {
#if defined(__linux__) || defined(__APPLE__)
  int64_t numel = 1;
  for (auto s : sizes) numel *= s;
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(options.dtype().toScalarType());
  if (options.device().is_cpu() && nbytes >= (size_t{1} << 20)) {
    void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
      return at::from_blob(p, sizes, [nbytes](void* q) { munmap(q, nbytes); }, options);
    }
  }
#endif
  return at::zeros(sizes, options);
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<at::Tensor> targets,
                 std::vector<std::string> names, const std::string& group_name,
                 const ReducerOptions& options)
    : options_(options) {
  TORCH_CHECK_VALUE(params.size() == targets.size() && params.size() == names.size(),
                    "Reducer: got ", params.size(), " params, ", targets.size(), " targets and ",
                    names.size(), " names; they must match one to one");
  TORCH_CHECK_VALUE(options_.bucket_cap_bytes > 0 && options_.first_bucket_cap_bytes > 0,
                    "bucket caps must be positive, got bucket_cap_bytes=", options_.bucket_cap_bytes,
                    " and first_bucket_cap_bytes=", options_.first_bucket_cap_bytes);
  group_ = comm::resolve(group_name);
  world_size_ = group_->getSize();
  slots_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const auto& t = targets[i];
    TORCH_CHECK_VALUE(p.requires_grad() && p.is_leaf(), "parameter '", names[i],
                      "' must be a leaf tensor that requires grad to be reduced");
    TORCH_CHECK_VALUE(p.sizes() == t.sizes() && p.device() == t.device(), "parameter '", names[i],
                      "': its gradient target has shape ", t.sizes(), " on ", t.device(),
                      " but the parameter has shape ", p.sizes(), " on ", p.device());
    Slot slot;
    slot.param = p;
    slot.target = t;
    slot.name = names[i];
    slot.lowp = !p.is_same(t);
    slots_.push_back(std::move(slot));
  }
  build_buckets();
  for (size_t i = 0; i < slots_.size(); ++i) {
    // Keep the accumulator alive: a parameter only holds it weakly, and a fresh one
    // (without our hook) would be made after this one died.
    auto acc = torch::autograd::impl::grad_accumulator(slots_[i].param);
    TORCH_CHECK(acc, "no gradient accumulator for parameter '", slots_[i].name, "'");
    auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list& /*inputs*/) {
          on_grad_ready(i);
          return outputs;
        }));
    hooks_.emplace_back(std::move(acc), key);
  }
}

Reducer::~Reducer() {
  for (auto& [acc, key] : hooks_) {
    acc->del_post_hook(key);
  }
}

void Reducer::build_buckets() {
  // See [Note: bucket order].
  struct Open {
    std::vector<size_t> slots;
    int64_t bytes = 0;
    bool first = true;
  };
  std::map<std::pair<c10::ScalarType, std::string>, Open> open;
  std::vector<std::vector<size_t>> closed;
  auto reduce_dtype_of = [&](const Slot& s) {
    return options_.reduce_dtype == c10::ScalarType::Undefined ? s.target.scalar_type()
                                                               : options_.reduce_dtype;
  };
  for (size_t k = slots_.size(); k-- > 0;) {
    const auto dtype = reduce_dtype_of(slots_[k]);
    auto& bucket = open[{dtype, slots_[k].target.device().str()}];
    bucket.slots.push_back(k);
    bucket.bytes += slots_[k].target.numel() * static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t cap = bucket.first ? options_.first_bucket_cap_bytes : options_.bucket_cap_bytes;
    if (bucket.bytes >= cap) {
      closed.push_back(std::move(bucket.slots));
      bucket.slots.clear();
      bucket.bytes = 0;
      bucket.first = false;
    }
  }
  for (auto& [key, bucket] : open) {
    if (!bucket.slots.empty()) closed.push_back(std::move(bucket.slots));
  }
  // Launch order follows gradient-ready order: the bucket holding the latest parameter first.
  std::sort(closed.begin(), closed.end(),
            [](const auto& a, const auto& b) { return a.front() > b.front(); });
  buckets_.resize(closed.size());
  for (size_t b = 0; b < closed.size(); ++b) {
    auto& bucket = buckets_[b];
    bucket.slots = closed[b];
    const auto& first = slots_[bucket.slots.front()];
    const auto dtype = reduce_dtype_of(first);
    int64_t numel = 0;
    int64_t grad_numel = 0;
    // [Note: aligned bucket views]: every view starts at a 16-byte boundary of the bucket.
    const int64_t align = std::max<int64_t>(1, 16 / static_cast<int64_t>(c10::elementSize(dtype)));
    for (auto i : bucket.slots) {
      slots_[i].bucket = b;
      slots_[i].offset = (numel + align - 1) / align * align;
      numel = slots_[i].offset + slots_[i].target.numel();
      grad_numel += slots_[i].target.numel();
    }
    bucket.grad_numel = grad_numel;
    // [Note: non-finite check in the copy-in]: one more element in the last bucket.
    const bool flag_here = options_.check_nonfinite && b + 1 == closed.size();
    bucket.storage = zeroed({numel + (flag_here ? 1 : 0)}, first.target.options().dtype(dtype));
    if (flag_here) flag_index_ = numel;
    bucket.grad_is_view = true;
    for (auto i : bucket.slots) {
      auto& s = slots_[i];
      s.view = bucket.storage.narrow(0, s.offset, s.target.numel()).view(s.target.sizes());
      bucket.grad_is_view = bucket.grad_is_view && s.target.scalar_type() == dtype;
    }
    bucket.pending = bucket.slots.size();
  }
  check_active_ = options_.check_nonfinite && !buckets_.empty() &&
                  std::all_of(buckets_.begin(), buckets_.end(),
                              [](const Bucket& b) { return b.grad_is_view; });
  if (check_active_) {
    const auto f32 = buckets_.back().storage.options().dtype(at::kFloat);
    local_flag_ = at::zeros({1}, f32);
    agreed_flag_ = at::zeros({1}, f32);
    inv_world_ = at::full({1}, 1.0 / static_cast<double>(world_size_), f32);
  }
  // Gradients that already exist (a backward before prepare) move into the buckets.
  for (auto& bucket : buckets_) {
    if (!bucket.grad_is_view) continue;
    for (auto i : bucket.slots) {
      auto& grad = slots_[i].target.mutable_grad();
      if (grad.defined() && !same_tensor(grad, slots_[i].view)) {
        slots_[i].view.copy_(grad);
        grad = slots_[i].view;
      }
    }
  }
}

void Reducer::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = sync;
}

std::vector<std::vector<int64_t>> Reducer::bucket_indices() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& b : buckets_) out.emplace_back(b.slots.begin(), b.slots.end());
  return out;
}

void Reducer::on_grad_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  // [Note: non-finite check in the copy-in]: any new gradient (also under no_sync) makes
  // the last backward's flag stale until this backward's own finalize.
  checked_ = false;
  auto& s = slots_[index];
  auto& bucket = buckets_[s.bucket];
  auto& target_grad = s.target.mutable_grad();
  if (s.lowp) {
    // [Note: low-precision parameters]: fold into the fp32 master gradient.
    auto& g = s.param.mutable_grad();
    if (!g.defined()) return;
    if (bucket.grad_is_view) {
      if (same_tensor(target_grad, s.view)) {
        s.view.add_(g);
      } else {
        s.view.copy_(g);
        target_grad = s.view;
      }
    } else if (target_grad.defined()) {
      target_grad.add_(g);
    } else {
      target_grad = g.to(s.target.scalar_type());
    }
    g = at::Tensor();
  }
  if (!sync_) return;
  TORCH_CHECK(!s.ready, "parameter '", s.name,
              "' received its gradient twice in one backward; the replicated engine reduces each "
              "parameter once per backward (reentrant/double backward through the same parameter "
              "is not supported)");
  if (!callback_queued_) {
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
    callback_queued_ = true;
    if (check_active_) local_flag_.zero_();  // a new synchronising backward starts
  }
  // [Note: gradients are views into buckets]: the 1/N is applied here, fused into the
  // copy when the gradient is not yet the bucket view.
  if (check_active_) {
    // [Note: non-finite check in the copy-in]: the same pass, with the check. (Every
    // bucket holds views, so the gradient has the bucket's dtype; a non-contiguous one
    // is copied in first and then scaled and checked in place.)
    if (!target_grad.is_contiguous()) {
      s.view.copy_(target_grad);
      target_grad = s.view;
    }
    kernels::scale_copy_and_check_({s.view}, {target_grad}, local_flag_, inv_world_);
    target_grad = s.view;
    mark_ready_locked(index);
    return;
  }
  const double inv = 1.0 / static_cast<double>(world_size_);
  if (bucket.grad_is_view && same_tensor(target_grad, s.view)) {
    s.view.mul_(inv);
  } else {
    auto scalar = at::scalar_tensor(inv, at::TensorOptions().dtype(at::kDouble));
    scalar.unsafeGetTensorImpl()->set_wrapped_number(true);
    at::mul_out(s.view, target_grad, scalar);
    if (bucket.grad_is_view) target_grad = s.view;
  }
  mark_ready_locked(index);
}

void Reducer::mark_ready_locked(size_t index) {
  auto& s = slots_[index];
  s.ready = true;
  auto& bucket = buckets_[s.bucket];
  if (--bucket.pending == 0) launch_ready_locked();
}

void Reducer::launch_ready_locked() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    auto& bucket = buckets_[next_launch_];
    if (check_active_ && next_launch_ + 1 == buckets_.size()) {
      // [Note: non-finite check in the copy-in]: every gradient is checked by now.
      bucket.storage.narrow(0, flag_index_, 1).copy_(local_flag_);
    }
    std::vector<at::Tensor> tensors{bucket.storage};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;  // never AVG: see ARCHITECTURE.md decision 2
    bucket.work = group_->allreduce(tensors, opts);
    bytes_running_ += bucket.grad_numel * static_cast<int64_t>(bucket.storage.element_size());
    ++next_launch_;
  }
}

void Reducer::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<size_t> unused;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].ready) unused.push_back(i);
  }
  if (!unused.empty() && !options_.find_unused_parameters) {
    std::ostringstream names;
    for (size_t k = 0; k < unused.size(); ++k) names << (k ? ", " : "") << slots_[unused[k]].name;
    // Whether a parameter got a gradient is this rank's view: another rank that used it
    // launches its bucket. So every bucket is still launched here (zeros for the unused),
    // and completed, before this rank raises: the ranks' collectives stay paired (a
    // missing all-reduce hangs NCCL and desyncs Gloo), as in [Note: agreed reductions] in
    // csrc/engines/sharded/core.h.
    for (auto i : unused) {
      slots_[i].view.zero_();
      mark_ready_locked(i);
    }
    launch_ready_locked();
    for (auto& bucket : buckets_) {
      if (bucket.work) bucket.work->wait();
    }
    reset_locked();
    TORCH_CHECK_VALUE(false, "these parameters received no gradient in this backward: [",
                      names.str(), "]. Make them take part in the loss, freeze them "
                      "(requires_grad=False) before prepare(), or pass find_unused_parameters=True");
  }
  for (auto i : unused) {
    slots_[i].view.zero_();
    mark_ready_locked(i);
  }
  launch_ready_locked();
  for (auto& bucket : buckets_) {
    bucket.work->wait();
    bucket.work.reset();
    if (!bucket.grad_is_view) {
      for (auto i : bucket.slots) {
        auto& grad = slots_[i].target.mutable_grad();
        if (grad.defined()) grad.copy_(slots_[i].view);
      }
    }
  }
  if (options_.find_unused_parameters) {
    // Which of this rank's unused parameters were used somewhere else? Every rank takes
    // part, also one that used every parameter: the ranks' unused sets differ (a router
    // picking experts per rank), and a collective only some ranks call would not pair up.
    auto used_host = at::ones({static_cast<int64_t>(slots_.size())}, at::TensorOptions().dtype(at::kInt));
    int32_t* flags = used_host.data_ptr<int32_t>();
    for (auto i : unused) flags[i] = 0;
    auto used = used_host.to(slots_[0].target.device());
    std::vector<at::Tensor> tensors{used};
    group_->allreduce(tensors)->wait();
    auto used_cpu = used.cpu();
    const int32_t* counts = used_cpu.data_ptr<int32_t>();
    for (auto i : unused) {
      if (counts[i] == 0) continue;  // unused everywhere: the gradient stays as it was
      auto& s = slots_[i];
      auto& grad = s.target.mutable_grad();
      if (buckets_[s.bucket].grad_is_view) {
        grad = s.view;
      } else {
        grad = s.view.to(s.target.scalar_type());
      }
    }
  }
  if (check_active_) {
    agreed_flag_.copy_(buckets_.back().storage.narrow(0, flag_index_, 1));
    checked_ = true;
  }
  bytes_last_ = bytes_running_;
  reset_locked();
}

std::optional<at::Tensor> Reducer::take_nonfinite_check() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!checked_) return std::nullopt;
  checked_ = false;
  return agreed_flag_;
}

void Reducer::reset_locked() {
  for (auto& s : slots_) s.ready = false;
  for (auto& b : buckets_) {
    b.pending = b.slots.size();
    b.work.reset();
  }
  next_launch_ = 0;
  callback_queued_ = false;
  bytes_running_ = 0;
}

}  // namespace mixprec::engines
