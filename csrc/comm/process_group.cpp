#include "comm/process_group.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace mixprec::comm {

c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& name) {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(name);
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, "no process group is registered under the name '", name,
                      "'; initialise torch.distributed first and pass group.group_name (",
                      e.what_without_backtrace(), ")");
  }
  TORCH_CHECK_VALUE(group, "process group '", name, "' resolved to null");
  return group;
}

void broadcast_coalesced(const std::vector<at::Tensor>& tensors, const std::string& group_name,
                         int64_t root) {
  auto group = resolve(group_name);
  size_t start = 0;
  while (start < tensors.size()) {
    // A run of tensors with one dtype and device travels as one flat buffer.
    size_t end = start;
    int64_t numel = 0;
    while (end < tensors.size() && tensors[end].scalar_type() == tensors[start].scalar_type() &&
           tensors[end].device() == tensors[start].device()) {
      numel += tensors[end].numel();
      ++end;
    }
    auto flat = at::empty({numel}, tensors[start].options());
    int64_t offset = 0;
    for (size_t i = start; i < end; ++i) {
      const auto n = tensors[i].numel();
      flat.narrow(0, offset, n).copy_(tensors[i].reshape({-1}));
      offset += n;
    }
    std::vector<at::Tensor> bufs{flat};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    group->broadcast(bufs, opts)->wait();
    offset = 0;
    for (size_t i = start; i < end; ++i) {
      const auto n = tensors[i].numel();
      auto dst = tensors[i];
      dst.copy_(flat.narrow(0, offset, n).view(dst.sizes()));
      offset += n;
    }
    start = end;
  }
}

}  // namespace mixprec::comm
