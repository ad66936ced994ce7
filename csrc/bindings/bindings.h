// One init function per area; module.cpp calls them all. Each lives in its own
// binding file so that touching one area recompiles one translation unit.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace mixprec::bindings {

void init_precision(pybind11::module_& m);
void init_kernels(pybind11::module_& m);
void init_engines(pybind11::module_& m);
void init_sharded(pybind11::module_& m);
void init_step(pybind11::module_& m);


}  // namespace mixprec::bindings
