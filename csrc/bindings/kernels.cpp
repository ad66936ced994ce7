// Bindings for csrc/kernels (multi-tensor kernels). Filled in by the kernels work.
#include "bindings/bindings.h"

namespace mixprec::bindings {

void init_kernels(pybind11::module_& m) {}

}  // namespace mixprec::bindings
