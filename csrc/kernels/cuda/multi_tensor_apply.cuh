// CUDA multi-tensor apply: chunks of many tensors per launch, metadata passed
// as a kernel argument (no device allocation, no host sync).
//
// [Note: CUDA chunking]
// Each tensor is cut into kChunk-element chunks; one thread block handles one
// chunk. A launch carries up to kMaxTensors tensors and kMaxBlocks chunks in
// its argument struct (< 4 KiB, the portable kernel-parameter limit); the
// host fills it and launches whenever it is full. Arithmetic uses the
// explicitly rounded intrinsics (__fmaf_rn, __fmul_rn, ...) so nvcc's default
// FMA contraction cannot change results: the CUDA kernels round exactly where
// the CPU ones do (see [Note: vectorisation and FMA]).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

namespace mixprec::kernels::cuda {

constexpr int kBlock = 256;
constexpr int64_t kChunk = 16384;
constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;

enum DtypeCode : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline uint8_t dtype_code(at::ScalarType t) {
  return t == at::kFloat ? kF32 : (t == at::kBFloat16 ? kBF16 : kF16);
}

struct Slot {
  void* ptr = nullptr;
  uint8_t code = kF32;
};

template <int N>
struct TensorListMeta {
  void* addr[N][kMaxTensors];
  int64_t numel[kMaxTensors];
  uint8_t code[N][kMaxTensors];
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
  int64_t first_block;  // index of this launch's first block over all launches
};

__device__ __forceinline__ float load_f(const void* p, int64_t i, uint8_t code) {
  switch (code) {
    case kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case kF16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// Round to nearest-even, as Tensor.to / the CPU kernels.
__device__ __forceinline__ void store_f(void* p, int64_t i, uint8_t code, float v) {
  switch (code) {
    case kBF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case kF16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// [Note: vectorised loads]
// The optimizer kernels move 4 elements per thread and iteration with one 16-byte load
// per fp32 operand (float4) and one 8-byte load per bf16/fp16 operand, when every
// operand's address at the chunk start is aligned for that (chunk starts are multiples of
// kChunk elements, so this is the alignment of the tensors themselves: PyTorch's
// allocator gives 256-byte aligned storages, views at odd offsets fall back). The tail
// of a chunk (fewer than 4 left) and unaligned tensors take the scalar path; both run the
// same functors (kernels/functors.h), so results do not depend on the path.
constexpr int kVec = 4;

__device__ __forceinline__ bool vec_aligned(const void* p, int64_t i, uint8_t code) {
  if (p == nullptr) return true;
  const int bytes = code == kF32 ? 4 : 2;
  return (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(i) * bytes) % (bytes * kVec) == 0;
}

__device__ __forceinline__ void load4(const void* p, int64_t i, uint8_t code, float (&v)[kVec]) {
  if (code == kF32) {
    const float4 x = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
  } else if (code == kBF16) {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p) + i);
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
    for (int k = 0; k < kVec; ++k) v[k] = __bfloat162float(h[k]);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __half*>(p) + i);
    const __half* h = reinterpret_cast<const __half*>(&raw);
    for (int k = 0; k < kVec; ++k) v[k] = __half2float(h[k]);
  }
}

__device__ __forceinline__ void store4(void* p, int64_t i, uint8_t code, const float (&v)[kVec]) {
  if (code == kF32) {
    *reinterpret_cast<float4*>(static_cast<float*>(p) + i) = make_float4(v[0], v[1], v[2], v[3]);
  } else if (code == kBF16) {
    uint2 raw;
    __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(&raw);
    for (int k = 0; k < kVec; ++k) h[k] = __float2bfloat16_rn(v[k]);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p) + i) = raw;
  } else {
    uint2 raw;
    __half* h = reinterpret_cast<__half*>(&raw);
    for (int k = 0; k < kVec; ++k) h[k] = __float2half_rn(v[k]);
    *reinterpret_cast<uint2*>(static_cast<__half*>(p) + i) = raw;
  }
}

// Op::apply(meta, tensor, begin, end, global_block) runs per block.
template <int N, class Op>
__global__ void __launch_bounds__(kBlock) multi_tensor_kernel(TensorListMeta<N> meta, Op op) {
  const int t = meta.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = begin + kChunk < meta.numel[t] ? begin + kChunk : meta.numel[t];
  op.apply(meta, t, begin, end, meta.first_block + blockIdx.x);
}

// slots[i][k]: tensor i of list k; numels[i] its size. Returns the block count.
template <int N, class Op>
int64_t multi_tensor_apply(const std::vector<std::array<Slot, N>>& slots,
                           const std::vector<int64_t>& numels, const Op& op, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  TensorListMeta<N> meta;
  int n_tensors = 0, n_blocks = 0;
  int64_t launched = 0;
  auto launch = [&]() {
    if (n_blocks == 0) return;
    meta.first_block = launched;
    multi_tensor_kernel<N, Op><<<n_blocks, kBlock, 0, s>>>(meta, op);
    const cudaError_t err = cudaGetLastError();
    TORCH_CHECK(err == cudaSuccess, "mixprec: CUDA launch failed: ", cudaGetErrorString(err));
    launched += n_blocks;
    n_blocks = 0;
  };
  for (size_t i = 0; i < slots.size(); ++i) {
    if (numels[i] == 0) continue;
    if (n_tensors == kMaxTensors) {
      launch();
      n_tensors = 0;
    }
    int cur = n_tensors++;
    for (int k = 0; k < N; ++k) {
      meta.addr[k][cur] = slots[i][k].ptr;
      meta.code[k][cur] = slots[i][k].code;
    }
    meta.numel[cur] = numels[i];
    const int64_t chunks = (numels[i] + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (n_blocks == kMaxBlocks) {
        launch();
        // The tensor continues in the next launch, as its only slot so far.
        for (int k = 0; k < N; ++k) {
          meta.addr[k][0] = meta.addr[k][cur];
          meta.code[k][0] = meta.code[k][cur];
        }
        meta.numel[0] = meta.numel[cur];
        cur = 0;
        n_tensors = 1;
      }
      meta.block_tensor[n_blocks] = static_cast<uint8_t>(cur);
      meta.block_chunk[n_blocks] = static_cast<int32_t>(c);
      ++n_blocks;
    }
  }
  launch();
  return launched;
}

// Slots and sizes of parallel tensor lists (lists after the first may be empty).
template <int N>
void make_slots(const std::array<const std::vector<at::Tensor>*, N>& lists,
                std::vector<std::array<Slot, N>>* slots, std::vector<int64_t>* numels) {
  const auto& first = *lists[0];
  slots->assign(first.size(), {});
  numels->resize(first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    (*numels)[i] = first[i].numel();
    for (int k = 0; k < N; ++k) {
      if (!lists[k]->empty()) {
        const at::Tensor& t = (*lists[k])[i];
        (*slots)[i][k] = Slot{t.data_ptr(), dtype_code(t.scalar_type())};
      }
    }
  }
}

inline float* f32_ptr(const at::Tensor* t) {
  return t ? static_cast<float*>(t->data_ptr()) : nullptr;
}

}  // namespace mixprec::kernels::cuda
