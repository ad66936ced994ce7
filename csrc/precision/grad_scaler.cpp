#include "precision/grad_scaler.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace mixprec::precision {

namespace {

void check_options(const ScalerOptions& o) {
  TORCH_CHECK_VALUE(o.init_scale > 0 && std::isfinite(o.init_scale),
                    "init_scale must be a positive finite number, got ", o.init_scale);
  TORCH_CHECK_VALUE(o.growth_factor > 1.0, "growth_factor must be > 1, got ", o.growth_factor);
  TORCH_CHECK_VALUE(o.backoff_factor > 0.0 && o.backoff_factor < 1.0,
                    "backoff_factor must be in (0, 1), got ", o.backoff_factor);
  TORCH_CHECK_VALUE(o.growth_interval >= 1, "growth_interval must be >= 1, got ",
                    o.growth_interval);
  TORCH_CHECK_VALUE(o.hysteresis >= 1, "hysteresis must be >= 1, got ", o.hysteresis);
  TORCH_CHECK_VALUE(o.min_scale >= 0.0 && o.min_scale <= o.init_scale,
                    "min_scale must be in [0, init_scale=", o.init_scale, "], got ", o.min_scale);
  TORCH_CHECK_VALUE(o.max_scale >= o.init_scale, "max_scale must be >= init_scale=",
                    o.init_scale, ", got ", o.max_scale);
}

}  // namespace

GradScaler::GradScaler(const ScalerOptions& options, const at::Device& device)
    : options_(options) {
  check_options(options_);
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  auto i32 = at::TensorOptions().dtype(at::kInt).device(device);
  scale_ = at::full({1}, options_.init_scale, f32);
  growth_tracker_ = at::zeros({1}, i32);
  hysteresis_left_ = at::full({1}, options_.hysteresis, i32);
  found_inf_ = at::zeros({1}, f32);
}

at::Tensor GradScaler::scale_loss(const at::Tensor& loss) const {
  TORCH_CHECK_VALUE(loss.is_floating_point(), "can only scale a floating-point loss, got dtype ",
                    loss.scalar_type());
  TORCH_CHECK_VALUE(loss.device() == scale_.device(), "loss is on ", loss.device(),
                    " but the scaler lives on ", scale_.device(),
                    "; compute the loss on the model's device");
  return loss * scale_.squeeze(0);
}

at::Tensor GradScaler::inv_scale() const {
  return scale_.to(at::kDouble).reciprocal().to(at::kFloat);
}

double GradScaler::scale_value() const { return scale_.item<double>(); }

int64_t GradScaler::growth_tracker() const { return growth_tracker_.item<int64_t>(); }

int64_t GradScaler::hysteresis_left() const { return hysteresis_left_.item<int64_t>(); }

void GradScaler::load(double scale, int64_t growth_tracker, int64_t hysteresis_left) {
  TORCH_CHECK_VALUE(scale > 0 && std::isfinite(scale),
                    "loaded scale must be a positive finite number, got ", scale);
  TORCH_CHECK_VALUE(growth_tracker >= 0, "loaded growth tracker must be >= 0, got ",
                    growth_tracker);
  TORCH_CHECK_VALUE(hysteresis_left >= 1, "loaded hysteresis counter must be >= 1, got ",
                    hysteresis_left);
  scale_.fill_(scale);
  growth_tracker_.fill_(growth_tracker);
  hysteresis_left_.fill_(hysteresis_left);
  found_inf_.zero_();
}

void GradScaler::clear_found_inf() { found_inf_.zero_(); }

void GradScaler::update(bool tensor_ops) {
  if (scale_.is_cpu() && !tensor_ops) {
    update_on_host();
  } else {
    update_on_device();
  }
  found_inf_.zero_();
}

// The arithmetic is done in fp32 so the sequence of scales is bit-identical to
// torch's _amp_update_scale_ when hysteresis == 1 and there are no bounds.
void GradScaler::update_on_host() {
  float* scale = scale_.data_ptr<float>();
  int32_t* tracker = growth_tracker_.data_ptr<int32_t>();
  int32_t* hyst = hysteresis_left_.data_ptr<int32_t>();
  const bool overflow = found_inf_.data_ptr<float>()[0] != 0.0f;
  if (overflow) {
    if (*hyst > 1) {
      *hyst -= 1;
    } else {
      float next = *scale * static_cast<float>(options_.backoff_factor);
      *scale = std::max(next, static_cast<float>(options_.min_scale));
      *hyst = static_cast<int32_t>(options_.hysteresis);
    }
    *tracker = 0;
    return;
  }
  const int32_t clean = *tracker + 1;
  if (clean >= options_.growth_interval) {
    float next = *scale * static_cast<float>(options_.growth_factor);
    if (std::isfinite(next)) {
      *scale = std::min(next, static_cast<float>(options_.max_scale));
    }
    *tracker = 0;
    *hyst = static_cast<int32_t>(options_.hysteresis);
  } else {
    *tracker = clean;
  }
}

void GradScaler::update_on_device() {
  const auto overflow = found_inf_.ne(0);
  const auto tolerate = overflow.logical_and(hysteresis_left_.gt(1));
  const auto backoff = overflow.logical_and(tolerate.logical_not());
  const auto clean = growth_tracker_ + 1;
  const auto grow = overflow.logical_not().logical_and(clean.ge(options_.growth_interval));

  auto backed = (scale_ * options_.backoff_factor).clamp_min(options_.min_scale);
  auto grown = scale_ * options_.growth_factor;
  grown = at::where(grown.isfinite(), grown.clamp_max(options_.max_scale), scale_);
  auto new_scale = at::where(backoff, backed, at::where(grow, grown, scale_));

  auto zero = at::zeros_like(growth_tracker_);
  auto new_tracker = at::where(overflow.logical_or(grow), zero, clean.to(at::kInt));
  auto full_hyst = at::full_like(hysteresis_left_, options_.hysteresis);
  auto new_hyst = at::where(tolerate, hysteresis_left_ - 1,
                            at::where(backoff.logical_or(grow), full_hyst, hysteresis_left_));
  scale_.copy_(new_scale);
  growth_tracker_.copy_(new_tracker);
  hysteresis_left_.copy_(new_hyst);
}

}  // namespace mixprec::precision
