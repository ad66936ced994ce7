// Bindings for csrc/engines/sharded (the sharding core and the ZeRO policies).
#include "bindings/bindings.h"
#include "engines/sharded/core.h"
#include "engines/sharded/zero.h"

namespace py = pybind11;

namespace mixprec::bindings {

void init_sharded(py::module_& m) {
  using engines::sharded::CoreOptions;
  using engines::sharded::ShardedCore;

  py::class_<CoreOptions>(m, "ShardOptions")
      .def(py::init([](int64_t stage, int64_t bucket_cap_bytes, int64_t first_bucket_cap_bytes,
                       const std::string& collective, const std::string& group_name,
                       int64_t max_inflight_buckets, at::ScalarType reduce_dtype) {
             TORCH_CHECK_VALUE(reduce_dtype == at::kFloat || reduce_dtype == at::kBFloat16 ||
                                   reduce_dtype == at::kHalf,
                               "reduce_dtype must be torch.float32, torch.bfloat16 or "
                               "torch.float16, got ", reduce_dtype);
             auto o = engines::sharded::zero_options(stage, bucket_cap_bytes,
                                                     first_bucket_cap_bytes, collective,
                                                     group_name, max_inflight_buckets);
             o.reduce_dtype = reduce_dtype;
             return o;
           }),
           py::kw_only(), py::arg("stage"), py::arg("bucket_cap_bytes") = 25 * 1024 * 1024,
           py::arg("first_bucket_cap_bytes") = 1024 * 1024, py::arg("collective") = "auto",
           py::arg("group_name"), py::arg("max_inflight_buckets") = 2,
           py::arg("reduce_dtype") = at::kFloat)
      .def_readonly("reduce_dtype", &CoreOptions::reduce_dtype)
      .def_readonly("reduce_in_backward", &CoreOptions::reduce_in_backward)
      .def_readonly("free_grad_buckets", &CoreOptions::free_grad_buckets)
      .def_readonly("shard_params", &CoreOptions::shard_params)
      .def_readonly("reshard_after_backward", &CoreOptions::reshard_after_backward)
      .def_readonly("max_inflight_buckets", &CoreOptions::max_inflight_buckets)
      .def_property_readonly("collective", [](const CoreOptions& o) {
        return o.collective == engines::sharded::Collective::kAllReduce ? "allreduce"
                                                                        : "reduce_scatter";
      });

  // Test seam (tests/test_gpu_paths.py, issue 23 G8): set_storage_bytes on a fake device.
  m.def(
      "_probe_storage_allocation_device",
      [](int64_t index) {
        const auto r = engines::sharded::probe_storage_allocation_device(index);
        py::dict out;
        out["tensor_index"] = r.tensor_index;
        out["allocated_on"] = r.allocated_on;
        out["current_before"] = r.current_before;
        out["current_after"] = r.current_after;
        return out;
      },
      py::arg("index"));

  py::class_<ShardedCore>(m, "ShardedCore")
      .def(py::init<std::vector<at::Tensor>, std::vector<std::string>,
                    std::vector<at::ScalarType>, const std::string&, const CoreOptions&>(),
           py::arg("params"), py::arg("names"), py::arg("storage_dtypes"), py::arg("group_name"),
           py::arg("options"))
      .def("set_sync", &ShardedCore::set_sync, py::arg("sync"))
      .def_property_readonly("sync", &ShardedCore::sync)
      .def("reduce", &ShardedCore::reduce, py::call_guard<py::gil_scoped_release>())
      .def("zero_grad", &ShardedCore::zero_grad, py::arg("release") = false)
      .def("grad_shard_bytes", &ShardedCore::grad_shard_bytes)
      .def("ensure_grad_shard", &ShardedCore::ensure_grad_shard)
      .def("has_grads", &ShardedCore::has_grads)
      .def("set_launch_from_hooks", &ShardedCore::set_launch_from_hooks, py::arg("on"))
      .def_property_readonly("launch_from_hooks", &ShardedCore::launch_from_hooks)
      .def("launch_all", &ShardedCore::launch_all, py::call_guard<py::gil_scoped_release>())
      .def("end_backward", &ShardedCore::end_backward, py::call_guard<py::gil_scoped_release>())
      .def("share_backward_count", &ShardedCore::share_backward_count, py::arg("other"))
      .def("gather_params", &ShardedCore::gather_params, py::call_guard<py::gil_scoped_release>())
      .def("unshard", &ShardedCore::unshard, py::arg("async_op") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("wait_unshard", &ShardedCore::wait_unshard, py::call_guard<py::gil_scoped_release>())
      .def("reshard", &ShardedCore::reshard, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("unsharded", &ShardedCore::unsharded)
      .def("param_buffer_bytes", &ShardedCore::param_buffer_bytes)
      .def("full_masters", &ShardedCore::full_masters, py::call_guard<py::gil_scoped_release>())
      .def(
          "gather_master",
          [](ShardedCore& c, int64_t index, int64_t dst) -> std::optional<at::Tensor> {
            auto t = c.gather_master(index, dst);
            if (!t.defined()) return std::nullopt;
            return t;
          },
          py::arg("index"), py::arg("dst") = -1, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("params", &ShardedCore::params)
      .def_property_readonly("master_shard", &ShardedCore::master_shard)
      .def_property_readonly("grad_shard", &ShardedCore::grad_shard)
      .def("owned_ranges", &ShardedCore::owned_ranges)
      .def("partition_map",
           [](const ShardedCore& c) {
             py::dict out;
             const auto& layout = c.layout();
             for (size_t i = 0; i < layout.params().size(); ++i) {
               const auto& p = layout.params()[i];
               const auto& bucket = layout.buckets()[layout.bucket_of(i)];
               out[py::str(p.name)] = py::make_tuple(bucket.global_offset + layout.offset_of(i),
                                                     p.numel, py::tuple(py::cast(p.shape)));
             }
             return out;
           })
      .def("bucket_shards",
           [](const ShardedCore& c) {
             std::vector<std::pair<int64_t, int64_t>> out;
             for (const auto& b : c.layout().buckets()) out.emplace_back(b.shard_offset, b.shard);
             return out;
           })
      .def("bucket_indices",
           [](const ShardedCore& c) {
             std::vector<std::vector<int64_t>> out;
             for (const auto& b : c.layout().buckets()) out.emplace_back(b.params.begin(), b.params.end());
             return out;
           })
      .def_property_readonly("world_size", [](const ShardedCore& c) { return c.layout().world_size(); })
      .def_property_readonly("rank", [](const ShardedCore& c) { return c.layout().rank(); })
      .def_property_readonly("shard_numel", [](const ShardedCore& c) { return c.layout().shard_numel(); })
      .def_property_readonly("padded_numel", [](const ShardedCore& c) { return c.layout().padded_numel(); })
      .def_property_readonly("param_numel", [](const ShardedCore& c) { return c.layout().param_numel(); })
      .def("bytes_reduced_last", &ShardedCore::bytes_reduced_last)
      .def("bytes_gathered_last", &ShardedCore::bytes_gathered_last)
      .def("grad_bucket_bytes", &ShardedCore::grad_bucket_bytes)
      .def("grad_bucket_peak_bytes", &ShardedCore::grad_bucket_peak_bytes)
      .def("reset_grad_bucket_peak", &ShardedCore::reset_grad_bucket_peak)
      .def("inflight_buckets", &ShardedCore::inflight_buckets)
      .def("comm_counters",
           [](const ShardedCore& c) {
             const auto k = c.comm_counters();
             py::dict out;
             out["bytes_reduced"] = k.bytes_reduced;
             out["elements_reduced"] = k.elements_reduced;
             out["reductions"] = k.reductions;
             out["bytes_gathered"] = k.bytes_gathered;
             out["elements_gathered"] = k.elements_gathered;
             out["gathers"] = k.gathers;
             return out;
           })
      .def("reset_comm_counters", &ShardedCore::reset_comm_counters);
}

}  // namespace mixprec::bindings
