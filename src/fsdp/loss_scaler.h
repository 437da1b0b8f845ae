// Dynamic loss scaling (MixedPrecision::dynamic_loss_scale): the scale the model multiplies
// its loss gradient by, backed off when the gradients overflow and grown after a run of good
// steps; and the count of skipped steps (which the inf/NaN policy's skips also add to).
#pragma once

#include <cstdint>

#include "fsdp/sharding.h"

namespace fsdp::internal {

class LossScaler {
 public:
  void Init(const MixedPrecision& mp) {
    mp_ = mp;
    scale_ = mp.dynamic_loss_scale ? mp.initial_loss_scale : 1.0f;
  }
  bool enabled() const { return mp_.dynamic_loss_scale; }
  float scale() const { return scale_; }
  int good_steps() const { return good_steps_; }
  int64_t skipped_steps() const { return skipped_; }

  // A step was skipped for inf/NaN gradients: with scaling on, the scale backs off.
  void OnSkipped() {
    ++skipped_;
    if (!enabled()) return;
    good_steps_ = 0;
    scale_ *= mp_.backoff_factor;
  }
  // A step was taken: after growth_interval of them in a row, the scale grows.
  void OnGoodStep() {
    if (!enabled() || ++good_steps_ < mp_.growth_interval) return;
    scale_ *= mp_.growth_factor;
    good_steps_ = 0;
  }
  // Restoring a checkpoint.
  void Restore(float scale, int good_steps, int64_t skipped) {
    scale_ = scale;
    good_steps_ = good_steps;
    skipped_ = skipped;
  }

 private:
  MixedPrecision mp_;
  float scale_ = 1.0f;
  int good_steps_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace fsdp::internal
