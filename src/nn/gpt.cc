// The GPT model (MODEL_SPEC.md), llm.c style: each stage calls the forward or backward kernels
// of its layers in order through the backend's op table, on activations allocated at Create.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/nn/gpt.h"
#include "fsdp/ops.h"
#include "src/nn/activation_alloc.h"
#include "src/nn/gpt_layout.h"

namespace fsdp::nn {

using internal::BlockDefs;
using internal::Carve;
using internal::RootDefs;
namespace t = internal;

// What a block's backward reads besides its input resid[i]. In bf16 / f16 compute, qkv, atty,
// fch and fch_gelu are kept in that dtype (the values the Linear layers and the attention
// read, as autocast keeps them) and ln1 / ln2 are not kept: the backward recomputes them from
// the block's input and the kept statistics (one norm, as cheap as upcasting a kept copy).
struct Gpt::BlockActs {
  Buffer ln1, ln1_mean, ln1_rstd, qkv, atty, lse, resid2, ln2, ln2_mean, ln2_rstd, fch,
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
  Buffer proj;  // [B,T,C] output of a c_proj, consumed at once by the residual add
  Buffer lnf, lnf_mean, lnf_rstd, logits, probs, losses, loss;
  // Gradient scratch, reused by every block. dx is the gradient of the residual stream: the
  // residual adds pass it through unchanged, so one buffer accumulates it across blocks.
  // dbranch [B,T,8C] holds the branch gradients: the mlp's dfch_gelu and dfch (4C each), then,
  // once those are dead, the attention's datty (C) and dqkv (3C). In bf16 / f16 compute the
  // forward computes in f32 in it (narrow [B,T,C], then wide [B,T,4C]) before keeping the
  // rounded copies (GELU writes its own), and the backward recomputes a LayerNorm's output
  // into up32 [B,T,C] (the ops read the other kept tensors as kept).
  Buffer dx, dln, dbranch, up32;
  Buffer params32;  // bf16/f16 compute: f32 upcasts of the parameters the f32 kernels read
  int64_t bytes = 0;
};

Gpt::Gpt(GptConfig config, Backend* backend, int B, int T, GptOptions options)
    : StagedModel("Gpt", backend, B, T, config.num_layers, config.vocab_size,
                  GptParamSpecs(config), std::move(options)),
      config_(std::move(config)),
      acts_(std::make_unique<Activations>()) {}

Gpt::~Gpt() = default;

namespace {

// Allocates (or, counting only, sizes) every buffer of one B x T step.
absl::Status AllocateActivations(const GptConfig& config, int B, int T,
                                 const ModelOptions& options, auto& a,
                                 internal::ActivationAllocator& alloc) {
  const int64_t BT = static_cast<int64_t>(B) * T, C = config.channels;
  const int64_t V = config.vocab_size, NH = config.num_heads, L = config.num_layers;
  FSDP_RETURN_IF_ERROR(alloc(a.pos, BT));
  a.resid.resize(L + 1);
  for (Buffer& r : a.resid) FSDP_RETURN_IF_ERROR(alloc(r, BT, C));
  const DType cd = options.compute_dtype;
  const bool lowp = cd != DType::kF32;
  auto alloc_block = [&](auto& b) -> absl::Status {
    FSDP_RETURN_IF_ERROR(alloc(b.resid2, BT, C));
    if (!lowp) {
      for (Buffer* buf : {&b.ln1, &b.ln2}) FSDP_RETURN_IF_ERROR(alloc(*buf, BT, C));
    }
    for (Buffer* buf : {&b.ln1_mean, &b.ln1_rstd, &b.ln2_mean, &b.ln2_rstd}) {
      FSDP_RETURN_IF_ERROR(alloc(*buf, BT));
    }
    FSDP_RETURN_IF_ERROR(alloc(b.lse, B, NH, T));  // attention's log-sum-exp per row
    FSDP_RETURN_IF_ERROR(alloc.Typed(b.atty, cd, BT, C));
    FSDP_RETURN_IF_ERROR(alloc.Typed(b.qkv, cd, BT, 3 * C));
    FSDP_RETURN_IF_ERROR(alloc.Typed(b.fch, cd, BT, 4 * C));
    return alloc.Typed(b.fch_gelu, cd, BT, 4 * C);
  };
  a.blocks.resize(L);
  bool any_checkpointed = false;
  for (int i = 0; i < L; ++i) {
    if (i < static_cast<int>(options.checkpoint_layers.size()) && options.checkpoint_layers[i]) {
      any_checkpointed = true;
    } else {
      FSDP_RETURN_IF_ERROR(alloc_block(a.blocks[i]));
    }
  }
  if (any_checkpointed) FSDP_RETURN_IF_ERROR(alloc_block(a.shared));
  for (Buffer* buf : {&a.proj, &a.lnf, &a.dx, &a.dln}) FSDP_RETURN_IF_ERROR(alloc(*buf, BT, C));
  for (Buffer* buf : {&a.lnf_mean, &a.lnf_rstd, &a.losses}) FSDP_RETURN_IF_ERROR(alloc(*buf, BT));
  FSDP_RETURN_IF_ERROR(alloc(a.loss, 1));
  FSDP_RETURN_IF_ERROR(alloc(a.logits, BT, V));
  FSDP_RETURN_IF_ERROR(alloc(a.probs, BT, V));
  FSDP_RETURN_IF_ERROR(alloc(a.dbranch, BT, 8 * C));
  if (lowp) {
    FSDP_RETURN_IF_ERROR(alloc(a.up32, BT, C));
    // The largest set one stage reads in f32: wte and the first T rows of wpe (ForwardEmbed).
    FSDP_RETURN_IF_ERROR(alloc(a.params32, std::max<int64_t>((V + T) * C, 4 * C)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> GptActivationBytes(const GptConfig& config, int B, int T,
                                           const ModelOptions& options) {
  FSDP_RETURN_IF_ERROR(config.Validate());
  Gpt::Activations a;
  internal::ActivationAllocator count(nullptr, "GPT", &a.bytes);
  FSDP_RETURN_IF_ERROR(AllocateActivations(config, B, T, options, a, count));
  return a.bytes;
}

absl::StatusOr<std::unique_ptr<Gpt>> Gpt::Create(const GptConfig& config, Backend* backend,
                                                 int B, int T, GptOptions options) {
  FSDP_RETURN_IF_ERROR(config.Validate());
  FSDP_RETURN_IF_ERROR(
      CheckCreate("Gpt", backend, B, T, config.block_size, config.num_layers, options));
  std::unique_ptr<Gpt> gpt(new Gpt(config, backend, B, T, std::move(options)));
  Activations& a = *gpt->acts_;
  internal::ActivationAllocator alloc(backend, "GPT", &a.bytes);
  FSDP_RETURN_IF_ERROR(AllocateActivations(config, B, T, gpt->options(), a, alloc));
  gpt->params32_ = a.params32.view();
  const int64_t BT = static_cast<int64_t>(B) * T;
  std::vector<int32_t> pos(BT);
  for (int64_t i = 0; i < BT; ++i) pos[i] = static_cast<int32_t>(i % T);
  FSDP_RETURN_IF_ERROR(backend->CopyFromHost(a.pos.view(DType::kI32).Slice(0, BT), pos.data()));
  return gpt;
}

int64_t Gpt::activation_bytes() const { return acts_->bytes; }
View Gpt::logits() const { return acts_->logits.view(); }
View Gpt::loss_view() const { return acts_->loss.view(); }

Gpt::BlockActs& Gpt::Acts(int layer) const {
  return layer_checkpointed(layer) ? acts_->shared : acts_->blocks[layer];
}

// ---- forward ---------------------------------------------------------------------------------

void Gpt::RunForwardEmbed(View root, View idx) {
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
}

void Gpt::RunForwardBlock(int layer, View block) {
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const auto p = Carve(block, BlockDefs(config_.channels));
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, NH = config_.num_heads;
  const bool lowp = compute_dtype() != DType::kF32;
  Activations& a = *acts_;
  BlockActs& b = Acts(layer);
  const View x = a.resid[layer].view();
  const View proj = a.proj.view();
  const View ln1w = ParamF32(p[t::kLn1W], 0), ln1b = ParamF32(p[t::kLn1B], C);
  const View ln2w = ParamF32(p[t::kLn2W], 2 * C), ln2b = ParamF32(p[t::kLn2B], 3 * C);
  // f32 results: the kept buffers in f32 compute; else scratch in dbranch, kept rounded.
  const View narrow = a.dbranch.view().Slice(0, BT * C);
  const View wide = a.dbranch.view().Slice(BT * 4 * C, BT * 4 * C);
  const View ln1 = lowp ? narrow.Slice(0, BT * C) : b.ln1.view();
  const View qkv = lowp ? wide.Slice(0, BT * 3 * C) : b.qkv.view();
  const View atty = lowp ? narrow.Slice(0, BT * C) : b.atty.view();
  const View ln2 = lowp ? narrow.Slice(0, BT * C) : b.ln2.view();
  const View fch = lowp ? wide : b.fch.view();
  // GELU writes its kept copy itself (rounded as written in bf16 / f16 compute).
  const View fch_gelu = Kept(b.fch_gelu, BT * 4 * C);
  // x + attn(ln_1(x)). The Linear layers round their f32 inputs to the compute dtype
  // themselves or read the kept copies, so they read the values the kept copies hold.
  ops.LayernormForward(cs, ln1, b.ln1_mean.view(), b.ln1_rstd.view(), x, ln1w, ln1b, BT, C,
                       1e-5f);
  ops.MatmulForward(cs, qkv, ln1, p[t::kAttnW], p[t::kAttnB], BT, C, 3 * C);
  KeepRounded(b.qkv, qkv, /*reread=*/true);
  ops.AttentionForward(cs, atty, b.lse.view(), qkv, B, T, C, NH);
  KeepRounded(b.atty, atty, false);
  ops.MatmulForward(cs, proj, Kept(b.atty, BT * C), p[t::kAttnProjW], p[t::kAttnProjB], BT, C,
                    C);
  ops.Add(cs, b.resid2.view(), x, proj);
  // + mlp(ln_2(.))
  ops.LayernormForward(cs, ln2, b.ln2_mean.view(), b.ln2_rstd.view(), b.resid2.view(), ln2w,
                       ln2b, BT, C, 1e-5f);
  ops.MatmulForward(cs, fch, ln2, p[t::kFcW], p[t::kFcB], BT, C, 4 * C);
  KeepRounded(b.fch, fch, /*reread=*/true);
  ops.GeluForward(cs, fch_gelu, fch);
  ops.MatmulForward(cs, proj, fch_gelu, p[t::kFcProjW], p[t::kFcProjB], BT, 4 * C, C);
  ops.Add(cs, a.resid[layer + 1].view(), b.resid2.view(), proj);
}

void Gpt::RunForwardHead(View root, View targets) {
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
  if (targets.empty()) return;
  ops.SoftmaxCrossEntropyForward(cs, a.losses.view(), a.probs.view(), a.logits.view(), targets,
                                 BT, V);
  ops.Mean(cs, a.loss.view(), a.losses.view());
}

// ---- backward --------------------------------------------------------------------------------

absl::Status Gpt::RunBackwardHead(View root, View droot, View targets, float loss_scale) {
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
  ops.SoftmaxCrossEntropyBackward(cs, dlogits, a.probs.view(), targets,
                                  loss_scale / static_cast<float>(BT), BT, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dln.view()));
  ops.MatmulBackward(cs, a.dln.view(), g[t::kWte], View{}, dlogits, a.lnf.view(), p[t::kWte], BT,
                     C, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dx.view()));
  ops.LayernormBackward(cs, a.dx.view(), g[t::kLnfW], g[t::kLnfB], a.dln.view(),
                        a.resid[config_.num_layers].view(), ParamF32(p[t::kLnfW], 0),
                        a.lnf_mean.view(), a.lnf_rstd.view(), BT, C);
  return absl::OkStatus();
}

absl::Status Gpt::RunBackwardBlock(int layer, View block, View dblock) {
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const auto defs = BlockDefs(config_.channels);
  const auto p = Carve(block, defs);
  const auto g = Carve(dblock, defs);
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, NH = config_.num_heads;
  const bool lowp = compute_dtype() != DType::kF32;
  Activations& a = *acts_;
  BlockActs& b = Acts(layer);
  const View dx = a.dx.view();  // in: d resid[layer + 1]; out: d resid[layer]
  const View dln = a.dln.view();
  const View dbranch = a.dbranch.view();
  const View dfch_gelu = dbranch.Slice(0, BT * 4 * C);  // mlp part
  const View dfch = dbranch.Slice(BT * 4 * C, BT * 4 * C);
  const View datty = dbranch.Slice(0, BT * C);  // attention part, after the mlp's are dead
  const View dqkv = dbranch.Slice(BT * C, BT * 3 * C);
  const View ln1w = ParamF32(p[t::kLn1W], 0), ln1b = ParamF32(p[t::kLn1B], C);
  const View ln2w = ParamF32(p[t::kLn2W], 2 * C), ln2b = ParamF32(p[t::kLn2B], 3 * C);
  // A LayerNorm's output: kept in f32 compute, else recomputed (the same kernel on the same
  // input: the forward's values) into up32.
  auto norm = [&](const Buffer& kept, View inp, View w, View bias, const Buffer& mean,
                  const Buffer& rstd) {
    if (!lowp) return kept.view();
    const View out = a.up32.view().Slice(0, BT * C);
    ops.LayernormForward(cs, out, mean.view(), rstd.view(), inp, w, bias, BT, C, 1e-5f);
    return out;
  };
  // mlp: dx is also the gradient of its output (residual add)
  FSDP_RETURN_IF_ERROR(Zero(dfch_gelu));
  ops.MatmulBackward(cs, dfch_gelu, g[t::kFcProjW], g[t::kFcProjB], dx,
                     Kept(b.fch_gelu, BT * 4 * C), p[t::kFcProjW], BT, 4 * C, C);
  FSDP_RETURN_IF_ERROR(Zero(dfch));
  ops.GeluBackward(cs, dfch, Kept(b.fch, BT * 4 * C), dfch_gelu);
  FSDP_RETURN_IF_ERROR(Zero(dln));
  ops.MatmulBackward(cs, dln, g[t::kFcW], g[t::kFcB], dfch,
                     norm(b.ln2, b.resid2.view(), ln2w, ln2b, b.ln2_mean, b.ln2_rstd),
                     p[t::kFcW], BT, C, 4 * C);
  ops.LayernormBackward(cs, dx, g[t::kLn2W], g[t::kLn2B], dln, b.resid2.view(), ln2w,
                        b.ln2_mean.view(), b.ln2_rstd.view(), BT, C);
  // attention: dx is now d resid2, the gradient of the attention branch's output
  const View atty = Kept(b.atty, BT * C);
  FSDP_RETURN_IF_ERROR(Zero(datty));
  ops.MatmulBackward(cs, datty, g[t::kAttnProjW], g[t::kAttnProjB], dx, atty, p[t::kAttnProjW],
                     BT, C, C);
  FSDP_RETURN_IF_ERROR(Zero(dqkv));
  ops.AttentionBackward(cs, dqkv, datty, Kept(b.qkv, BT * 3 * C), atty, b.lse.view(), B, T, C,
                        NH);
  FSDP_RETURN_IF_ERROR(Zero(dln));
  ops.MatmulBackward(cs, dln, g[t::kAttnW], g[t::kAttnB], dqkv,
                     norm(b.ln1, a.resid[layer].view(), ln1w, ln1b, b.ln1_mean, b.ln1_rstd),
                     p[t::kAttnW], BT, C, 3 * C);
  ops.LayernormBackward(cs, dx, g[t::kLn1W], g[t::kLn1B], dln, a.resid[layer].view(), ln1w,
                        b.ln1_mean.view(), b.ln1_rstd.view(), BT, C);
  return absl::OkStatus();
}

void Gpt::RunBackwardEmbed(View droot, View idx) {
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const auto g = Carve(droot, RootDefs(config_.vocab_size, config_.block_size, config_.channels));
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  Activations& a = *acts_;
  // wte also received the lm_head's gradient in BackwardHead: the two add up.
  ops.EmbeddingBackward(cs, g[t::kWte], a.dx.view(), idx, BT, C);
  ops.EmbeddingBackward(cs, g[t::kWpe], a.dx.view(), a.pos.view(DType::kI32), BT, C);
}

}  // namespace fsdp::nn
