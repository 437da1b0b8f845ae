// Optimizers over one flat f32 buffer (a unit, or a rank's shard of a unit), updated in place
// through a backend's op table, with their state (AdamW m and v, SGD momentum) of the same
// shape on the same backend. Learning-rate schedules and the gradient-clipping coefficient.
//
// Nothing here knows about models: which elements get weight decay is given as element ranges
// of the flat buffer, because a shard may start and end in the middle of a tensor.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/status.h"

namespace fsdp {

// Elements [begin, end) of a flat buffer, with or without weight decay.
struct DecayRange {
  int64_t begin = 0;
  int64_t end = 0;
  bool weight_decay = false;
};

// The ranges of `ranges` (offsets in a whole unit) that fall inside [lo, hi), clipped to it
// and rebased so that lo becomes 0: the ranges of a shard that holds elements [lo, hi).
std::vector<DecayRange> SliceDecayRanges(const std::vector<DecayRange>& ranges, int64_t lo,
                                         int64_t hi);

// One optimizer state tensor, named as PyTorch names it ("exp_avg", "momentum_buffer", ...).
struct OptimizerState {
  std::string_view name;
  View data;         // numel() f32 elements on the optimizer's backend
  size_t bytes = 0;  // what the allocation holding `data` takes on the backend
};

// Updates one flat buffer of numel() elements. Elements outside every DecayRange are never
// touched (the padding at the end of a shard). The step count starts at 0 and Step() first
// increments it, so the first update is step 1, as in PyTorch.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // param and grad: numel() f32 elements on the optimizer's backend; the update is issued on
  // the compute stream.
  virtual absl::Status Step(View param, View grad) = 0;
  virtual std::vector<OptimizerState> state() = 0;

  int64_t numel() const { return numel_; }
  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }  // when restoring a checkpoint
  float lr() const { return lr_; }
  void set_lr(float lr) { lr_ = lr; }  // set by the schedule before each Step()

 protected:
  Optimizer(Backend* backend, int64_t numel, std::vector<DecayRange> ranges, float lr)
      : backend_(backend), numel_(numel), ranges_(std::move(ranges)), lr_(lr) {}
  static absl::Status ValidateRanges(const std::vector<DecayRange>& ranges, int64_t numel);
  absl::Status CheckViews(const View& param, const View& grad) const;

  Backend* backend_;
  int64_t numel_;
  std::vector<DecayRange> ranges_;  // sorted, disjoint, neighbours with equal flags merged
  float lr_;
  int64_t step_ = 0;
};

// PyTorch torch.optim.AdamW, with the defaults of MODEL_SPEC.md.
struct AdamWOptions {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // applied to the elements of ranges with weight_decay = true
};

class AdamW final : public Optimizer {
 public:
  // m and v are allocated on `backend` and zeroed.
  static absl::StatusOr<std::unique_ptr<AdamW>> Create(Backend* backend, int64_t numel,
                                                       std::vector<DecayRange> ranges,
                                                       AdamWOptions options = {});
  absl::Status Step(View param, View grad) override;
  std::vector<OptimizerState> state() override;
  const AdamWOptions& options() const { return options_; }

 private:
  AdamW(Backend* backend, int64_t numel, std::vector<DecayRange> ranges, AdamWOptions options)
      : Optimizer(backend, numel, std::move(ranges), options.lr), options_(options) {}
  AdamWOptions options_;
  Buffer m_, v_;
};

// PyTorch torch.optim.SGD.
struct SgdOptions {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;  // applied to the elements of ranges with weight_decay = true
  bool nesterov = false;      // needs momentum > 0 and dampening == 0
};

class Sgd final : public Optimizer {
 public:
  // The momentum buffer is allocated only when momentum != 0.
  static absl::StatusOr<std::unique_ptr<Sgd>> Create(Backend* backend, int64_t numel,
                                                     std::vector<DecayRange> ranges,
                                                     SgdOptions options = {});
  absl::Status Step(View param, View grad) override;
  std::vector<OptimizerState> state() override;
  const SgdOptions& options() const { return options_; }

 private:
  Sgd(Backend* backend, int64_t numel, std::vector<DecayRange> ranges, SgdOptions options)
      : Optimizer(backend, numel, std::move(ranges), options.lr), options_(options) {}
  SgdOptions options_;
  Buffer momentum_;
};

// Learning rate as a function of the 0-based step index (the step about to be taken).
class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  virtual float At(int64_t step) const = 0;
};

class ConstantLr final : public LrSchedule {
 public:
  explicit ConstantLr(float lr) : lr_(lr) {}
  float At(int64_t) const override { return lr_; }

 private:
  float lr_;
};

// nanoGPT / llm.c shape: lr = max_lr * (step + 1) / warmup_steps for step < warmup_steps,
// then a half cosine from max_lr down to min_lr at total_steps, and min_lr after that.
class WarmupCosine final : public LrSchedule {
 public:
  WarmupCosine(int64_t warmup_steps, int64_t total_steps, float max_lr, float min_lr)
      : warmup_steps_(warmup_steps), total_steps_(total_steps), max_lr_(max_lr),
        min_lr_(min_lr) {}
  float At(int64_t step) const override;

 private:
  int64_t warmup_steps_, total_steps_;
  float max_lr_, min_lr_;
};

}  // namespace fsdp
