#include "kernels/checks.h"

#include <c10/util/Exception.h>

namespace mixprec::kernels {

namespace {

bool dtype_ok(at::ScalarType t, Dtypes allowed) {
  switch (allowed) {
    case Dtypes::kFloat32: return t == at::kFloat;
    case Dtypes::kFloating: return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
    case Dtypes::kLowp: return t == at::kBFloat16 || t == at::kHalf;
  }
  return false;
}

const char* dtype_names(Dtypes allowed) {
  switch (allowed) {
    case Dtypes::kFloat32: return "float32";
    case Dtypes::kFloating: return "float32, bfloat16 or float16";
    case Dtypes::kLowp: return "bfloat16 or float16";
  }
  return "?";
}

}  // namespace

void check_list(const char* op, const char* name, const TensorVec& ts, const at::Device& device,
                Dtypes allowed) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    TORCH_CHECK_VALUE(t.defined(), "mixprec.", op, ": ", name, "[", i,
                      "] is undefined (None); pass a tensor");
    TORCH_CHECK_VALUE(t.device() == device, "mixprec.", op, ": ", name, "[", i, "] is on ",
                      t.device(), " but the first tensor is on ", device,
                      "; all tensors of one call must be on the same device");
    TORCH_CHECK_TYPE(dtype_ok(t.scalar_type(), allowed), "mixprec.", op, ": ", name, "[", i,
                     "] has dtype ", t.scalar_type(), " but must be ", dtype_names(allowed));
    TORCH_CHECK_VALUE(t.is_contiguous(), "mixprec.", op, ": ", name, "[", i,
                      "] is not contiguous (sizes ", t.sizes(), ", strides ", t.strides(),
                      "); pass t.contiguous()");
    TORCH_CHECK_VALUE(!t.is_complex() && t.layout() == at::kStrided, "mixprec.", op, ": ", name,
                      "[", i, "] must be a dense real tensor");
  }
}

void check_same_sizes(const char* op, const char* ref_name, const TensorVec& ref,
                      const char* name, const TensorVec& other) {
  TORCH_CHECK_VALUE(other.size() == ref.size(), "mixprec.", op, ": ", name, " has ",
                    other.size(), " tensors but ", ref_name, " has ", ref.size(),
                    "; the lists must be parallel");
  for (size_t i = 0; i < ref.size(); ++i) {
    TORCH_CHECK_VALUE(other[i].numel() == ref[i].numel(), "mixprec.", op, ": ", name, "[", i,
                      "] has ", other[i].numel(), " elements but ", ref_name, "[", i, "] has ",
                      ref[i].numel(), "; pass tensors of matching sizes");
  }
}

void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t,
                         const at::Device& device) {
  TORCH_CHECK_VALUE(t.defined(), "mixprec.", op, ": ", name, " is undefined");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "mixprec.", op, ": ", name,
                   " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == 1, "mixprec.", op, ": ", name,
                    " must have exactly one element, got ", t.numel());
  TORCH_CHECK_VALUE(t.device() == device, "mixprec.", op, ": ", name, " is on ", t.device(),
                    " but the tensors are on ", device, "; keep it on the tensors' device");
}

at::Device list_device(const TensorVec& ts) {
  TORCH_INTERNAL_ASSERT(!ts.empty());
  TORCH_CHECK_VALUE(ts[0].defined(), "mixprec: tensor 0 of the list is undefined (None)");
  return ts[0].device();
}

void bump_versions(std::initializer_list<const TensorVec*> lists) {
  for (const TensorVec* l : lists) {
    for (const at::Tensor& t : *l) t.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace mixprec::kernels
