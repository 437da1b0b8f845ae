// The Llama 2 model (MODEL_SPEC.md), written as the GPT is: each stage calls the forward or
// backward ops of its layers in order through the backend's op table, on activations
// allocated at Create.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/nn/llama.h"
#include "fsdp/ops.h"
#include "src/nn/activation_alloc.h"
#include "src/nn/llama_layout.h"

namespace fsdp::nn {

using internal::Carve;
using internal::LlamaBlockDefs;
using internal::LlamaRootDefs;
namespace t = internal;

// What a layer's backward reads besides its input resid[i]. qkv holds q and k after the
// rotary embedding (what attention read), v as projected. In bf16 / f16 compute, qkv, atty, gu
// and h are kept in that dtype (the values the Linear layers, the attention and SwiGLU read,
// as autocast keeps them) and ln1 / ln2 are not kept: the backward recomputes them from the
// layer's input and the kept rstd (one norm, as cheap as upcasting a kept copy).
struct Llama::BlockActs {
  Buffer ln1, ln1_rstd, qkv, atty, lse, resid2, ln2, ln2_rstd, gu, h;
};

// Activations of one B x T step, kept as the GPT keeps them (gpt.cc): everything a layer's
// backward reads, or, for a checkpointed layer, only its input.
struct Llama::Activations {
  std::vector<Buffer> resid;      // L+1 x [B,T,C]: resid[i] is the input of layer i
  std::vector<BlockActs> blocks;  // per layer (left empty for checkpointed layers)
  BlockActs shared;               // the checkpointed layers' one set (empty when none)
  Buffer proj;  // [B,T,C] output of o_proj / down_proj, consumed at once by the residual add
  Buffer lnf, lnf_rstd, logits, probs, losses, loss;
  // Gradient scratch reused by every layer: dx is the residual stream's gradient; dbranch
  // holds the mlp's dh (F) and dgu (2F), then the attention's datty (C) and dqkv (QKV). In
  // bf16 / f16 compute the forward computes in f32 in dbranch (narrow [B,T,C], then wide
  // [B,T,max(QKV,2F)]) before keeping the rounded copies (SwiGLU writes its own), and the
  // backward recomputes an RMSNorm's output into up32 [B,T,C] (the ops read the other kept
  // tensors as kept).
  Buffer dx, dln, dbranch, up32;
  Buffer params32;  // bf16/f16 compute: f32 upcasts of the parameters the f32 kernels read
  int64_t bytes = 0;
};

namespace {

// Element offsets of the fused projections inside a layer's flat buffer.
struct Fused {
  int64_t qkv, gate_up;
};
Fused FusedOffsets(const LlamaConfig& c) {
  const auto defs = LlamaBlockDefs(c);
  int64_t off = 0;
  Fused f{};
  for (int i = 0; i < t::kNumLlamaBlockTensors; ++i) {
    if (i == t::kQ) f.qkv = off;
    if (i == t::kGate) f.gate_up = off;
    off += defs[i].numel();
  }
  return f;
}

// A slice of a flat buffer, or an empty view (a gradient that is not computed).
View SliceOrEmpty(const View& flat, int64_t offset, int64_t count) {
  return flat.empty() ? View{} : flat.Slice(offset, count);
}

// Elements per token of dbranch: the backward's gradients and, in bf16 / f16 compute, the
// forward's two f32 scratch regions.
int64_t DbranchWidth(const LlamaConfig& c, bool lowp) {
  const int64_t C = c.channels, F = c.mlp_hidden, QKV = c.qkv_width();
  const int64_t grads = std::max(3 * F, C + QKV);
  return lowp ? std::max(grads, C + std::max(QKV, 2 * F)) : grads;
}

// Allocates (or, counting only, sizes) every buffer of one B x T step.
absl::Status AllocateActivations(const LlamaConfig& config, int B, int T,
                                 const ModelOptions& options, auto& a,
                                 internal::ActivationAllocator& alloc) {
  const int64_t BT = static_cast<int64_t>(B) * T, C = config.channels;
  const int64_t V = config.vocab_size, H = config.num_heads, L = config.num_layers;
  const int64_t F = config.mlp_hidden, QKV = config.qkv_width();
  a.resid.resize(L + 1);
  for (Buffer& r : a.resid) FSDP_RETURN_IF_ERROR(alloc(r, BT, C));
  const DType cd = options.compute_dtype;
  const bool lowp = cd != DType::kF32;
  auto alloc_block = [&](auto& b) -> absl::Status {
    FSDP_RETURN_IF_ERROR(alloc(b.resid2, BT, C));
    if (!lowp) {
      for (Buffer* buf : {&b.ln1, &b.ln2}) FSDP_RETURN_IF_ERROR(alloc(*buf, BT, C));
    }
    for (Buffer* buf : {&b.ln1_rstd, &b.ln2_rstd}) FSDP_RETURN_IF_ERROR(alloc(*buf, BT));
    FSDP_RETURN_IF_ERROR(alloc(b.lse, B, H, T));  // attention's log-sum-exp per row
    FSDP_RETURN_IF_ERROR(alloc.Typed(b.atty, cd, BT, C));
    FSDP_RETURN_IF_ERROR(alloc.Typed(b.qkv, cd, BT, QKV));
    FSDP_RETURN_IF_ERROR(alloc.Typed(b.gu, cd, BT, 2 * F));
    return alloc.Typed(b.h, cd, BT, F);
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
  for (Buffer* buf : {&a.lnf_rstd, &a.losses}) FSDP_RETURN_IF_ERROR(alloc(*buf, BT));
  FSDP_RETURN_IF_ERROR(alloc(a.loss, 1));
  FSDP_RETURN_IF_ERROR(alloc(a.logits, BT, V));
  FSDP_RETURN_IF_ERROR(alloc(a.probs, BT, V));
  FSDP_RETURN_IF_ERROR(alloc(a.dbranch, BT, DbranchWidth(config, lowp)));
  if (lowp) {
    FSDP_RETURN_IF_ERROR(alloc(a.up32, BT, C));
    // The largest set one stage reads in f32: the embedding table (ForwardEmbed).
    FSDP_RETURN_IF_ERROR(alloc(a.params32, std::max(V * C, 2 * C)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> LlamaActivationBytes(const LlamaConfig& config, int B, int T,
                                             const ModelOptions& options) {
  FSDP_RETURN_IF_ERROR(config.Validate());
  Llama::Activations a;
  internal::ActivationAllocator count(nullptr, "Llama", &a.bytes);
  FSDP_RETURN_IF_ERROR(AllocateActivations(config, B, T, options, a, count));
  return a.bytes;
}

Llama::Llama(LlamaConfig config, Backend* backend, int B, int T, ModelOptions options)
    : StagedModel("Llama", backend, B, T, config.num_layers, config.vocab_size,
                  LlamaParamSpecs(config), std::move(options)),
      config_(std::move(config)),
      acts_(std::make_unique<Activations>()) {}

Llama::~Llama() = default;

absl::StatusOr<std::unique_ptr<Llama>> Llama::Create(const LlamaConfig& config,
                                                     Backend* backend, int B, int T,
                                                     ModelOptions options) {
  FSDP_RETURN_IF_ERROR(config.Validate());
  FSDP_RETURN_IF_ERROR(
      CheckCreate("Llama", backend, B, T, config.block_size, config.num_layers, options));
  std::unique_ptr<Llama> m(new Llama(config, backend, B, T, std::move(options)));
  internal::ActivationAllocator alloc(backend, "Llama", &m->acts_->bytes);
  FSDP_RETURN_IF_ERROR(AllocateActivations(config, B, T, m->options(), *m->acts_, alloc));
  m->params32_ = m->acts_->params32.view();
  return m;
}

int64_t Llama::activation_bytes() const { return acts_->bytes; }
View Llama::logits() const { return acts_->logits.view(); }
View Llama::loss_view() const { return acts_->loss.view(); }

Llama::BlockActs& Llama::Acts(int layer) const {
  return layer_checkpointed(layer) ? acts_->shared : acts_->blocks[layer];
}


// ---- forward ---------------------------------------------------------------------------------

void Llama::RunForwardEmbed(View root, View idx) {
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const auto p = Carve(root, LlamaRootDefs(config_));
  backend_->ops().EmbeddingForward(Stream::kCompute, acts_->resid[0].view().Slice(0, BT * C),
                                   idx, ParamF32(p[t::kEmbed], 0), BT, C);
}

void Llama::RunForwardBlock(int layer, View block) {
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const auto p = Carve(block, LlamaBlockDefs(config_));
  const Fused fused = FusedOffsets(config_);
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, F = config_.mlp_hidden;
  const int64_t H = config_.num_heads, KV = config_.num_kv_heads, D = config_.head_size();
  const int64_t QKV = config_.qkv_width();
  const float eps = config_.norm_eps, theta = config_.rope_theta;
  const bool lowp = compute_dtype() != DType::kF32;
  Activations& a = *acts_;
  BlockActs& b = Acts(layer);
  const View x = a.resid[layer].view();
  const View proj = a.proj.view();
  // f32 results: the kept buffers in f32 compute; else scratch in dbranch, kept rounded.
  const int64_t narrow_n = BT * C;
  const View narrow = a.dbranch.view().Slice(0, narrow_n);
  const View wide = a.dbranch.view().Slice(narrow_n, BT * std::max(QKV, 2 * F));
  const View ln1 = lowp ? narrow.Slice(0, BT * C) : b.ln1.view();
  const View qkv = lowp ? wide.Slice(0, BT * QKV) : b.qkv.view();
  const View atty = lowp ? narrow.Slice(0, BT * C) : b.atty.view();
  const View ln2 = lowp ? narrow.Slice(0, BT * C) : b.ln2.view();
  const View gu = lowp ? wide.Slice(0, BT * 2 * F) : b.gu.view();
  // SwiGLU writes its kept copy itself (rounded as written in bf16 / f16 compute).
  const View h = Kept(b.h, BT * F);
  // x + attn(rmsnorm(x)): one GEMM for q, k and v; RoPE on q and k (H + KV heads) in place.
  // The Linear layers round their f32 inputs to the compute dtype themselves or read the kept
  // copies, so they read the values the kept copies hold.
  ops.RmsnormForward(cs, ln1, b.ln1_rstd.view(), x, ParamF32(p[t::kInNorm], 0), BT, C, eps);
  ops.MatmulForward(cs, qkv, ln1, block.Slice(fused.qkv, QKV * C), View{}, BT, C, QKV);
  ops.RopeForward(cs, qkv, B, T, QKV, H + KV, D, theta);
  KeepRounded(b.qkv, qkv, /*reread=*/true);
  ops.GqaAttentionForward(cs, atty, b.lse.view(), qkv, B, T, H, KV, D);
  KeepRounded(b.atty, atty, false);
  ops.MatmulForward(cs, proj, Kept(b.atty, BT * C), p[t::kO], View{}, BT, H * D, C);
  ops.Add(cs, b.resid2.view(), x, proj);
  // + down(silu(gate(.)) * up(.)) of rmsnorm(.): one GEMM for gate and up.
  ops.RmsnormForward(cs, ln2, b.ln2_rstd.view(), b.resid2.view(), ParamF32(p[t::kPostNorm], C),
                     BT, C, eps);
  ops.MatmulForward(cs, gu, ln2, block.Slice(fused.gate_up, 2 * F * C), View{}, BT, C, 2 * F);
  KeepRounded(b.gu, gu, /*reread=*/true);
  ops.SwigluForward(cs, h, gu, BT, F);
  ops.MatmulForward(cs, proj, h, p[t::kDown], View{}, BT, F, C);
  ops.Add(cs, a.resid[layer + 1].view(), b.resid2.view(), proj);
}

void Llama::RunForwardHead(View root, View targets) {
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  const auto p = Carve(root, LlamaRootDefs(config_));
  Activations& a = *acts_;
  ops.RmsnormForward(cs, a.lnf.view(), a.lnf_rstd.view(), a.resid[config_.num_layers].view(),
                     ParamF32(p[t::kNorm], 0), BT, C, config_.norm_eps);
  ops.MatmulForward(cs, a.logits.view(), a.lnf.view(), p[t::kLmHead], View{}, BT, C, V);
  if (targets.empty()) return;
  ops.SoftmaxCrossEntropyForward(cs, a.losses.view(), a.probs.view(), a.logits.view(), targets,
                                 BT, V);
  ops.Mean(cs, a.loss.view(), a.losses.view());
}

// ---- backward --------------------------------------------------------------------------------

absl::Status Llama::RunBackwardHead(View root, View droot, View targets, float loss_scale) {
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  const auto defs = LlamaRootDefs(config_);
  const auto p = Carve(root, defs);
  const auto g = Carve(droot, defs);
  Activations& a = *acts_;
  const View dlogits = a.logits.view();  // the logits are no longer needed
  FSDP_RETURN_IF_ERROR(Zero(dlogits));
  ops.SoftmaxCrossEntropyBackward(cs, dlogits, a.probs.view(), targets,
                                  loss_scale / static_cast<float>(BT), BT, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dln.view()));
  ops.MatmulBackward(cs, a.dln.view(), g[t::kLmHead], View{}, dlogits, a.lnf.view(),
                     p[t::kLmHead], BT, C, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dx.view()));
  ops.RmsnormBackward(cs, a.dx.view(), g[t::kNorm], a.dln.view(),
                      a.resid[config_.num_layers].view(), ParamF32(p[t::kNorm], 0),
                      a.lnf_rstd.view(), BT, C);
  return absl::OkStatus();
}

absl::Status Llama::RunBackwardBlock(int layer, View block, View dblock) {
  Ops& ops = backend_->ops();
  const Stream cs = Stream::kCompute;
  const auto defs = LlamaBlockDefs(config_);
  const auto p = Carve(block, defs);
  const auto g = Carve(dblock, defs);
  const Fused fused = FusedOffsets(config_);
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, F = config_.mlp_hidden;
  const int64_t H = config_.num_heads, KV = config_.num_kv_heads, D = config_.head_size();
  const int64_t QKV = config_.qkv_width();
  const bool lowp = compute_dtype() != DType::kF32;
  Activations& a = *acts_;
  BlockActs& b = Acts(layer);
  const View dx = a.dx.view();  // in: d resid[layer + 1]; out: d resid[layer]
  const View dln = a.dln.view();
  const View dbranch = a.dbranch.view();
  const View dh = dbranch.Slice(0, BT * F);  // mlp part
  const View dgu = dbranch.Slice(BT * F, BT * 2 * F);
  const View datty = dbranch.Slice(0, BT * C);  // attention part, once the mlp's are dead
  const View dqkv = dbranch.Slice(BT * C, BT * QKV);
  const View in_norm = ParamF32(p[t::kInNorm], 0), post_norm = ParamF32(p[t::kPostNorm], C);
  // An RMSNorm's output: kept in f32 compute, else recomputed (the same kernel on the same
  // input: the forward's values) into up32.
  auto norm = [&](const Buffer& kept, View inp, View w, const Buffer& rstd) {
    if (!lowp) return kept.view();
    const View out = a.up32.view().Slice(0, BT * C);
    ops.RmsnormForward(cs, out, rstd.view(), inp, w, BT, C, config_.norm_eps);
    return out;
  };
  // mlp: dx is also the gradient of its output (residual add)
  FSDP_RETURN_IF_ERROR(Zero(dh));
  ops.MatmulBackward(cs, dh, g[t::kDown], View{}, dx, Kept(b.h, BT * F), p[t::kDown], BT, F,
                     C);
  FSDP_RETURN_IF_ERROR(Zero(dgu));
  ops.SwigluBackward(cs, dgu, dh, Kept(b.gu, BT * 2 * F), BT, F);
  FSDP_RETURN_IF_ERROR(Zero(dln));
  ops.MatmulBackward(cs, dln, SliceOrEmpty(dblock, fused.gate_up, 2 * F * C), View{}, dgu,
                     norm(b.ln2, b.resid2.view(), post_norm, b.ln2_rstd),
                     block.Slice(fused.gate_up, 2 * F * C), BT, C, 2 * F);
  ops.RmsnormBackward(cs, dx, g[t::kPostNorm], dln, b.resid2.view(), post_norm,
                      b.ln2_rstd.view(), BT, C);
  // attention: dx is now d resid2, the gradient of the attention branch's output
  const View atty = Kept(b.atty, BT * C);
  FSDP_RETURN_IF_ERROR(Zero(datty));
  ops.MatmulBackward(cs, datty, g[t::kO], View{}, dx, atty, p[t::kO], BT, H * D, C);
  FSDP_RETURN_IF_ERROR(Zero(dqkv));
  ops.GqaAttentionBackward(cs, dqkv, datty, Kept(b.qkv, BT * QKV), atty, b.lse.view(), B, T, H,
                           KV, D);
  ops.RopeBackward(cs, dqkv, B, T, QKV, H + KV, D, config_.rope_theta);
  FSDP_RETURN_IF_ERROR(Zero(dln));
  ops.MatmulBackward(cs, dln, SliceOrEmpty(dblock, fused.qkv, QKV * C), View{}, dqkv,
                     norm(b.ln1, a.resid[layer].view(), in_norm, b.ln1_rstd),
                     block.Slice(fused.qkv, QKV * C), BT, C, QKV);
  ops.RmsnormBackward(cs, dx, g[t::kInNorm], dln, a.resid[layer].view(), in_norm,
                      b.ln1_rstd.view(), BT, C);
  return absl::OkStatus();
}

void Llama::RunBackwardEmbed(View droot, View idx) {
  const auto g = Carve(droot, LlamaRootDefs(config_));
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  backend_->ops().EmbeddingBackward(Stream::kCompute, g[t::kEmbed], acts_->dx.view(), idx, BT,
                                    C);
}

}  // namespace fsdp::nn
