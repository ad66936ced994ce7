// The private compiled module `mixprec._C`. Python code imports it only through
// the `mixprec` package, which imports torch first so libtorch is loaded.
#include "bindings/bindings.h"

#ifndef MIXPREC_CUDA_ARCHS
#error "MIXPREC_CUDA_ARCHS (the CUDA archs of the kernels, comma-separated) comes from CMakeLists.txt"
#endif

namespace {

// MIXPREC_CUDA_ARCHS as a list: CMake's CUDA_ARCHITECTURES entries ("75-real", ..., "120"),
// empty without CUDA kernels. src/mixprec/cuda_arch.py checks the running GPU against it.
pybind11::list cuda_archs() {
  pybind11::list out;
  const std::string csv = MIXPREC_CUDA_ARCHS;
  size_t start = 0;
  while (start < csv.size()) {
    size_t end = csv.find(',', start);
    if (end == std::string::npos) end = csv.size();
    if (end > start) out.append(csv.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

pybind11::dict build_info() {
  pybind11::dict info;
  info["torch_version"] = MIXPREC_TORCH_VERSION;
  info["cuda"] = static_cast<bool>(MIXPREC_WITH_CUDA);
  info["cuda_archs"] = cuda_archs();
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
        "whether CUDA kernels were compiled and for which archs (cuda_archs), C++ ABI.");
  mixprec::bindings::init_precision(m);
  mixprec::bindings::init_kernels(m);
  mixprec::bindings::init_engines(m);
  mixprec::bindings::init_sharded(m);
  mixprec::bindings::init_step(m);

}
