// The GPT model (MODEL_SPEC.md), llm.c style: each stage calls the forward or backward kernels
// of its layers in order through the backend's op table, on activations allocated at Create.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/nn/gpt.h"
#include "fsdp/ops.h"
#include "src/nn/gpt_layout.h"

namespace fsdp::nn {

using internal::BlockDefs;
using internal::Carve;
using internal::RootDefs;
namespace t = internal;

// What a block's backward reads besides its input resid[i].
struct Gpt::BlockActs {
  Buffer ln1, ln1_mean, ln1_rstd, qkv, atty, att, resid2, ln2, ln2_mean, ln2_rstd, fch,
      fch_gelu;
};

// Activations of one B x T step. Per block, everything its backward reads is kept (llm.c
// style), so all forwards can run before all backwards; a checkpointed block keeps only its
// input, and its forward writes the rest into `shared`.
struct Gpt::Activations {
  Buffer pos;                  // [B*T] int32 position of each token, for the wpe lookup
  std::vector<Buffer> resid;   // L+1 x [B,T,C]: resid[i] is the input of block i
  std::vector<BlockActs> blocks;  // per block (left empty for checkpointed blocks)
  BlockActs shared;               // the checkpointed blocks' one set (empty when none)
  int shared_holds = -1;          // the block whose activations `shared` holds; -1: none
  Buffer proj;  // [B,T,C] output of a c_proj, consumed at once by the residual add
  Buffer lnf, lnf_mean, lnf_rstd, logits, probs, losses, loss;
  // Gradient scratch, reused by every block. dx is the gradient of the residual stream: the
  // residual adds pass it through unchanged, so one buffer accumulates it across blocks.
  // dbranch [B,T,8C] holds the branch gradients: the mlp's dfch_gelu and dfch (4C each), then,
  // once those are dead, the attention's datty (C) and dqkv (3C).
  Buffer dx, dln, dbranch;
  Buffer params32;  // bf16/f16 compute: f32 upcasts of the parameters the f32 kernels read
  int64_t bytes = 0;
};

namespace {

// Allocates buffers of n floats (or n int32) on the backend and counts their bytes.
class Allocator {
 public:
  explicit Allocator(Backend* backend, int64_t* bytes) : backend_(backend), bytes_(bytes) {}
  absl::Status operator()(Buffer& b, int64_t n) {
    auto r = Buffer::Create(backend_, static_cast<size_t>(n) * sizeof(float));
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat("allocating the GPT's activations (", *bytes_,
                                       " bytes so far, this buffer ", n * sizeof(float),
                                       "): ", r.status().message()));
    }
    b = std::move(*r);
    *bytes_ += static_cast<int64_t>(b.bytes());
    return absl::OkStatus();
  }

 private:
  Backend* backend_;
  int64_t* bytes_;
};

absl::Status NullArgument(const char* stage, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat("Gpt::", stage, ": ", what, " is null"));
}

absl::Status CheckOptions(const GptConfig& config, const GptOptions& options) {
  const DType d = options.compute_dtype;
  if (d != DType::kF32 && d != DType::kBF16 && d != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("Gpt::Create: compute_dtype ",
                                                   static_cast<int>(d),
                                                   " is not f32, bf16 or f16"));
  }
  const size_t n = options.checkpoint_layers.size();
  if (n != 0 && n != static_cast<size_t>(config.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gpt::Create: checkpoint_layers has ", n, " flags; give none or one per ",
                     "layer (", config.num_layers, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

Gpt::Gpt(GptConfig config, Backend* backend, int B, int T, GptOptions options)
    : config_(std::move(config)), options_(std::move(options)), backend_(backend), B_(B), T_(T),
      specs_(GptParamSpecs(config_)), acts_(std::make_unique<Activations>()) {}

Gpt::~Gpt() = default;

absl::StatusOr<std::unique_ptr<Gpt>> Gpt::Create(const GptConfig& config, Backend* backend,
                                                 int B, int T, GptOptions options) {
  FSDP_RETURN_IF_ERROR(config.Validate());
  if (backend == nullptr) return absl::InvalidArgumentError("Gpt::Create: backend is null");
  if (B <= 0 || T <= 0 || T > config.block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gpt::Create: need B >= 1 and 1 <= T <= block_size (", config.block_size,
                     "), got B=", B, " T=", T));
  }
  FSDP_RETURN_IF_ERROR(CheckOptions(config, options));
  std::unique_ptr<Gpt> gpt(new Gpt(config, backend, B, T, std::move(options)));
  Activations& a = *gpt->acts_;
  Allocator alloc(backend, &a.bytes);
  const int64_t BT = static_cast<int64_t>(B) * T, C = config.channels;
  const int64_t V = config.vocab_size, NH = config.num_heads, L = config.num_layers;

  FSDP_RETURN_IF_ERROR(alloc(a.pos, BT));
  std::vector<int32_t> pos(BT);
  for (int64_t i = 0; i < BT; ++i) pos[i] = static_cast<int32_t>(i % T);
  FSDP_RETURN_IF_ERROR(backend->CopyFromHost(a.pos.view(DType::kI32).Slice(0, BT), pos.data()));

  a.resid.resize(L + 1);
  for (Buffer& r : a.resid) FSDP_RETURN_IF_ERROR(alloc(r, BT * C));
  auto alloc_block = [&](BlockActs& b) -> absl::Status {
    for (Buffer* buf : {&b.ln1, &b.atty, &b.resid2, &b.ln2}) {
      FSDP_RETURN_IF_ERROR(alloc(*buf, BT * C));
    }
    for (Buffer* buf : {&b.ln1_mean, &b.ln1_rstd, &b.ln2_mean, &b.ln2_rstd}) {
      FSDP_RETURN_IF_ERROR(alloc(*buf, BT));
    }
    FSDP_RETURN_IF_ERROR(alloc(b.qkv, BT * 3 * C));
    FSDP_RETURN_IF_ERROR(alloc(b.att, B * NH * T * T));
    FSDP_RETURN_IF_ERROR(alloc(b.fch, BT * 4 * C));
    return alloc(b.fch_gelu, BT * 4 * C);
  };
  a.blocks.resize(L);
  bool any_checkpointed = false;
  for (int i = 0; i < L; ++i) {
    if (gpt->layer_checkpointed(i)) {
      any_checkpointed = true;
    } else {
      FSDP_RETURN_IF_ERROR(alloc_block(a.blocks[i]));
    }
  }
  if (any_checkpointed) FSDP_RETURN_IF_ERROR(alloc_block(a.shared));
  for (Buffer* buf : {&a.proj, &a.lnf, &a.dx, &a.dln}) FSDP_RETURN_IF_ERROR(alloc(*buf, BT * C));
  for (Buffer* buf : {&a.lnf_mean, &a.lnf_rstd, &a.losses}) FSDP_RETURN_IF_ERROR(alloc(*buf, BT));
  FSDP_RETURN_IF_ERROR(alloc(a.loss, 1));
  FSDP_RETURN_IF_ERROR(alloc(a.logits, BT * V));
  FSDP_RETURN_IF_ERROR(alloc(a.probs, BT * V));
  FSDP_RETURN_IF_ERROR(alloc(a.dbranch, BT * 8 * C));
  if (gpt->compute_dtype() != DType::kF32) {
    // The largest set one stage reads in f32: wte and the first T rows of wpe (ForwardEmbed).
    FSDP_RETURN_IF_ERROR(alloc(a.params32, std::max<int64_t>((V + T) * C, 4 * C)));
  }
  return gpt;
}

std::vector<const ParamSpec*> Gpt::unit_params(int unit) const {
  std::vector<const ParamSpec*> out;
  for (const ParamSpec& s : specs_) {
    if (s.unit == unit) out.push_back(&s);
  }
  return out;
}

int64_t Gpt::unit_numel(int unit) const { return GptUnitNumel(config_, unit); }
int64_t Gpt::activation_bytes() const { return acts_->bytes; }
View Gpt::logits() const { return acts_->logits.view(); }

bool Gpt::layer_checkpointed(int i) const {
  return i >= 0 && static_cast<size_t>(i) < options_.checkpoint_layers.size() &&
         options_.checkpoint_layers[i];
}

Gpt::BlockActs& Gpt::Acts(int layer) const {
  return layer_checkpointed(layer) ? acts_->shared : acts_->blocks[layer];
}

absl::Status Gpt::Zero(View v) const { return backend_->Memset(v, 0); }

// ---- compute dtype -----------------------------------------------------------------------------

View Gpt::ParamF32(View p, int64_t slot) const {
  if (p.dtype == DType::kF32) return p;
  const View out = acts_->params32.view().Slice(slot, p.count);
  backend_->ops().Cast(Stream::kCompute, out, p);
  return out;
}

absl::Status Gpt::CheckTokens(View tokens, const char* what) const {
  const int64_t n = static_cast<int64_t>(B_) * T_;
  std::vector<int32_t> host(n);
  FSDP_RETURN_IF_ERROR(backend_->CopyToHost(host.data(), tokens.Slice(0, n)));
  return CheckTokenIds(host.data(), n, config_.vocab_size, T_, what);
}

absl::Status CheckTokenIds(const int32_t* ids, int64_t n, int vocab_size, int T,
                           const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("Gpt: ", what, "[", i / T, ", ", i % T, "] = ", ids[i],
                       " is not a token id in [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

// ---- forward ---------------------------------------------------------------------------------

absl::Status Gpt::ForwardEmbed(View root, View idx) {
  if (root.empty()) return NullArgument("ForwardEmbed", "root");
  if (idx.empty()) return NullArgument("ForwardEmbed", "idx");
  if (idx.count < static_cast<int64_t>(B_) * T_ || idx.dtype != DType::kI32) {
    return absl::InvalidArgumentError(absl::StrCat("Gpt::ForwardEmbed: idx must be ", B_ * T_,
                                                   " i32 token ids, got ", idx.count));
  }
  // Host memory is checked where it lies (free); device tokens are the caller's to check.
  if (backend_->is_host()) {
    FSDP_RETURN_IF_ERROR(
        CheckTokenIds(idx.host_as<int32_t>(), int64_t{B_} * T_, config_.vocab_size, T_, "idx"));
  }
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  const auto p = Carve(root, RootDefs(V, config_.block_size, C));
  const View wte = ParamF32(p[t::kWte], 0);
  const View wpe = ParamF32(p[t::kWpe].Slice(0, T_ * C), V * C);  // positions 0..T-1 only
  Activations& a = *acts_;
  const View x = a.resid[0].view().Slice(0, BT * C);
  const View proj = a.proj.view().Slice(0, BT * C);
  // x = wte[idx] + wpe[pos]
  ops.EmbeddingForward(cs, x, idx, wte, BT, C);
  ops.EmbeddingForward(cs, proj, a.pos.view(DType::kI32), wpe, BT, C);
  ops.Add(cs, x, x, proj);
  idx_ = idx;
  forward_blocks_done_ = 0;
  head_done_ = false;
  backward_next_ = -2;
  a.shared_holds = -1;
  return absl::OkStatus();
}

absl::Status Gpt::ForwardBlock(int layer, View block) {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::OutOfRangeError(absl::StrCat("Gpt::ForwardBlock: layer ", layer,
                                              " is not in [0, ", config_.num_layers, ")"));
  }
  if (block.empty()) return NullArgument("ForwardBlock", "block");
  if (forward_blocks_done_ < layer) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Gpt::ForwardBlock(", layer, "): its input is not computed yet (",
        forward_blocks_done_ < 0 ? std::string("call ForwardEmbed first")
                                 : absl::StrCat("next block is ", forward_blocks_done_),
        ")"));
  }
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const auto p = Carve(block, BlockDefs(config_.channels));
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, NH = config_.num_heads;
  Activations& a = *acts_;
  BlockActs& b = Acts(layer);
  const View x = a.resid[layer].view();
  const View proj = a.proj.view();
  const View ln1w = ParamF32(p[t::kLn1W], 0), ln1b = ParamF32(p[t::kLn1B], C);
  const View ln2w = ParamF32(p[t::kLn2W], 2 * C), ln2b = ParamF32(p[t::kLn2B], 3 * C);
  // x + attn(ln_1(x))
  ops.LayernormForward(cs, b.ln1.view(), b.ln1_mean.view(), b.ln1_rstd.view(), x, ln1w, ln1b,
                       BT, C, 1e-5f);
  ops.MatmulForward(cs, b.qkv.view(), b.ln1.view(), p[t::kAttnW], p[t::kAttnB], BT, C, 3 * C);
  ops.AttentionForward(cs, b.atty.view(), b.att.view(), b.qkv.view(), B, T, C, NH);
  ops.MatmulForward(cs, proj, b.atty.view(), p[t::kAttnProjW], p[t::kAttnProjB], BT, C, C);
  ops.Add(cs, b.resid2.view(), x, proj);
  // + mlp(ln_2(.))
  ops.LayernormForward(cs, b.ln2.view(), b.ln2_mean.view(), b.ln2_rstd.view(), b.resid2.view(),
                       ln2w, ln2b, BT, C, 1e-5f);
  ops.MatmulForward(cs, b.fch.view(), b.ln2.view(), p[t::kFcW], p[t::kFcB], BT, C, 4 * C);
  ops.GeluForward(cs, b.fch_gelu.view(), b.fch.view());
  ops.MatmulForward(cs, proj, b.fch_gelu.view(), p[t::kFcProjW], p[t::kFcProjB], BT, 4 * C, C);
  ops.Add(cs, a.resid[layer + 1].view(), b.resid2.view(), proj);
  forward_blocks_done_ = std::max(forward_blocks_done_, layer + 1);
  if (layer_checkpointed(layer)) a.shared_holds = layer;
  return absl::OkStatus();
}

absl::StatusOr<float> Gpt::ForwardHead(View root, View targets) {
  if (root.empty()) return NullArgument("ForwardHead", "root");
  if (forward_blocks_done_ < config_.num_layers) {
    return absl::FailedPreconditionError(
        "Gpt::ForwardHead: run ForwardEmbed and every ForwardBlock first");
  }
  if (!targets.empty()) {
    if (targets.count < static_cast<int64_t>(B_) * T_ || targets.dtype != DType::kI32) {
      return absl::InvalidArgumentError(absl::StrCat("Gpt::ForwardHead: targets must be ",
                                                     B_ * T_, " i32 token ids, got ",
                                                     targets.count));
    }
    if (backend_->is_host()) {
      FSDP_RETURN_IF_ERROR(CheckTokenIds(targets.host_as<int32_t>(), int64_t{B_} * T_,
                                         config_.vocab_size, T_, "targets"));
    }
  }
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  const auto p = Carve(root, RootDefs(V, config_.block_size, C));
  Activations& a = *acts_;
  ops.LayernormForward(cs, a.lnf.view(), a.lnf_mean.view(), a.lnf_rstd.view(),
                       a.resid[config_.num_layers].view(), ParamF32(p[t::kLnfW], 0),
                       ParamF32(p[t::kLnfB], C), BT, C, 1e-5f);
  // The lm_head is tied to wte: logits = ln_f(x) wte^T.
  ops.MatmulForward(cs, a.logits.view(), a.lnf.view(), p[t::kWte], View{}, BT, C, V);
  targets_ = targets;
  head_done_ = !targets.empty();
  backward_next_ = -2;
  if (targets.empty()) return 0.0f;
  ops.SoftmaxCrossEntropyForward(cs, a.losses.view(), a.probs.view(), a.logits.view(), targets,
                                 BT, V);
  // The mean loss on the device, then read: the one host synchronisation of a forward.
  ops.Mean(cs, a.loss.view(), a.losses.view());
  float loss = 0;
  FSDP_RETURN_IF_ERROR(backend_->CopyToHost(&loss, a.loss.view()));
  return loss;
}

// ---- backward --------------------------------------------------------------------------------

absl::Status Gpt::BackwardHead(View root, View droot, float loss_scale) {
  if (root.empty()) return NullArgument("BackwardHead", "root");
  if (!(loss_scale > 0.0f) || !std::isfinite(loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gpt::BackwardHead: loss_scale must be finite and > 0, got ", loss_scale));
  }
  if (!head_done_) {
    return absl::FailedPreconditionError(
        "Gpt::BackwardHead: no ForwardHead with targets since the last backward");
  }
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  const auto defs = RootDefs(V, config_.block_size, C);
  const auto p = Carve(root, defs);
  const auto g = Carve(droot, defs);
  Activations& a = *acts_;
  const View dlogits = a.logits.view();  // the logits are no longer needed
  FSDP_RETURN_IF_ERROR(Zero(dlogits));
  ops.SoftmaxCrossEntropyBackward(cs, dlogits, a.probs.view(), targets_,
                                  loss_scale / static_cast<float>(BT), BT, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dln.view()));
  ops.MatmulBackward(cs, a.dln.view(), g[t::kWte], View{}, dlogits, a.lnf.view(), p[t::kWte], BT,
                     C, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dx.view()));
  ops.LayernormBackward(cs, a.dx.view(), g[t::kLnfW], g[t::kLnfB], a.dln.view(),
                        a.resid[config_.num_layers].view(), ParamF32(p[t::kLnfW], 0),
                        a.lnf_mean.view(), a.lnf_rstd.view(), BT, C);
  head_done_ = false;
  backward_next_ = config_.num_layers - 1;
  return absl::OkStatus();
}

absl::Status Gpt::BackwardBlock(int layer, View block, View dblock) {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::OutOfRangeError(absl::StrCat("Gpt::BackwardBlock: layer ", layer,
                                              " is not in [0, ", config_.num_layers, ")"));
  }
  if (block.empty()) return NullArgument("BackwardBlock", "block");
  if (backward_next_ != layer) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Gpt::BackwardBlock(", layer, "): ",
        backward_next_ == -2 ? std::string("call BackwardHead first")
                             : absl::StrCat("the next block to run backward is ", backward_next_)));
  }
  Activations& a = *acts_;
  if (layer_checkpointed(layer) && a.shared_holds != layer) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Gpt::BackwardBlock(", layer, "): block ", layer,
        " is activation-checkpointed and its activations are not in the shared scratch (",
        a.shared_holds < 0 ? std::string("it holds none")
                           : absl::StrCat("it holds block ", a.shared_holds, "'s"),
        "); recompute them first: call ForwardBlock(", layer, ", params) right before ",
        "BackwardBlock(", layer, ")"));
  }
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const auto defs = BlockDefs(config_.channels);
  const auto p = Carve(block, defs);
  const auto g = Carve(dblock, defs);
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, NH = config_.num_heads;
  BlockActs& b = Acts(layer);
  const View dx = a.dx.view();  // in: d resid[layer + 1]; out: d resid[layer]
  const View dln = a.dln.view();
  const View dbranch = a.dbranch.view();
  const View dfch_gelu = dbranch.Slice(0, BT * 4 * C);  // mlp part
  const View dfch = dbranch.Slice(BT * 4 * C, BT * 4 * C);
  const View datty = dbranch.Slice(0, BT * C);  // attention part, after the mlp's are dead
  const View dqkv = dbranch.Slice(BT * C, BT * 3 * C);
  // mlp: dx is also the gradient of its output (residual add)
  FSDP_RETURN_IF_ERROR(Zero(dfch_gelu));
  ops.MatmulBackward(cs, dfch_gelu, g[t::kFcProjW], g[t::kFcProjB], dx, b.fch_gelu.view(),
                     p[t::kFcProjW], BT, 4 * C, C);
  FSDP_RETURN_IF_ERROR(Zero(dfch));
  ops.GeluBackward(cs, dfch, b.fch.view(), dfch_gelu);
  FSDP_RETURN_IF_ERROR(Zero(dln));
  ops.MatmulBackward(cs, dln, g[t::kFcW], g[t::kFcB], dfch, b.ln2.view(), p[t::kFcW], BT, C,
                     4 * C);
  ops.LayernormBackward(cs, dx, g[t::kLn2W], g[t::kLn2B], dln, b.resid2.view(),
                        ParamF32(p[t::kLn2W], 0), b.ln2_mean.view(), b.ln2_rstd.view(), BT, C);
  // attention: dx is now d resid2, the gradient of the attention branch's output
  FSDP_RETURN_IF_ERROR(Zero(datty));
  ops.MatmulBackward(cs, datty, g[t::kAttnProjW], g[t::kAttnProjB], dx, b.atty.view(),
                     p[t::kAttnProjW], BT, C, C);
  FSDP_RETURN_IF_ERROR(Zero(dqkv));
  ops.AttentionBackward(cs, dqkv, datty, b.qkv.view(), b.att.view(), B, T, C, NH);
  FSDP_RETURN_IF_ERROR(Zero(dln));
  ops.MatmulBackward(cs, dln, g[t::kAttnW], g[t::kAttnB], dqkv, b.ln1.view(), p[t::kAttnW], BT,
                     C, 3 * C);
  ops.LayernormBackward(cs, dx, g[t::kLn1W], g[t::kLn1B], dln, a.resid[layer].view(),
                        ParamF32(p[t::kLn1W], 0), b.ln1_mean.view(), b.ln1_rstd.view(), BT, C);
  backward_next_ = layer - 1;
  return absl::OkStatus();
}

absl::Status Gpt::BackwardEmbed(View droot) {
  if (backward_next_ != -1) {
    return absl::FailedPreconditionError(
        "Gpt::BackwardEmbed: run BackwardHead and every BackwardBlock first");
  }
  backward_next_ = -2;
  if (droot.empty()) return absl::OkStatus();
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const auto g = Carve(droot, RootDefs(config_.vocab_size, config_.block_size, config_.channels));
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  Activations& a = *acts_;
  // wte also received the lm_head's gradient in BackwardHead: the two add up.
  ops.EmbeddingBackward(cs, g[t::kWte], a.dx.view(), idx_, BT, C);
  ops.EmbeddingBackward(cs, g[t::kWpe], a.dx.view(), a.pos.view(DType::kI32), BT, C);
  return absl::OkStatus();
}

// ---- whole model -----------------------------------------------------------------------------

absl::StatusOr<float> Gpt::Forward(const std::vector<View>& units, View idx, View targets) {
  if (static_cast<int>(units.size()) != num_units()) {
    return absl::InvalidArgumentError(absl::StrCat("Gpt::Forward: got ", units.size(),
                                                   " unit buffers, the model has ", num_units()));
  }
  if (idx.empty()) return NullArgument("Forward", "idx");
  if (!backend_->is_host()) {  // the stages check host memory themselves
    FSDP_RETURN_IF_ERROR(CheckTokens(idx, "idx"));
    if (!targets.empty()) FSDP_RETURN_IF_ERROR(CheckTokens(targets, "targets"));
  }
  FSDP_RETURN_IF_ERROR(ForwardEmbed(units[0], idx));
  for (int i = 0; i < config_.num_layers; ++i) FSDP_RETURN_IF_ERROR(ForwardBlock(i, units[1 + i]));
  return ForwardHead(units[0], targets);
}

absl::Status Gpt::Backward(const std::vector<View>& units, const std::vector<View>& grads,
                           float loss_scale) {
  if (static_cast<int>(units.size()) != num_units() ||
      static_cast<int>(grads.size()) != num_units()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gpt::Backward: got ", units.size(), " unit and ", grads.size(),
                     " gradient buffers, the model has ", num_units(), " units"));
  }
  FSDP_RETURN_IF_ERROR(BackwardHead(units[0], grads[0], loss_scale));
  for (int i = config_.num_layers - 1; i >= 0; --i) {
    // Recompute a checkpointed block, unless its forward was the last one into the scratch.
    if (layer_checkpointed(i) && acts_->shared_holds != i) {
      FSDP_RETURN_IF_ERROR(ForwardBlock(i, units[1 + i]));
    }
    FSDP_RETURN_IF_ERROR(BackwardBlock(i, units[1 + i], grads[1 + i]));
  }
  return BackwardEmbed(grads[0]);
}

}  // namespace fsdp::nn
