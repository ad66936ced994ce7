// fp32 master copies for low-precision (bf16/fp16) trainable parameters.
//
// [Note: where master gradients come from]
// Autograd accumulates into the low-precision parameter's .grad during one
// backward. After every backward (and once more before the optimizer step, for
// a caller who ran loss.backward() themselves) fold_grads() adds each
// low-precision .grad into the fp32 master's .grad and drops it, so
// accumulation across micro-batches is in fp32 and the low-precision grads
// never reach the optimizer.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace mixprec::precision {

class MasterWeights {
 public:
  // `params` are the model's low-precision leaf parameters; masters are fp32
  // clones created here (detached, requires_grad so optimizers accept them).
  explicit MasterWeights(std::vector<at::Tensor> params);

  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<at::Tensor>& masters() const { return masters_; }

  // Move pending low-precision grads into the fp32 master grads; returns how many were folded.
  int64_t fold_grads();
  // Refresh every low-precision parameter from its master (round to nearest even).
  void write_back();
  // Re-read the masters from the parameters (after the user loaded weights into the model).
  void reload_from_params();
  // Master grads the optimizer will consume (undefined tensors for params without grad).
  std::vector<at::Tensor> master_grads() const;

 private:
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> masters_;
};

}  // namespace mixprec::precision
