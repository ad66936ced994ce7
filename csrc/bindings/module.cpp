// The private compiled module `mixprec._C`. Python code imports it only through
// the `mixprec` package, which imports torch first so libtorch is loaded.
#include "bindings/bindings.h"

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["torch_version"] = MIXPREC_TORCH_VERSION;
  info["cuda"] = static_cast<bool>(MIXPREC_WITH_CUDA);
  info["cxx11_abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "mixprec C++ core (private: use the `mixprec` package)";
  m.def("build_info", &build_info,
        "What this build of mixprec._C contains: torch version it was built against, "
        "whether CUDA kernels were compiled, C++ ABI.");
  mixprec::bindings::init_precision(m);
  mixprec::bindings::init_kernels(m);
  mixprec::bindings::init_engines(m);
  mixprec::bindings::init_sharded(m);
  mixprec::bindings::init_step(m);

}
