// StagedModel: the argument and stage-order checks and the whole-model passes that every
// bundled model shares; the families supply the Run* stages.
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/nn/model.h"
#include "fsdp/ops.h"

namespace fsdp::nn {

StagedModel::StagedModel(const char* family, Backend* backend, int B, int T, int L, int V,
                         std::vector<ParamSpec> specs, ModelOptions options)
    : backend_(backend),
      B_(B),
      T_(T),
      family_(family),
      L_(L),
      V_(V),
      specs_(std::move(specs)),
      options_(std::move(options)) {}

StagedModel::~StagedModel() = default;

absl::Status StagedModel::CheckCreate(const char* family, Backend* backend, int B, int T,
                                      int block_size, int L, const ModelOptions& options) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(family, "::Create: backend is null"));
  }
  // The layers this family runs, which the backend must have (Ops::supports_op).
  const bool gpt = std::string_view(family) == "Gpt";
  const std::vector<ModelOp> needed =
      gpt ? std::vector<ModelOp>{ModelOp::kMatmul, ModelOp::kLayernorm, ModelOp::kGelu,
                                 ModelOp::kAttention, ModelOp::kSoftmaxCrossEntropy,
                                 ModelOp::kEmbedding, ModelOp::kElementwise}
          : std::vector<ModelOp>{ModelOp::kMatmul, ModelOp::kRmsnorm, ModelOp::kRope,
                                 ModelOp::kSwiglu, ModelOp::kGqaAttention,
                                 ModelOp::kSoftmaxCrossEntropy, ModelOp::kEmbedding,
                                 ModelOp::kElementwise};
  const Ops* ops = backend->model_ops();
  if (ops == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        family, "::Create: the ", std::string(backend->name()),
        " backend is runtime-only (it has the runtime's ops, not the layers of the bundled "
        "models); train a model of your own through the sharding runtime's hooks, or use a "
        "backend with model ops (cpu, sim, pjrt, cuda)"));
  }
  for (ModelOp op : needed) {
    if (!ops->supports_op(op)) {
      return absl::FailedPreconditionError(absl::StrCat(
          family, "::Create: the ", std::string(backend->name()), " backend does not support ",
          std::string(ModelOpName(op)), ", which the model needs"));
    }
  }
  if (B <= 0 || T <= 0 || T > block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(family, "::Create: need B >= 1 and 1 <= T <= block_size (", block_size,
                     "), got B=", B, " T=", T));
  }
  const DType d = options.compute_dtype;
  if (d != DType::kF32 && d != DType::kBF16 && d != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat(family, "::Create: compute_dtype ",
                                                   static_cast<int>(d),
                                                   " is not f32, bf16 or f16"));
  }
  const size_t n = options.checkpoint_layers.size();
  if (n != 0 && n != static_cast<size_t>(L)) {
    return absl::InvalidArgumentError(
        absl::StrCat(family, "::Create: checkpoint_layers has ", n,
                     " flags; give none or one per layer (", L, ")"));
  }
  return absl::OkStatus();
}

std::vector<const ParamSpec*> StagedModel::unit_params(int unit) const {
  std::vector<const ParamSpec*> out;
  for (const ParamSpec& s : specs_) {
    if (s.unit == unit) out.push_back(&s);
  }
  return out;
}

int64_t StagedModel::unit_numel(int unit) const {
  int64_t n = 0;
  for (const ParamSpec& s : specs_) {
    if (s.unit == unit) n += s.numel;
  }
  return n;
}

bool StagedModel::layer_checkpointed(int i) const {
  return i >= 0 && static_cast<size_t>(i) < options_.checkpoint_layers.size() &&
         options_.checkpoint_layers[i];
}

View StagedModel::ParamF32(View p, int64_t slot) const {
  if (p.dtype == DType::kF32) return p;
  const View out = params32_.Slice(slot, p.count);
  backend_->ops().Cast(Stream::kCompute, out, p);
  return out;
}

void StagedModel::KeepRounded(const Buffer& kept, View v32, bool reread) const {
  const DType cd = compute_dtype();
  if (cd == DType::kF32) return;
  const View low = kept.view(cd).Slice(0, v32.count);
  if (reread) {
    backend_->ops().CastKeepingRounded(Stream::kCompute, low, v32);
  } else {
    backend_->ops().Cast(Stream::kCompute, low, v32);
  }
}

View StagedModel::Kept(const Buffer& kept, int64_t n) const {
  return kept.view(compute_dtype()).Slice(0, n);
}

absl::Status StagedModel::NullArgument(const char* stage, const char* what) const {
  return absl::InvalidArgumentError(absl::StrCat(family_, "::", stage, ": ", what, " is null"));
}

std::vector<DecayRange> UnitDecayRanges(const std::vector<ParamSpec>& specs, int unit) {
  std::vector<DecayRange> ranges;
  for (const ParamSpec& s : specs) {
    if (s.unit == unit) ranges.push_back({s.offset, s.offset + s.numel, s.weight_decay});
  }
  return ranges;
}

absl::Status CheckTokenIds(const int32_t* ids, int64_t n, int vocab_size, int T,
                           const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", i / T, ", ", i % T, "] = ", ids[i],
                       " is not a token id in [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status StagedModel::CheckTokens(View tokens, const char* what) const {
  const int64_t n = static_cast<int64_t>(B_) * T_;
  std::vector<int32_t> host(n);
  FSDP_RETURN_IF_ERROR(backend_->CopyToHost(host.data(), tokens.Slice(0, n)));
  return CheckTokenIds(host.data(), n, V_, T_, what);
}

// Shape and dtype of a token view; its ids too where it is host memory (free to read).
absl::Status StagedModel::CheckHostTokens(View tokens, const char* stage,
                                          const char* what) const {
  const int64_t n = static_cast<int64_t>(B_) * T_;
  if (tokens.count < n || tokens.dtype != DType::kI32) {
    return absl::InvalidArgumentError(absl::StrCat(family_, "::", stage, ": ", what,
                                                   " must be ", n, " i32 token ids, got ",
                                                   tokens.count));
  }
  if (backend_->is_host()) {
    absl::Status s = CheckTokenIds(tokens.host_as<int32_t>(), n, V_, T_, what);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(family_, ": ", s.message()));
  }
  return absl::OkStatus();
}

// ---- forward ---------------------------------------------------------------------------------

absl::Status StagedModel::ForwardEmbed(View root, View idx) {
  if (root.empty()) return NullArgument("ForwardEmbed", "root");
  if (idx.empty()) return NullArgument("ForwardEmbed", "idx");
  FSDP_RETURN_IF_ERROR(CheckHostTokens(idx, "ForwardEmbed", "idx"));
  RunForwardEmbed(root, idx);
  idx_ = idx;
  forward_blocks_done_ = 0;
  head_done_ = false;
  backward_next_ = -2;
  shared_holds_ = -1;
  return absl::OkStatus();
}

absl::Status StagedModel::ForwardBlock(int layer, View block) {
  if (layer < 0 || layer >= L_) {
    return absl::OutOfRangeError(absl::StrCat(family_, "::ForwardBlock: layer ", layer,
                                              " is not in [0, ", L_, ")"));
  }
  if (block.empty()) return NullArgument("ForwardBlock", "block");
  if (forward_blocks_done_ < layer) {
    return absl::FailedPreconditionError(absl::StrCat(
        family_, "::ForwardBlock(", layer, "): its input is not computed yet (",
        forward_blocks_done_ < 0 ? std::string("call ForwardEmbed first")
                                 : absl::StrCat("next block is ", forward_blocks_done_),
        ")"));
  }
  RunForwardBlock(layer, block);
  forward_blocks_done_ = std::max(forward_blocks_done_, layer + 1);
  if (layer_checkpointed(layer)) shared_holds_ = layer;
  return absl::OkStatus();
}

absl::StatusOr<float> StagedModel::ForwardHead(View root, View targets) {
  if (root.empty()) return NullArgument("ForwardHead", "root");
  if (forward_blocks_done_ < L_) {
    return absl::FailedPreconditionError(absl::StrCat(
        family_, "::ForwardHead: run ForwardEmbed and every ForwardBlock first"));
  }
  if (!targets.empty()) FSDP_RETURN_IF_ERROR(CheckHostTokens(targets, "ForwardHead", "targets"));
  RunForwardHead(root, targets);
  targets_ = targets;
  head_done_ = !targets.empty();
  backward_next_ = -2;
  if (targets.empty()) return 0.0f;
  // The mean loss on the device, then read: the one host synchronisation of a forward.
  float loss = 0;
  FSDP_RETURN_IF_ERROR(backend_->CopyToHost(&loss, loss_view()));
  return loss;
}

// ---- backward --------------------------------------------------------------------------------

absl::Status StagedModel::BackwardHead(View root, View droot, float loss_scale) {
  if (root.empty()) return NullArgument("BackwardHead", "root");
  if (!(loss_scale > 0.0f) || !std::isfinite(loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        family_, "::BackwardHead: loss_scale must be finite and > 0, got ", loss_scale));
  }
  if (!head_done_) {
    return absl::FailedPreconditionError(absl::StrCat(
        family_, "::BackwardHead: no ForwardHead with targets since the last backward"));
  }
  FSDP_RETURN_IF_ERROR(RunBackwardHead(root, droot, targets_, loss_scale));
  head_done_ = false;
  backward_next_ = L_ - 1;
  return absl::OkStatus();
}

absl::Status StagedModel::BackwardBlock(int layer, View block, View dblock) {
  if (layer < 0 || layer >= L_) {
    return absl::OutOfRangeError(absl::StrCat(family_, "::BackwardBlock: layer ", layer,
                                              " is not in [0, ", L_, ")"));
  }
  if (block.empty()) return NullArgument("BackwardBlock", "block");
  if (backward_next_ != layer) {
    return absl::FailedPreconditionError(absl::StrCat(
        family_, "::BackwardBlock(", layer, "): ",
        backward_next_ == -2 ? std::string("call BackwardHead first")
                             : absl::StrCat("the next block to run backward is ", backward_next_)));
  }
  if (layer_checkpointed(layer) && shared_holds_ != layer) {
    return absl::FailedPreconditionError(absl::StrCat(
        family_, "::BackwardBlock(", layer, "): block ", layer,
        " is activation-checkpointed and its activations are not in the shared scratch (",
        shared_holds_ < 0 ? std::string("it holds none")
                          : absl::StrCat("it holds block ", shared_holds_, "'s"),
        "); recompute them first: call ForwardBlock(", layer, ", params) right before ",
        "BackwardBlock(", layer, ")"));
  }
  FSDP_RETURN_IF_ERROR(RunBackwardBlock(layer, block, dblock));
  backward_next_ = layer - 1;
  return absl::OkStatus();
}

absl::Status StagedModel::BackwardEmbed(View droot) {
  if (backward_next_ != -1) {
    return absl::FailedPreconditionError(absl::StrCat(
        family_, "::BackwardEmbed: run BackwardHead and every BackwardBlock first"));
  }
  backward_next_ = -2;
  if (droot.empty()) return absl::OkStatus();
  RunBackwardEmbed(droot, idx_);
  return absl::OkStatus();
}

// ---- whole model -----------------------------------------------------------------------------

absl::StatusOr<float> StagedModel::Forward(const std::vector<View>& units, View idx,
                                           View targets) {
  if (static_cast<int>(units.size()) != num_units()) {
    return absl::InvalidArgumentError(absl::StrCat(family_, "::Forward: got ", units.size(),
                                                   " unit buffers, the model has ",
                                                   num_units()));
  }
  if (idx.empty()) return NullArgument("Forward", "idx");
  if (!backend_->is_host()) {  // the stages check host memory themselves
    FSDP_RETURN_IF_ERROR(CheckTokens(idx, "idx"));
    if (!targets.empty()) FSDP_RETURN_IF_ERROR(CheckTokens(targets, "targets"));
  }
  FSDP_RETURN_IF_ERROR(ForwardEmbed(units[0], idx));
  for (int i = 0; i < L_; ++i) FSDP_RETURN_IF_ERROR(ForwardBlock(i, units[1 + i]));
  return ForwardHead(units[0], targets);
}

absl::Status StagedModel::Backward(const std::vector<View>& units, const std::vector<View>& grads,
                                   float loss_scale) {
  if (static_cast<int>(units.size()) != num_units() ||
      static_cast<int>(grads.size()) != num_units()) {
    return absl::InvalidArgumentError(
        absl::StrCat(family_, "::Backward: got ", units.size(), " unit and ", grads.size(),
                     " gradient buffers, the model has ", num_units(), " units"));
  }
  FSDP_RETURN_IF_ERROR(BackwardHead(units[0], grads[0], loss_scale));
  for (int i = L_ - 1; i >= 0; --i) {
    // Recompute a checkpointed block, unless its forward was the last one into the scratch.
    if (layer_checkpointed(i) && shared_holds_ != i) {
      FSDP_RETURN_IF_ERROR(ForwardBlock(i, units[1 + i]));
    }
    FSDP_RETURN_IF_ERROR(BackwardBlock(i, units[1 + i], grads[1 + i]));
  }
  return BackwardEmbed(grads[0]);
}

}  // namespace fsdp::nn
