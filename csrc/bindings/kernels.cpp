// Bindings for csrc/kernels (multi-tensor kernels). Python signatures are
// the contract with mixprec.kernels and the Accelerator: keep them stable.
#include "bindings/bindings.h"
#include "kernels/cpu/items.h"
#include "kernels/multi_tensor.h"

namespace py = pybind11;

namespace mixprec::bindings {

void init_kernels(py::module_& m) {
  namespace k = mixprec::kernels;
  // The kernels release the GIL: they never touch Python objects.
  const auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("unscale_and_check_", &k::unscale_and_check_, py::arg("tensors"), py::arg("found_inf"),
        py::arg("inv_scale"), nogil,
        "Multiply every tensor in place by inv_scale; set found_inf to 1.0 if any "
        "element was inf/nan. Same results as torch._amp_foreach_non_finite_check_and_unscale_.");
  m.def("scale_copy_and_check_", &k::scale_copy_and_check_, py::arg("dsts"), py::arg("srcs"),
        py::arg("found_inf"), py::arg("scale"), nogil,
        "dsts[i] = srcs[i] * scale (same dtypes, in place allowed) in one pass; set found_inf "
        "to 1.0 if any source element was inf/nan.");
  m.def("l2_norm", &k::l2_norm, py::arg("tensors"), py::arg("found_inf") = py::none(), nogil,
        "Global L2 norm of all elements (fp32 0-dim tensor, fp32 accumulation per chunk); "
        "sets found_inf to 1.0 when the norm is not finite.");
  m.def(
      "fused_adam_",
      [](const k::TensorVec& params, const k::TensorVec& grads, const k::TensorVec& exp_avgs,
         const k::TensorVec& exp_avg_sqs, const k::TensorVec& lowp_params, double lr,
         double beta1, double beta2, double eps, double weight_decay, double step, bool decoupled,
         bool maximize, const k::OptTensor& inv_scale, const k::OptTensor& found_inf,
         const k::TensorVec& steps) {
        k::fused_adam_(params, grads, exp_avgs, exp_avg_sqs, lowp_params,
                       k::AdamOptions{lr, beta1, beta2, eps, weight_decay, step, decoupled,
                                      maximize},
                       inv_scale, found_inf, steps);
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
      py::arg("lowp_params"), py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
      py::arg("eps"), py::arg("weight_decay"), py::arg("step") = 0.0, py::arg("decoupled"),
      py::arg("maximize"), py::arg("inv_scale") = py::none(), py::arg("found_inf") = py::none(),
      py::arg("steps") = k::TensorVec{}, nogil,
      "One Adam (decoupled=False) or AdamW step over all tensors; `step` is the already "
      "incremented step count, or `steps` gives one fp32 1-element counter per param that "
      "the op increments itself (not when skipped). Does nothing when found_inf is nonzero.");
  m.def("_advance_step_counters_", &k::advance_step_counters_, py::arg("steps"),
        py::arg("found_inf") = py::none(), nogil,
        "Add 1 to every fp32 step counter, or 0 when found_inf is nonzero, on their device "
        "(fused_adam_'s counter update on CUDA; exposed for tests).");
  m.def(
      "fused_sgd_",
      [](const k::TensorVec& params, const k::TensorVec& grads,
         const k::TensorVec& momentum_buffers, const k::TensorVec& lowp_params, double lr,
         double momentum, double dampening, bool nesterov, double weight_decay, bool maximize,
         bool first_step, const k::OptTensor& inv_scale, const k::OptTensor& found_inf) {
        k::fused_sgd_(params, grads, momentum_buffers, lowp_params,
                      k::SgdOptions{lr, momentum, dampening, weight_decay, nesterov, maximize,
                                    first_step},
                      inv_scale, found_inf);
      },
      py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::arg("lowp_params"),
      py::kw_only(), py::arg("lr"), py::arg("momentum"), py::arg("dampening"),
      py::arg("nesterov"), py::arg("weight_decay"), py::arg("maximize"), py::arg("first_step"),
      py::arg("inv_scale") = py::none(), py::arg("found_inf") = py::none(), nogil,
      "One SGD step (torch.optim.SGD semantics); momentum buffers are set to the grad when "
      "first_step. Does nothing when found_inf is nonzero.");
  m.def("copy_cast_", &k::copy_cast_, py::arg("dsts"), py::arg("srcs"), nogil,
        "dsts[i].copy_(srcs[i]) for all i in one pass (round to nearest-even).");
  m.def("flat_copy_in_", &k::flat_copy_in_, py::arg("flat"), py::arg("srcs"), nogil,
        "Pack srcs back to back into the 1-D buffer flat, casting to its dtype.");
  m.def("flat_copy_out_", &k::flat_copy_out_, py::arg("dsts"), py::arg("flat"), nogil,
        "Split the 1-D buffer flat into dsts, casting to their dtypes.");
  m.attr("_cpu_parallel_min_bytes") = k::cpu_parallel_min_bytes();
  m.def("_cpu_parallel_regions", &k::cpu_parallel_regions,
        "How many parallel regions the CPU kernels have opened in this process; a call "
        "moving fewer than _cpu_parallel_min_bytes bytes runs inline and opens none "
        "(diagnostics, tests).");
  m.def(
      "cpu_kernel_capability", [] { return std::string(k::cpu::item_fns().capability); },
      "The copy of the CPU kernels this process runs: 'DEFAULT', 'AVX2' or 'AVX512' (the widest "
      "the build and the CPU have, capped by MIXPREC_CPU_CAPABILITY; chosen once per process).");
}

}  // namespace mixprec::bindings
