// Bindings for csrc/engines/step (the post-backward step in one call).
#include "bindings/bindings.h"
#include "engines/step/fused_step.h"
#include "engines/step/optimizer_plan.h"

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

// Per-group hyper-parameters of a planned step ([Note: the step plan]).
std::vector<k::AdamOptions> adam_options(const std::vector<py::tuple>& options) {
  // (lr, beta1, beta2, eps, weight_decay, decoupled, maximize)
  std::vector<k::AdamOptions> out;
  out.reserve(options.size());
  for (const auto& t : options) {
    check_arity("adam options", t, 7);
    out.push_back(k::AdamOptions{t[0].cast<double>(), t[1].cast<double>(), t[2].cast<double>(),
                                 t[3].cast<double>(), t[4].cast<double>(), 0.0, t[5].cast<bool>(),
                                 t[6].cast<bool>()});
  }
  return out;
}

std::vector<k::SgdOptions> sgd_options(const std::vector<py::tuple>& options) {
  // (lr, momentum, dampening, nesterov, weight_decay, maximize)
  std::vector<k::SgdOptions> out;
  out.reserve(options.size());
  for (const auto& t : options) {
    check_arity("sgd options", t, 6);
    out.push_back(k::SgdOptions{t[0].cast<double>(), t[1].cast<double>(), t[2].cast<double>(),
                                t[4].cast<double>(), t[3].cast<bool>(), t[5].cast<bool>(), false});
  }
  return out;
}

// [Note: the plan's sources]
// A step plan holds tensors taken from the optimizer's Python containers: each group's
// `params` list and the `state` dict with one dict per param. Python keeps the plan while
// those containers are the same objects of the same sizes (an O(param groups) check,
// src/mixprec/kernels.py). A container edited in place at the same size (a list item
// replaced, `state[p] = {...}`, `state[p]["exp_avg"] = t`) is not seen by that check, so
// the plan also records every item's identity when it is built, and the step and the clip
// compare them here, before using the plan: pointer compares under the GIL, with no Python
// call, O(params) in C++ per step. A difference is reported, nothing is done, and Python
// rebuilds the plan.
class PlanSource {
 public:
  PlanSource(const py::list& lists, const py::dict& state) : state_(state) {
    for (const auto& l : lists) {
      auto list = py::reinterpret_borrow<py::list>(l);
      std::vector<py::object> items;
      for (const auto& x : list) items.push_back(py::reinterpret_borrow<py::object>(x));
      lists_.push_back(list);
      items_.push_back(std::move(items));
    }
    PyObject *key = nullptr, *value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(state.ptr(), &pos, &key, &value)) {
      entries_.emplace_back(py::reinterpret_borrow<py::object>(key), py::reinterpret_borrow<py::object>(value));
      std::vector<std::pair<py::object, py::object>> inner;
      if (PyDict_Check(value)) {
        PyObject *k2 = nullptr, *v2 = nullptr;
        Py_ssize_t pos2 = 0;
        while (PyDict_Next(value, &pos2, &k2, &v2)) {
          inner.emplace_back(py::reinterpret_borrow<py::object>(k2), py::reinterpret_borrow<py::object>(v2));
        }
      }
      inner_.push_back(std::move(inner));
    }
  }

  // The containers still hold exactly what they held when the plan was built (GIL held).
  bool current() const {
    for (size_t i = 0; i < lists_.size(); ++i) {
      PyObject* list = lists_[i].ptr();
      const auto& items = items_[i];
      if (static_cast<size_t>(PyList_GET_SIZE(list)) != items.size()) return false;
      for (size_t j = 0; j < items.size(); ++j) {
        if (PyList_GET_ITEM(list, j) != items[j].ptr()) return false;
      }
    }
    if (static_cast<size_t>(PyDict_Size(state_.ptr())) != entries_.size()) return false;
    PyObject *key = nullptr, *value = nullptr;
    Py_ssize_t pos = 0;
    size_t n = 0;
    while (PyDict_Next(state_.ptr(), &pos, &key, &value)) {
      if (n >= entries_.size() || key != entries_[n].first.ptr() || value != entries_[n].second.ptr()) return false;
      const auto& inner = inner_[n++];
      if (!PyDict_Check(value)) continue;
      if (static_cast<size_t>(PyDict_Size(value)) != inner.size()) return false;
      PyObject *k2 = nullptr, *v2 = nullptr;
      Py_ssize_t pos2 = 0;
      size_t m2 = 0;
      while (PyDict_Next(value, &pos2, &k2, &v2)) {
        if (m2 >= inner.size() || k2 != inner[m2].first.ptr() || v2 != inner[m2].second.ptr()) return false;
        ++m2;
      }
    }
    return n == entries_.size();
  }

 private:
  std::vector<py::list> lists_;
  std::vector<std::vector<py::object>> items_;
  py::dict state_;
  std::vector<std::pair<py::object, py::object>> entries_;
  std::vector<std::vector<std::pair<py::object, py::object>>> inner_;
};

constexpr int kStale = 3;          // the plan's sources changed: nothing done
constexpr int kOutsiderGrad = 4;   // a param outside the plans holds a gradient: nothing done

}  // namespace

void init_step(py::module_& m) {
  py::class_<PlanSource, std::shared_ptr<PlanSource>>(
      m, "PlanSource",
      "The identities of an optimizer's param lists and state entries when its step plan was "
      "built ([Note: the plan's sources] in csrc/bindings/step.cpp).")
      .def(py::init<const py::list&, const py::dict&>(), py::arg("lists"), py::arg("state"))
      .def("current", &PlanSource::current, "The containers still hold what they held at build time.");

  py::class_<engines::OptimizerPlan, std::shared_ptr<engines::OptimizerPlan>>(
      m, "OptimizerPlan",
      "What a fused step reads, gathered once per optimizer ([Note: the step plan] in "
      "csrc/engines/step/optimizer_plan.h); built by src/mixprec/kernels.py.")
      .def(py::init([](bool adam, const std::vector<py::tuple>& buckets) {
             // (group, params, state1, state2, steps, lowps); None entries: no state yet
             std::vector<engines::PlanBucket> out;
             out.reserve(buckets.size());
             for (const auto& t : buckets) {
               check_arity("plan bucket", t, 6);
               auto tensors = [](const py::handle& h) {
                 k::TensorVec v;
                 for (const auto& x : h.cast<py::list>()) {
                   v.push_back(x.is_none() ? at::Tensor() : x.cast<at::Tensor>());
                 }
                 return v;
               };
               out.push_back(engines::PlanBucket{t[0].cast<int64_t>(), tensors(t[1]), tensors(t[2]), tensors(t[3]),
                                                 tensors(t[4]), tensors(t[5])});
             }
             return std::make_shared<engines::OptimizerPlan>(adam, std::move(out));
           }),
           py::arg("adam"), py::arg("buckets"))
      .def_property_readonly("adam", &engines::OptimizerPlan::adam)
      .def_property_readonly("num_params", &engines::OptimizerPlan::num_params)
      .def("grads", &engines::OptimizerPlan::grads, py::call_guard<py::gil_scoped_release>(),
           "The defined gradients of the planned params, in plan order.");

  m.def(
      "fused_step",
      [](const std::vector<py::tuple>& adam, const std::vector<py::tuple>& sgd,
         const std::shared_ptr<engines::OptimizerPlan>& plan, const std::vector<py::tuple>& options,
         const std::shared_ptr<PlanSource>& source, const k::OptTensor& found_inf,
         bool check, std::vector<engines::Reducer*> reducers, const std::string& agree_group,
         const k::OptTensor& grad_scale, std::vector<engines::sharded::ShardedCore*> gather,
         precision::GradScaler* scaler, bool update_scaler, const k::OptTensor& keep_found_inf,
         const k::OptTensor& keep_scale) {
        engines::StepPlan step{adam_groups(adam), sgd_groups(sgd), found_inf, check,
                               std::move(reducers), agree_group, grad_scale, std::move(gather),
                               scaler, update_scaler, keep_found_inf, keep_scale};
        if (plan && source && !source->current()) return kStale;
        std::vector<k::AdamOptions> adam_opts;
        std::vector<k::SgdOptions> sgd_opts;
        if (plan) {
          if (plan->adam()) adam_opts = adam_options(options);
          else sgd_opts = sgd_options(options);
        }
        py::gil_scoped_release nogil;
        if (plan) {
          const auto status = plan->collect(adam_opts, sgd_opts, step);
          if (status != engines::PlanStatus::kReady) return static_cast<int>(status);
        }
        engines::fused_step(step);
        return static_cast<int>(engines::PlanStatus::kReady);
      },
      py::arg("adam") = std::vector<py::tuple>{}, py::arg("sgd") = std::vector<py::tuple>{},
      py::kw_only(), py::arg("plan") = std::shared_ptr<engines::OptimizerPlan>(),
      py::arg("options") = std::vector<py::tuple>{}, py::arg("source") = std::shared_ptr<PlanSource>(),
      py::arg("found_inf") = py::none(), py::arg("check") = false,
      py::arg("reducers") = std::vector<engines::Reducer*>{}, py::arg("agree_group") = "",
      py::arg("grad_scale") = py::none(),
      py::arg("gather") = std::vector<engines::sharded::ShardedCore*>{},
      py::arg("scaler") = static_cast<precision::GradScaler*>(nullptr),
      py::arg("update_scaler") = false, py::arg("keep_found_inf") = py::none(), py::arg("keep_scale") = py::none(),
      "The post-backward optimizer step in one call ([Note: one call per step] in "
      "csrc/engines/step/fused_step.h): check (and unscale) the gradients, agree found_inf "
      "across ranks, run the fused updates (skipped on the device when found_inf is set), "
      "gather the updated shards, update the loss scaler. With `plan` (an OptimizerPlan) and "
      "its per-group `options`, the plan's params that hold a gradient are the update's groups "
      "(added to `adam`/`sgd`). Returns 0 (done), or without doing anything 1 (the plan "
      "declined a param or gradient), 2 (a param with a gradient has no state yet) or 3 "
      "(`source`, the plan's PlanSource, says the optimizer's lists or state changed).");
  m.def(
      "plans_l2_norm",
      [](const std::vector<std::shared_ptr<engines::OptimizerPlan>>& plans, const k::OptTensor& found_inf,
         const std::vector<std::shared_ptr<PlanSource>>& sources, const py::tuple& outsiders) {
        using Result = std::pair<int, std::optional<at::Tensor>>;
        for (const auto& source : sources) {
          if (source && !source->current()) return Result{kStale, std::nullopt};
        }
        for (const auto& t : outsiders) {
          if (t.cast<at::Tensor>().grad().defined()) return Result{kOutsiderGrad, std::nullopt};
        }
        py::gil_scoped_release nogil;
        k::TensorVec grads;
        for (const auto& plan : plans) {
          TORCH_CHECK_VALUE(plan != nullptr, "plans_l2_norm: a plan is None");
          for (auto& g : plan->grads()) {
            // The kernels read contiguous memory; a gradient of another layout (set by hand,
            // or of a param whose .data changed layout) is read through a copy, as the
            // engine's own l2_norm_any does.
            grads.push_back(g.is_contiguous() ? g : g.contiguous());
          }
        }
        if (grads.empty()) return Result{0, std::nullopt};  // no gradient: the caller's zero
        return Result{0, k::l2_norm(grads, found_inf)};
      },
      py::arg("plans"), py::arg("found_inf") = py::none(),
      py::arg("sources") = std::vector<std::shared_ptr<PlanSource>>{}, py::arg("outsiders") = py::tuple(),
      "(status, norm): l2_norm over the gradients of every plan's params (the clip shares the "
      "step's plan, [Note: the step plan]); found_inf: also set it when a gradient is inf/nan. "
      "norm is None when no planned param holds a gradient. status 3: a plan's `sources` "
      "changed; 4: one of `outsiders` (the clip's params the plans do not hold) has a "
      "gradient; nothing computed then.");
  m.def("merge_nonfinite_checks", &engines::merge_nonfinite_checks, py::arg("reducers"),
        py::arg("found_inf"),
        "OR every reducer's fresh agreed inf/nan flag into found_inf; False (nothing taken "
        "into account) when some reducer has none.");
  m.def("finish_reductions", &engines::finish_reductions, py::arg("cores"),
        py::call_guard<py::gil_scoped_release>(),
        "Finish every core's pending reductions, in order; which cores hold gradients.");
}

}  // namespace mixprec::bindings
