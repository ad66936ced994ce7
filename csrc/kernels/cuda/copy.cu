// Multi-tensor cast-copies (CUDA): list -> list, list <-> flat buffer.
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/multi_tensor_apply.cuh"

namespace mixprec::kernels::cuda {
namespace {

// Slot 0 is the destination, slot 1 the source.
struct CopyOp {
  __device__ void apply(const TensorListMeta<2>& m, int t, int64_t b, int64_t e, int64_t) const {
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
      store_f(m.addr[0][t], i, m.code[0][t], load_f(m.addr[1][t], i, m.code[1][t]));
    }
  }
};

}  // namespace

void copy_cast(const TensorVec& dsts, const TensorVec& srcs, void* stream) {
  std::vector<std::array<Slot, 2>> slots;
  std::vector<int64_t> numels;
  make_slots<2>({&dsts, &srcs}, &slots, &numels);
  multi_tensor_apply<2>(slots, numels, CopyOp{}, stream);
}

void flat_copy(const at::Tensor& flat, const TensorVec& tensors, bool into_flat, void* stream) {
  const TensorVec none;
  std::vector<std::array<Slot, 2>> slots;
  std::vector<int64_t> numels;
  make_slots<2>({&tensors, &none}, &slots, &numels);
  char* base = static_cast<char*>(flat.data_ptr());
  const int64_t elem = static_cast<int64_t>(flat.element_size());
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Slot slice{base + offset * elem, dtype_code(flat.scalar_type())};
    if (into_flat) {
      slots[i][1] = slots[i][0];
      slots[i][0] = slice;
    } else {
      slots[i][1] = slice;
    }
    offset += numels[i];
  }
  multi_tensor_apply<2>(slots, numels, CopyOp{}, stream);
}

}  // namespace mixprec::kernels::cuda
