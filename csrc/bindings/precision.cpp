// Bindings for csrc/precision: the loss scaler and fp32 master weights.
#include "bindings/bindings.h"
#include "precision/grad_scaler.h"
#include "precision/master_weights.h"

namespace py = pybind11;

namespace mixprec::bindings {

void init_precision(py::module_& m) {
  using precision::GradScaler;
  using precision::MasterWeights;
  using precision::ScalerOptions;

  py::class_<ScalerOptions>(m, "ScalerOptions")
      .def(py::init([](double init_scale, double growth_factor, double backoff_factor,
                       int64_t growth_interval, int64_t hysteresis, double min_scale,
                       double max_scale) {
             return ScalerOptions{init_scale, growth_factor, backoff_factor, growth_interval,
                                  hysteresis, min_scale, max_scale};
           }),
           py::kw_only(), py::arg("init_scale") = 65536.0, py::arg("growth_factor") = 2.0,
           py::arg("backoff_factor") = 0.5, py::arg("growth_interval") = 2000,
           py::arg("hysteresis") = 1, py::arg("min_scale") = 0.0,
           py::arg("max_scale") = std::numeric_limits<double>::infinity())
      .def_readonly("init_scale", &ScalerOptions::init_scale)
      .def_readonly("growth_factor", &ScalerOptions::growth_factor)
      .def_readonly("backoff_factor", &ScalerOptions::backoff_factor)
      .def_readonly("growth_interval", &ScalerOptions::growth_interval)
      .def_readonly("hysteresis", &ScalerOptions::hysteresis)
      .def_readonly("min_scale", &ScalerOptions::min_scale)
      .def_readonly("max_scale", &ScalerOptions::max_scale);

  py::class_<GradScaler>(m, "GradScaler")
      .def(py::init<const ScalerOptions&, const at::Device&>(), py::arg("options"),
           py::arg("device"))
      .def("scale_loss", &GradScaler::scale_loss, py::arg("loss"))
      .def("inv_scale", &GradScaler::inv_scale)
      .def_property_readonly("found_inf", &GradScaler::found_inf)
      .def_property_readonly("scale", &GradScaler::scale)
      .def("scale_value", &GradScaler::scale_value)
      .def("update", &GradScaler::update, py::arg("tensor_ops") = false)
      .def("clear_found_inf", &GradScaler::clear_found_inf)
      .def_property_readonly("options", &GradScaler::options)
      .def("growth_tracker", &GradScaler::growth_tracker)
      .def("hysteresis_left", &GradScaler::hysteresis_left)
      .def("load", &GradScaler::load, py::arg("scale"), py::arg("growth_tracker"),
           py::arg("hysteresis_left"));

  py::class_<MasterWeights>(m, "MasterWeights")
      .def(py::init<std::vector<at::Tensor>>(), py::arg("params"))
      .def_property_readonly("params", &MasterWeights::params)
      .def_property_readonly("masters", &MasterWeights::masters)
      .def("fold_grads", &MasterWeights::fold_grads)
      .def("write_back", &MasterWeights::write_back)
      .def("reload_from_params", &MasterWeights::reload_from_params)
      .def("master_grads", &MasterWeights::master_grads);
}

}  // namespace mixprec::bindings
