// Bindings for csrc/comm and csrc/engines.
#include "bindings/bindings.h"
#include "comm/process_group.h"
#include "engines/replicated/reducer.h"

namespace py = pybind11;

namespace mixprec::bindings {

void init_engines(py::module_& m) {
  using engines::Reducer;
  using engines::ReducerOptions;

  m.def("broadcast_coalesced", &comm::broadcast_coalesced, py::arg("tensors"),
        py::arg("group_name"), py::arg("root") = 0,
        "Broadcast tensors in place from `root`, one collective per dtype run.",
        py::call_guard<py::gil_scoped_release>());

  py::class_<ReducerOptions>(m, "ReducerOptions")
      .def(py::init([](int64_t bucket_cap_bytes, int64_t first_bucket_cap_bytes,
                       std::optional<at::ScalarType> reduce_dtype, bool find_unused_parameters,
                       bool check_nonfinite) {
             ReducerOptions o;
             o.bucket_cap_bytes = bucket_cap_bytes;
             o.first_bucket_cap_bytes = first_bucket_cap_bytes;
             o.reduce_dtype = reduce_dtype.value_or(at::ScalarType::Undefined);
             o.find_unused_parameters = find_unused_parameters;
             o.check_nonfinite = check_nonfinite;
             return o;
           }),
           py::kw_only(), py::arg("bucket_cap_bytes") = 25 * 1024 * 1024,
           py::arg("first_bucket_cap_bytes") = 1024 * 1024, py::arg("reduce_dtype") = py::none(),
           py::arg("find_unused_parameters") = false, py::arg("check_nonfinite") = false);

  py::class_<Reducer>(m, "Reducer")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::string>,
                    const std::string&, const ReducerOptions&>(),
           py::arg("params"), py::arg("targets"), py::arg("names"), py::arg("group_name"),
           py::arg("options"))
      .def("set_sync", &Reducer::set_sync, py::arg("sync"))
      .def_property_readonly("sync", &Reducer::sync)
      .def_property_readonly("world_size", &Reducer::world_size)
      .def("bucket_indices", &Reducer::bucket_indices)
      .def("bytes_reduced_last_backward", &Reducer::bytes_reduced_last_backward)
      .def_property_readonly("checks_nonfinite", &Reducer::checks_nonfinite)
      .def("take_nonfinite_check", &Reducer::take_nonfinite_check,
           "The agreed inf/nan flag of the last synchronising backward (> 0: some rank saw "
           "one), once; None when there is none to take.");
}

}  // namespace mixprec::bindings
