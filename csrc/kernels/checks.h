// Precondition checks shared by every device path of the multi-tensor ops.
// Messages name the op, the list, the index and the bad property, and say how
// to fix it.
#pragma once

#include "kernels/multi_tensor.h"

#include <initializer_list>

namespace mixprec::kernels {

enum class Dtypes { kFloat32, kFloating /* fp32, bf16, fp16 */, kLowp /* bf16, fp16 */ };

// Every tensor defined, on `device`, contiguous, of an allowed dtype.
void check_list(const char* op, const char* name, const TensorVec& ts, const at::Device& device,
                Dtypes allowed);

// `other` has as many tensors as `ref`, each with the same numel.
void check_same_sizes(const char* op, const char* ref_name, const TensorVec& ref,
                      const char* name, const TensorVec& other);

// A 1-element fp32 flag or scale tensor on `device`.
void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t,
                         const at::Device& device);

// Device of the first tensor (the one all others must match).
at::Device list_device(const TensorVec& ts);

// Marks in-place writes for autograd, as an in-place torch op would.
void bump_versions(std::initializer_list<const TensorVec*> lists);

}  // namespace mixprec::kernels
