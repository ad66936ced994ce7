#include "precision/master_weights.h"

#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (torch 2.11/2.12 reach it no other way)
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

namespace mixprec::precision {

MasterWeights::MasterWeights(std::vector<at::Tensor> params) : params_(std::move(params)) {
  masters_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    TORCH_CHECK_VALUE(p.is_floating_point(), "parameter ", i, " has dtype ", p.scalar_type(),
                      "; fp32 masters are only made for floating-point parameters");
    auto master = p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    master.set_requires_grad(true);
    masters_.push_back(std::move(master));
  }
}

int64_t MasterWeights::fold_grads() {
  int64_t folded = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    const auto& g = p.grad();
    if (!g.defined()) continue;
    auto& m = masters_[i];
    auto mg = m.mutable_grad();
    if (mg.defined()) {
      mg.add_(g);
    } else {
      m.mutable_grad() = g.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    }
    p.mutable_grad() = at::Tensor();
    ++folded;
  }
  return folded;
}

void MasterWeights::write_back() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].copy_(masters_[i]);
  }
}

void MasterWeights::reload_from_params() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    masters_[i].copy_(params_[i]);
  }
}

std::vector<at::Tensor> MasterWeights::master_grads() const {
  std::vector<at::Tensor> out;
  out.reserve(masters_.size());
  for (const auto& m : masters_) out.push_back(m.grad());
  return out;
}

}  // namespace mixprec::precision
