// Bindings for csrc/engines/step (the post-backward step in one call).
#include "bindings/bindings.h"
#include "engines/step/fused_step.h"

namespace py = pybind11;

namespace mixprec::bindings {

void init_step(py::module_& m) {
  namespace k = mixprec::kernels;
  using engines::AdamGroup;
  using engines::SgdGroup;

  py::class_<AdamGroup>(m, "AdamGroup")
      .def(py::init([](k::TensorVec params, k::TensorVec grads, k::TensorVec exp_avgs,
                       k::TensorVec exp_avg_sqs, k::TensorVec lowp_params, k::TensorVec steps,
                       double lr, double beta1, double beta2, double eps, double weight_decay,
                       bool decoupled, bool maximize) {
             return AdamGroup{std::move(params), std::move(grads), std::move(exp_avgs),
                              std::move(exp_avg_sqs), std::move(lowp_params), std::move(steps),
                              k::AdamOptions{lr, beta1, beta2, eps, weight_decay, 0.0, decoupled,
                                             maximize}};
           }),
           py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
           py::arg("lowp_params"), py::arg("steps"), py::kw_only(), py::arg("lr"),
           py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("decoupled"), py::arg("maximize"));

  py::class_<SgdGroup>(m, "SgdGroup")
      .def(py::init([](k::TensorVec params, k::TensorVec grads, k::TensorVec momentum_buffers,
                       k::TensorVec lowp_params, double lr, double momentum, double dampening,
                       bool nesterov, double weight_decay, bool maximize, bool first_step) {
             return SgdGroup{std::move(params), std::move(grads), std::move(momentum_buffers),
                             std::move(lowp_params),
                             k::SgdOptions{lr, momentum, dampening, weight_decay, nesterov,
                                           maximize, first_step}};
           }),
           py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
           py::arg("lowp_params"), py::kw_only(), py::arg("lr"), py::arg("momentum"),
           py::arg("dampening"), py::arg("nesterov"), py::arg("weight_decay"),
           py::arg("maximize"), py::arg("first_step"));

  m.def(
      "fused_step",
      [](std::vector<AdamGroup> adam, std::vector<SgdGroup> sgd, const k::OptTensor& found_inf,
         bool check, std::vector<engines::Reducer*> reducers, const std::string& agree_group,
         const k::OptTensor& grad_scale, std::vector<engines::sharded::ShardedCore*> gather,
         precision::GradScaler* scaler, bool update_scaler, const k::OptTensor& keep_found_inf,
         const k::OptTensor& keep_scale) {
        engines::StepPlan plan{std::move(adam), std::move(sgd), found_inf, check,
                               std::move(reducers), agree_group, grad_scale, std::move(gather),
                               scaler, update_scaler, keep_found_inf, keep_scale};
        py::gil_scoped_release nogil;
        engines::fused_step(plan);
      },
      py::arg("adam") = std::vector<AdamGroup>{}, py::arg("sgd") = std::vector<SgdGroup>{},
      py::kw_only(), py::arg("found_inf") = py::none(), py::arg("check") = false,
      py::arg("reducers") = std::vector<engines::Reducer*>{}, py::arg("agree_group") = "",
      py::arg("grad_scale") = py::none(),
      py::arg("gather") = std::vector<engines::sharded::ShardedCore*>{},
      py::arg("scaler") = static_cast<precision::GradScaler*>(nullptr),
      py::arg("update_scaler") = false, py::arg("keep_found_inf") = py::none(), py::arg("keep_scale") = py::none(),
      "The post-backward optimizer step in one call ([Note: one call per step] in "
      "csrc/engines/step/fused_step.h): check (and unscale) the gradients, agree found_inf "
      "across ranks, run the fused updates (skipped on the device when found_inf is set), "
      "gather the updated shards, update the loss scaler.");
}

}  // namespace mixprec::bindings
