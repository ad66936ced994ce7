// Unscale + non-finite check and global L2 norm (CUDA).
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/multi_tensor_apply.cuh"

namespace mixprec::kernels::cuda {
namespace {

struct UnscaleOp {
  float* found_inf;
  const float* inv_scale;
  __device__ void apply(const TensorListMeta<1>& m, int t, int64_t b, int64_t e, int64_t) const {
    const float inv = *inv_scale;
    bool bad = false;
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
      const float v = load_f(m.addr[0][t], i, m.code[0][t]);
      bad |= !isfinite(v);
      store_f(m.addr[0][t], i, m.code[0][t], __fmul_rn(v, inv));
    }
    if (bad) *found_inf = 1.0f;  // every writer stores the same value: no atomic needed
  }
};

// [Note: deterministic CUDA norm] one fp32 partial per block, reduced in a
// fixed tree order, then one block adds the partials in a fixed order.
struct SumSqOp {
  float* partials;
  __device__ void apply(const TensorListMeta<1>& m, int t, int64_t b, int64_t e,
                        int64_t block) const {
    __shared__ float red[kBlock];
    float acc = 0.f;
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
      const float v = load_f(m.addr[0][t], i, m.code[0][t]);
      acc = __fadd_rn(acc, __fmul_rn(v, v));
    }
    red[threadIdx.x] = acc;
    __syncthreads();
    for (int w = kBlock / 2; w > 0; w >>= 1) {
      if (threadIdx.x < w) red[threadIdx.x] = __fadd_rn(red[threadIdx.x], red[threadIdx.x + w]);
      __syncthreads();
    }
    if (threadIdx.x == 0) partials[block] = red[0];
  }
};

__global__ void finish_norm(const float* partials, int64_t n, float* out, float* found_inf) {
  __shared__ double red[kBlock];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partials[i];
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kBlock / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float norm = static_cast<float>(sqrt(red[0]));
    *out = norm;
    if (found_inf != nullptr && !isfinite(norm)) *found_inf = 1.0f;
  }
}

}  // namespace

void unscale_and_check(const TensorVec& tensors, const at::Tensor& found_inf,
                       const at::Tensor& inv_scale, void* stream) {
  std::vector<std::array<Slot, 1>> slots;
  std::vector<int64_t> numels;
  make_slots<1>({&tensors}, &slots, &numels);
  multi_tensor_apply<1>(slots, numels, UnscaleOp{f32_ptr(&found_inf), f32_ptr(&inv_scale)},
                        stream);
}

int64_t l2_norm_num_partials(const TensorVec& tensors) {
  std::vector<int64_t> numels;
  for (const auto& t : tensors) numels.push_back(t.numel());
  return num_blocks(numels);
}

void l2_norm(const TensorVec& tensors, const at::Tensor& partials, const at::Tensor& out,
             const at::Tensor* found_inf, void* stream) {
  std::vector<std::array<Slot, 1>> slots;
  std::vector<int64_t> numels;
  make_slots<1>({&tensors}, &slots, &numels);
  const int64_t n = multi_tensor_apply<1>(slots, numels, SumSqOp{f32_ptr(&partials)}, stream);
  finish_norm<<<1, kBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      f32_ptr(&partials), n, f32_ptr(&out), f32_ptr(found_inf));
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "mixprec: CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace mixprec::kernels::cuda
