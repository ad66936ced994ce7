// Dynamic loss scaling: one implementation for every backend.
//
// [Note: scaler state lives in device tensors]
// The scale, growth tracker, hysteresis counter and found_inf flag are 1-element
// tensors on the training device. Kernels that already read the gradients write
// found_inf; update() reads it. On CPU the update is plain host arithmetic on
// those tensors (reading them costs nothing); on an accelerator it is a few
// element-wise ops so no host round-trip is needed. Sharded engines all-reduce
// found_inf (MAX) over the group before calling update(), so every rank takes
// the same decision (see [Note: why found_inf is all-reduced] in the engines).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

namespace mixprec::precision {

struct ScalerOptions {
  double init_scale = 65536.0;      // 2^16, as torch.amp.GradScaler and DeepSpeed
  double growth_factor = 2.0;       // multiply after growth_interval clean steps
  double backoff_factor = 0.5;      // multiply on overflow
  int64_t growth_interval = 2000;   // clean steps between growths
  int64_t hysteresis = 1;           // overflows tolerated before backing off (DeepSpeed's delayed shift)
  double min_scale = 0.0;           // the scale never goes below this (0: no floor)
  double max_scale = std::numeric_limits<double>::infinity();
};

class GradScaler {
 public:
  GradScaler(const ScalerOptions& options, const at::Device& device);

  // loss * scale, in the loss's dtype (the multiply happens in fp32 as torch does).
  at::Tensor scale_loss(const at::Tensor& loss) const;
  // 1/scale computed in double and rounded to fp32, bit-identical to torch.amp.GradScaler.
  at::Tensor inv_scale() const;
  // Flag tensor that unscale/norm kernels OR non-finite findings into (1.0 = found).
  const at::Tensor& found_inf() const { return found_inf_; }
  const at::Tensor& scale() const { return scale_; }
  double scale_value() const;

  // Apply the step outcome held in found_inf() to the scale, then clear found_inf.
  // `tensor_ops` forces the accelerator code path on any device (tests use it to
  // prove the two paths agree).
  void update(bool tensor_ops = false);
  // Reset found_inf without touching the scale (a step that was abandoned).
  void clear_found_inf();

  const ScalerOptions& options() const { return options_; }
  int64_t growth_tracker() const;
  int64_t hysteresis_left() const;
  void load(double scale, int64_t growth_tracker, int64_t hysteresis_left);

 private:
  void update_on_host();
  void update_on_device();

  ScalerOptions options_;
  at::Tensor scale_;            // fp32 [1]
  at::Tensor growth_tracker_;   // int32 [1]: consecutive clean steps since last change
  at::Tensor hysteresis_left_;  // int32 [1]: overflows still tolerated before backoff
  at::Tensor found_inf_;        // fp32 [1]: > 0 when this step saw a non-finite value
};

}  // namespace mixprec::precision
