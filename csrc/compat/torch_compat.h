// The differences between the torch releases mixprec builds against, in one place.
//
// Supported: torch 2.11, 2.12 and 2.13 (pyproject.toml). 2.13 is built and tested in CI;
// 2.11 and 2.12 (and 2.14 when its wheel is at hand) are compile-checked against their
// headers by .ci/torch_headers_check.sh. Each shim says which releases need it; when the
// oldest supported release moves past it, delete the shim and call torch directly.
//
// Kept light on purpose (every translation unit of the engines includes it): only
// torch's version macros and c10's intrusive_ptr; torch types are forward-declared and
// the wrappers are templates, so the caller's own includes supply the definitions.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/headeronly/version.h>  // TORCH_VERSION_MAJOR / _MINOR (torch >= 2.11)

#include <memory>

// True when the torch compiled against is release major.minor or newer.
#define MIXPREC_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||          \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !MIXPREC_TORCH_AT_LEAST(2, 11)
#error "mixprec needs torch >= 2.11 (see pyproject.toml); upgrade torch, then rebuild with pip install --no-build-isolation ."
#endif

namespace at {
class Tensor;
}  // namespace at
namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace mixprec::compat {

// The handle torch::autograd::impl::grad_accumulator() returns (what add_post_hook /
// del_post_hook are called on): std::shared_ptr<Node> in 2.11 and 2.12,
// c10::intrusive_ptr<Node> from 2.13.
#if MIXPREC_TORCH_AT_LEAST(2, 13)
using NodePtr = c10::intrusive_ptr<torch::autograd::Node>;
#else
using NodePtr = std::shared_ptr<torch::autograd::Node>;
#endif

// c10d::ProcessGroup's single-tensor collectives: 2.11 and 2.12 name them
// _allgather_base / _reduce_scatter_base; 2.13 renamed them all_gather_single /
// reduce_scatter_single and deprecated the old names. `Group` is c10d::ProcessGroup (a
// template so that this header needs no c10d include); same arguments and results.
template <class Group, class Options>
auto all_gather_single(Group& group, at::Tensor& output, at::Tensor& input,
                       const Options& options) {
#if MIXPREC_TORCH_AT_LEAST(2, 13)
  return group.all_gather_single(output, input, options);
#else
  return group._allgather_base(output, input, options);
#endif
}

template <class Group, class Options>
auto reduce_scatter_single(Group& group, at::Tensor& output, at::Tensor& input,
                           const Options& options) {
#if MIXPREC_TORCH_AT_LEAST(2, 13)
  return group.reduce_scatter_single(output, input, options);
#else
  return group._reduce_scatter_base(output, input, options);
#endif
}

}  // namespace mixprec::compat
