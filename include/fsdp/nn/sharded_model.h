// A bundled model (the GPT of gpt.h or the Llama of llama.h) trained with sharding: its staged
// forward/backward driven through the per-unit hooks of the sharding runtime (sharding.h),
// exactly as a framework would drive its own model.
//
// A wrap policy decides the units. Modules are the root (embeddings, final norm, head) and the
// blocks (transformer.h.{i} of the GPT, model.layers.{i} of Llama); a unit is a run of
// consecutive blocks, and the root unit holds the root tensors plus every block that no other
// unit took.
//
// The model computes in the sharding options' mixed_precision.param_dtype (its Linear layers
// in bf16/f16 with f32 accumulation), and multiplies its loss gradient by the runtime's
// loss_scale() (dynamic loss scaling for f16).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/communicator.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/sharding.h"

namespace fsdp::nn {

struct WrapPolicy {
  enum class Kind {
    kPerBlock,   // one unit per block, plus the root unit (the default)
    kMinParams,  // consecutive blocks grouped until a unit holds >= min_params parameters
    kExplicit,   // one unit per listed block ("transformer.h.3", "model.layers.3"); the rest
                 // join the root unit
  };
  Kind kind = Kind::kPerBlock;
  int64_t min_params = 0;
  std::vector<std::string> modules;
};

struct ShardedModelOptions {
  ShardingOptions sharding;
  WrapPolicy wrap;
  int batch_size = 8;  // B, sequences per rank and micro-batch
  int seq_len = 64;    // T
  uint64_t seed = 1337;
  // Names of parameters to freeze (no gradient, never updated), e.g. for LoRA-style tuning.
  std::vector<std::string> frozen;
  // Activation checkpointing: block i keeps only its input in forward and is recomputed in
  // backward (after its unit is gathered again) when checkpoint_blocks[i] is true, or, with
  // checkpoint_blocks empty, when checkpoint_every > 0 and i % checkpoint_every == 0.
  std::vector<bool> checkpoint_blocks;
  int checkpoint_every = 0;
};

class ShardedModel {
 public:
  // Collective over `world` (which must outlive the model).
  static absl::StatusOr<std::unique_ptr<ShardedModel>> Create(const ModelConfig& config,
                                                              Backend* backend,
                                                              Communicator& world,
                                                              ShardedModelOptions options);
  ~ShardedModel();

  // One micro-batch on this rank: forward, loss, backward (B x T host token ids). Returns this
  // rank's mean loss. With runtime().set_sync_gradients(false) the gradients accumulate
  // locally without communication (no_sync).
  absl::StatusOr<float> ForwardBackward(const int32_t* inputs, const int32_t* targets);
  // ForwardBackward in two calls, for a caller that reads the loss or measures each pass (the
  // collectives it issued, its memory peak) in between, where nothing else may run on the
  // runtime: the forward of a training micro-batch, which leaves the units as its backward
  // needs them, then that backward. Backward() without a TrainForward() before it is
  // FailedPrecondition (and leaves the runtime usable).
  absl::StatusOr<float> TrainForward(const int32_t* inputs, const int32_t* targets);
  absl::Status Backward();
  // Forward only: this rank's mean loss (targets given) or just the logits (targets nullptr).
  absl::StatusOr<float> Forward(const int32_t* inputs, const int32_t* targets);
  // Clip, optimizer step on the local shards.
  absl::StatusOr<StepStats> Step(float lr);
  // Collective over the world: the mean of `value` over all ranks.
  absl::StatusOr<float> MeanOverRanks(float value);
  // Collective: every parameter's full value, in ParamSpecs order (unit by unit, as the
  // model's own flat buffers: unit u of the model is params[u]). For tests and export.
  absl::StatusOr<std::vector<std::vector<float>>> GatherModelUnits();
  // Collective, between the backward pass and Step(): every parameter's gradient as Step()
  // will use it before clipping (ShardingRuntime::GatherUnitGradient), laid out as
  // GatherModelUnits().
  absl::StatusOr<std::vector<std::vector<float>>> GatherModelGradients();

  View logits() const { return model_->logits(); }  // [B, T, V] f32 after a forward
  StagedModel& model() { return *model_; }
  const ModelConfig& config() const { return config_; }
  ShardingRuntime& runtime() { return *runtime_; }
  // Which runtime unit holds each model unit (0 = root, 1 + i = block i).
  const std::vector<int>& module_unit() const { return module_unit_; }
  MemoryReport memory() const { return runtime_->memory(); }

 private:
  ShardedModel() = default;
  absl::Status CopyTokens(const int32_t* inputs, const int32_t* targets);
  absl::StatusOr<float> RunForward(bool with_targets);
  absl::StatusOr<std::vector<std::vector<float>>> GatherModel(bool gradients);
  absl::Status RunBackward();

  ModelConfig config_;
  Backend* backend_ = nullptr;
  std::unique_ptr<StagedModel> model_;
  std::unique_ptr<ShardingRuntime> runtime_;
  std::vector<int> module_unit_;        // runtime unit of each model unit
  std::vector<int64_t> module_offset_;  // element offset of each model unit in its runtime unit
  std::vector<int> first_block_, last_block_;  // per runtime unit: its block range (-1: none)
  Buffer inputs_, targets_;
  bool backward_due_ = false;  // a TrainForward() awaits its Backward()
};

// The names the GPT-only API had.
using ShardedGpt = ShardedModel;
using ShardedGptOptions = ShardedModelOptions;

}  // namespace fsdp::nn
