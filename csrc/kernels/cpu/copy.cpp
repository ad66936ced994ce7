// Multi-tensor cast-copies (CPU): list -> list, list -> flat buffer, flat -> list.
// The per-element code is simd/copy_items.cpp.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/launcher.h"

#include <algorithm>

namespace mixprec::kernels::cpu {
namespace {

void run(const Plan<2>& plan) {
  const CopyItemsFn items = item_fns().copy;
  parallel_items(plan, [&](int64_t b, int64_t e) { items(plan, b, e); });
}

}  // namespace

// Slot 0 is written, slot 1 read.
void copy_cast(const TensorVec& dsts, const TensorVec& srcs) {
  run(make_plan<2>({&dsts, &srcs}, {1, 1}));
}

bool scale_copy_check(const TensorVec& dsts, const TensorVec& srcs, float scale) {
  const auto plan = make_plan<2>({&dsts, &srcs}, {1, 1});
  std::vector<uint8_t> found(plan.items.size(), 0);  // one flag per item: no shared writes
  const ScaleCopyItemsFn items = item_fns().scale_copy;
  parallel_items(plan, [&](int64_t b, int64_t e) { items(plan, b, e, scale, found.data()); });
  return std::any_of(found.begin(), found.end(), [](uint8_t f) { return f != 0; });
}

void flat_copy(const at::Tensor& flat, const TensorVec& tensors, bool into_flat) {
  const TensorVec none;
  auto plan = make_plan<2>({&tensors, &none}, {1, 1});
  // Each tensor's slice of the flat buffer starts where the previous one ends.
  char* base = static_cast<char*>(flat.data_ptr());
  const int64_t elem = static_cast<int64_t>(flat.element_size());
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    Slot slice{base + offset * elem, flat.scalar_type()};
    if (into_flat) {
      plan.slots[i][1] = plan.slots[i][0];
      plan.slots[i][0] = slice;
    } else {
      plan.slots[i][1] = slice;
    }
    offset += tensors[i].numel();
  }
  run(plan);
}

}  // namespace mixprec::kernels::cpu
