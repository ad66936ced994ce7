// Multi-tensor cast-copies (CPU): list -> list, list -> flat buffer, flat -> list.
// fp32 -> bf16/fp16 rounds to nearest-even with NaN kept NaN, as Tensor.copy_.
// launcher.h first: its optimize pragma must precede every inline function
// of the TU, or GCC refuses to inline across the option mismatch.
#include "kernels/cpu/launcher.h"
#include "kernels/cpu/cpu_ops.h"

namespace mixprec::kernels::cpu {
namespace {

template <class D, class S>
C10_ALWAYS_INLINE void copy_range(D* d, const S* s, int64_t n) {
  if constexpr (std::is_same_v<D, S>) {
    std::memcpy(d, s, n * sizeof(D));
  } else {
    int64_t i = 0;
    for (; i + kW <= n; i += kW) store_f(d + i, load_f(s + i, kW), kW);
    if (i < n) store_f(d + i, load_f(s + i, n - i), n - i);
  }
}

// Slot 0 is the destination, slot 1 the source.
MIXPREC_CPU_CLONES(copy_items, (const Plan<2>& plan, int64_t b, int64_t e), (plan, b, e), {
  for (int64_t k = b; k < e; ++k) {
    const WorkItem& it = plan.items[k];
    const auto& t = plan.slots[it.tensor];
    const int64_t n = it.end - it.begin;
    MIXPREC_FLOAT_SWITCH(t[0].dtype, D, {
      D* d = static_cast<D*>(t[0].ptr) + it.begin;
      MIXPREC_FLOAT_SWITCH(t[1].dtype, S, copy_range(d, static_cast<const S*>(t[1].ptr) + it.begin, n))
    })
  }
})

void run(const Plan<2>& plan) {
  parallel_items(plan.items, plan.total, [&](int64_t b, int64_t e) { copy_items(plan, b, e); });
}

}  // namespace

void copy_cast(const TensorVec& dsts, const TensorVec& srcs) { run(make_plan<2>({&dsts, &srcs})); }

void flat_copy(const at::Tensor& flat, const TensorVec& tensors, bool into_flat) {
  const TensorVec none;
  auto plan = make_plan<2>({&tensors, &none});
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
