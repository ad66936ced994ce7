// Bindings for csrc/engines/step (the post-backward step in one call).
#include "bindings/bindings.h"
#include "engines/step/fused_step.h"

namespace py = pybind11;

namespace mixprec::bindings {

namespace {

namespace k = mixprec::kernels;

// Groups come as plain tuples, converted here: building a bound object per group would
// be one more call into C++ each ([Note: one call per step]).
void check_arity(const char* what, const py::tuple& t, size_t n) {
  TORCH_CHECK_VALUE(t.size() == n, "fused_step: an ", what, " group is a tuple of ", n,
                    " items (see src/mixprec/kernels.py), got ", t.size());
}

std::vector<engines::AdamGroup> adam_groups(const std::vector<py::tuple>& groups) {
  // (params, grads, exp_avgs, exp_avg_sqs, lowp_params, steps,
  //  lr, beta1, beta2, eps, weight_decay, decoupled, maximize)
  std::vector<engines::AdamGroup> out;
  for (const auto& t : groups) {
    check_arity("adam", t, 13);
    out.push_back(engines::AdamGroup{
        t[0].cast<k::TensorVec>(), t[1].cast<k::TensorVec>(), t[2].cast<k::TensorVec>(),
        t[3].cast<k::TensorVec>(), t[4].cast<k::TensorVec>(), t[5].cast<k::TensorVec>(),
        k::AdamOptions{t[6].cast<double>(), t[7].cast<double>(), t[8].cast<double>(),
                       t[9].cast<double>(), t[10].cast<double>(), 0.0, t[11].cast<bool>(),
                       t[12].cast<bool>()}});
  }
  return out;
}

std::vector<engines::SgdGroup> sgd_groups(const std::vector<py::tuple>& groups) {
  // (params, grads, momentum_buffers, lowp_params,
  //  lr, momentum, dampening, nesterov, weight_decay, maximize, first_step)
  std::vector<engines::SgdGroup> out;
  for (const auto& t : groups) {
    check_arity("sgd", t, 11);
    out.push_back(engines::SgdGroup{
        t[0].cast<k::TensorVec>(), t[1].cast<k::TensorVec>(), t[2].cast<k::TensorVec>(),
        t[3].cast<k::TensorVec>(),
        k::SgdOptions{t[4].cast<double>(), t[5].cast<double>(), t[6].cast<double>(),
                      t[8].cast<double>(), t[7].cast<bool>(), t[9].cast<bool>(),
                      t[10].cast<bool>()}});
  }
  return out;
}

}  // namespace

void init_step(py::module_& m) {

  m.def(
      "fused_step",
      [](const std::vector<py::tuple>& adam, const std::vector<py::tuple>& sgd,
         const k::OptTensor& found_inf,
         bool check, std::vector<engines::Reducer*> reducers, const std::string& agree_group,
         const k::OptTensor& grad_scale, std::vector<engines::sharded::ShardedCore*> gather,
         precision::GradScaler* scaler, bool update_scaler, const k::OptTensor& keep_found_inf,
         const k::OptTensor& keep_scale) {
        engines::StepPlan plan{adam_groups(adam), sgd_groups(sgd), found_inf, check,
                               std::move(reducers), agree_group, grad_scale, std::move(gather),
                               scaler, update_scaler, keep_found_inf, keep_scale};
        py::gil_scoped_release nogil;
        engines::fused_step(plan);
      },
      py::arg("adam") = std::vector<py::tuple>{}, py::arg("sgd") = std::vector<py::tuple>{},
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
  m.def("merge_nonfinite_checks", &engines::merge_nonfinite_checks, py::arg("reducers"),
        py::arg("found_inf"),
        "OR every reducer's fresh agreed inf/nan flag into found_inf; False (nothing taken "
        "into account) when some reducer has none.");
  m.def("finish_reductions", &engines::finish_reductions, py::arg("cores"),
        py::call_guard<py::gil_scoped_release>(),
        "Finish every core's pending reductions, in order; which cores hold gradients.");
}

}  // namespace mixprec::bindings
