// A thin layer over c10d::ProcessGroup: groups are created by torch.distributed in
// Python and resolved here by name, so mixprec uses PyTorch's own transport
// (Gloo on CPU, NCCL on CUDA) and rendezvous.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

namespace mixprec::comm {

// The group registered under `name` (Python: `group.group_name`); a clear error if none.
c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& name);

// Broadcast `tensors` from `root` in place, one collective per dtype/device run of tensors
// (flattened, then copied back).
void broadcast_coalesced(const std::vector<at::Tensor>& tensors, const std::string& group_name,
                         int64_t root);

}  // namespace mixprec::comm
