// The GPT model (MODEL_SPEC.md), llm.c style: each stage calls the forward or backward kernels
// of its layers in order through the backend's op table, on activations allocated at Create.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/nn/gpt.h"
#include "src/nn/gpt_layout.h"

namespace fsdp::nn {

using internal::BlockDefs;
using internal::Carve;
using internal::CarveTyped;
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
  Buffer lnf, lnf_mean, lnf_rstd, logits, probs, losses;
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
  FSDP_RETURN_IF_ERROR(backend->CopyFromHost(a.pos.data(), pos.data(), BT * sizeof(int32_t)));

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
const float* Gpt::logits() const { return acts_->logits.as<float>(); }

bool Gpt::layer_checkpointed(int i) const {
  return i >= 0 && static_cast<size_t>(i) < options_.checkpoint_layers.size() &&
         options_.checkpoint_layers[i];
}

Gpt::BlockActs& Gpt::Acts(int layer) const {
  return layer_checkpointed(layer) ? acts_->shared : acts_->blocks[layer];
}

absl::Status Gpt::Zero(float* p, int64_t n) const {
  return backend_->Memset(p, 0, static_cast<size_t>(n) * sizeof(float));
}

// ---- compute dtype -----------------------------------------------------------------------------

const float* Gpt::ParamF32(const void* p, int64_t n, int64_t slot) const {
  const DType d = compute_dtype();
  if (d == DType::kF32) return static_cast<const float*>(p);
  float* out = acts_->params32.as<float>() + slot;
  const Ops& ops = backend_->ops();
  if (d == DType::kBF16) {
    ops.cast_bf16_to_f32(out, static_cast<const uint16_t*>(p), n);
  } else {
    ops.cast_f16_to_f32(out, static_cast<const uint16_t*>(p), n);
  }
  return out;
}

void Gpt::LinearForward(float* out, const float* inp, const void* weight, const void* bias,
                        int64_t M, int64_t K, int64_t N) const {
  const Ops& ops = backend_->ops();
  if (compute_dtype() == DType::kF32) {
    ops.matmul_forward(out, inp, static_cast<const float*>(weight),
                       static_cast<const float*>(bias), M, K, N);
  } else {
    ops.matmul_forward_lowp(out, inp, weight, bias, M, K, N, compute_dtype());
  }
}

void Gpt::LinearBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                         const float* inp, const void* weight, int64_t M, int64_t K,
                         int64_t N) const {
  const Ops& ops = backend_->ops();
  if (compute_dtype() == DType::kF32) {
    ops.matmul_backward(dinp, dweight, dbias, dout, inp, static_cast<const float*>(weight), M, K,
                        N);
  } else {
    ops.matmul_backward_lowp(dinp, dweight, dbias, dout, inp, weight, M, K, N, compute_dtype());
  }
}

absl::Status Gpt::CheckTokens(const int32_t* tokens, const char* what) const {
  const int64_t n = static_cast<int64_t>(B_) * T_;
  std::vector<int32_t> host(n);
  FSDP_RETURN_IF_ERROR(backend_->CopyToHost(host.data(), tokens, n * sizeof(int32_t)));
  for (int64_t i = 0; i < n; ++i) {
    if (host[i] < 0 || host[i] >= config_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("Gpt: ", what, "[", i / T_, ", ", i % T_, "] = ", host[i],
                       " is not a token id in [0, ", config_.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

// ---- forward ---------------------------------------------------------------------------------

absl::Status Gpt::ForwardEmbed(const void* root, const int32_t* idx) {
  if (root == nullptr) return NullArgument("ForwardEmbed", "root");
  if (idx == nullptr) return NullArgument("ForwardEmbed", "idx");
  FSDP_RETURN_IF_ERROR(CheckTokens(idx, "idx"));
  const Ops& ops = backend_->ops();
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  const auto p = CarveTyped(root, DTypeSize(compute_dtype()),
                            RootDefs(V, config_.block_size, C));
  const float* wte = ParamF32(p[t::kWte], V * C, 0);
  const float* wpe = ParamF32(p[t::kWpe], T_ * C, V * C);  // positions 0..T-1 only
  Activations& a = *acts_;
  float* x = a.resid[0].as<float>();
  // x = wte[idx] + wpe[pos]
  ops.embedding_forward(x, idx, wte, BT, C);
  ops.embedding_forward(a.proj.as<float>(), a.pos.as<int32_t>(), wpe, BT, C);
  ops.residual_forward(x, x, a.proj.as<float>(), BT * C);
  idx_ = idx;
  forward_blocks_done_ = 0;
  head_done_ = false;
  backward_next_ = -2;
  a.shared_holds = -1;
  return absl::OkStatus();
}

absl::Status Gpt::ForwardBlock(int layer, const void* block) {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::OutOfRangeError(absl::StrCat("Gpt::ForwardBlock: layer ", layer,
                                              " is not in [0, ", config_.num_layers, ")"));
  }
  if (block == nullptr) return NullArgument("ForwardBlock", "block");
  if (forward_blocks_done_ < layer) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Gpt::ForwardBlock(", layer, "): its input is not computed yet (",
        forward_blocks_done_ < 0 ? std::string("call ForwardEmbed first")
                                 : absl::StrCat("next block is ", forward_blocks_done_),
        ")"));
  }
  const Ops& ops = backend_->ops();
  const auto p = CarveTyped(block, DTypeSize(compute_dtype()), BlockDefs(config_.channels));
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, NH = config_.num_heads;
  Activations& a = *acts_;
  BlockActs& b = Acts(layer);
  const float* x = a.resid[layer].as<float>();
  float* proj = a.proj.as<float>();
  const float* ln1w = ParamF32(p[t::kLn1W], C, 0);
  const float* ln1b = ParamF32(p[t::kLn1B], C, C);
  const float* ln2w = ParamF32(p[t::kLn2W], C, 2 * C);
  const float* ln2b = ParamF32(p[t::kLn2B], C, 3 * C);
  // x + attn(ln_1(x))
  ops.layernorm_forward(b.ln1.as<float>(), b.ln1_mean.as<float>(), b.ln1_rstd.as<float>(), x,
                        ln1w, ln1b, BT, C, 1e-5f);
  LinearForward(b.qkv.as<float>(), b.ln1.as<float>(), p[t::kAttnW], p[t::kAttnB], BT, C, 3 * C);
  ops.attention_forward(b.atty.as<float>(), b.att.as<float>(), b.qkv.as<float>(), B, T, C, NH);
  LinearForward(proj, b.atty.as<float>(), p[t::kAttnProjW], p[t::kAttnProjB], BT, C, C);
  ops.residual_forward(b.resid2.as<float>(), x, proj, BT * C);
  // + mlp(ln_2(.))
  ops.layernorm_forward(b.ln2.as<float>(), b.ln2_mean.as<float>(), b.ln2_rstd.as<float>(),
                        b.resid2.as<float>(), ln2w, ln2b, BT, C, 1e-5f);
  LinearForward(b.fch.as<float>(), b.ln2.as<float>(), p[t::kFcW], p[t::kFcB], BT, C, 4 * C);
  ops.gelu_forward(b.fch_gelu.as<float>(), b.fch.as<float>(), BT * 4 * C);
  LinearForward(proj, b.fch_gelu.as<float>(), p[t::kFcProjW], p[t::kFcProjB], BT, 4 * C, C);
  ops.residual_forward(a.resid[layer + 1].as<float>(), b.resid2.as<float>(), proj, BT * C);
  forward_blocks_done_ = std::max(forward_blocks_done_, layer + 1);
  if (layer_checkpointed(layer)) a.shared_holds = layer;
  return absl::OkStatus();
}

absl::StatusOr<float> Gpt::ForwardHead(const void* root, const int32_t* targets) {
  if (root == nullptr) return NullArgument("ForwardHead", "root");
  if (forward_blocks_done_ < config_.num_layers) {
    return absl::FailedPreconditionError(
        "Gpt::ForwardHead: run ForwardEmbed and every ForwardBlock first");
  }
  if (targets != nullptr) FSDP_RETURN_IF_ERROR(CheckTokens(targets, "targets"));
  const Ops& ops = backend_->ops();
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  const auto p = CarveTyped(root, DTypeSize(compute_dtype()),
                            RootDefs(V, config_.block_size, C));
  Activations& a = *acts_;
  ops.layernorm_forward(a.lnf.as<float>(), a.lnf_mean.as<float>(), a.lnf_rstd.as<float>(),
                        a.resid[config_.num_layers].as<float>(), ParamF32(p[t::kLnfW], C, 0),
                        ParamF32(p[t::kLnfB], C, C), BT, C, 1e-5f);
  // The lm_head is tied to wte: logits = ln_f(x) wte^T.
  LinearForward(a.logits.as<float>(), a.lnf.as<float>(), p[t::kWte], nullptr, BT, C, V);
  targets_ = targets;
  head_done_ = targets != nullptr;
  backward_next_ = -2;
  if (targets == nullptr) return 0.0f;
  ops.softmax_crossentropy_forward(a.losses.as<float>(), a.probs.as<float>(),
                                   a.logits.as<float>(), targets, BT, V);
  std::vector<float> losses(BT);
  FSDP_RETURN_IF_ERROR(
      backend_->CopyToHost(losses.data(), a.losses.data(), BT * sizeof(float)));
  double sum = 0;
  for (float l : losses) sum += l;
  return static_cast<float>(sum / static_cast<double>(BT));
}

// ---- backward --------------------------------------------------------------------------------

absl::Status Gpt::BackwardHead(const void* root, float* droot, float loss_scale) {
  if (root == nullptr) return NullArgument("BackwardHead", "root");
  if (!(loss_scale > 0.0f) || !std::isfinite(loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gpt::BackwardHead: loss_scale must be finite and > 0, got ", loss_scale));
  }
  if (!head_done_) {
    return absl::FailedPreconditionError(
        "Gpt::BackwardHead: no ForwardHead with targets since the last backward");
  }
  const Ops& ops = backend_->ops();
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  const auto defs = RootDefs(V, config_.block_size, C);
  const auto p = CarveTyped(root, DTypeSize(compute_dtype()), defs);
  const auto g = Carve(droot, defs);
  Activations& a = *acts_;
  float* dlogits = a.logits.as<float>();  // the logits are no longer needed
  FSDP_RETURN_IF_ERROR(Zero(dlogits, BT * V));
  ops.softmax_crossentropy_backward(dlogits, a.probs.as<float>(), targets_,
                                    loss_scale / static_cast<float>(BT), BT, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dln.as<float>(), BT * C));
  LinearBackward(a.dln.as<float>(), g[t::kWte], nullptr, dlogits, a.lnf.as<float>(), p[t::kWte],
                 BT, C, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dx.as<float>(), BT * C));
  ops.layernorm_backward(a.dx.as<float>(), g[t::kLnfW], g[t::kLnfB], a.dln.as<float>(),
                         a.resid[config_.num_layers].as<float>(), ParamF32(p[t::kLnfW], C, 0),
                         a.lnf_mean.as<float>(), a.lnf_rstd.as<float>(), BT, C);
  head_done_ = false;
  backward_next_ = config_.num_layers - 1;
  return absl::OkStatus();
}

absl::Status Gpt::BackwardBlock(int layer, const void* block, float* dblock) {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::OutOfRangeError(absl::StrCat("Gpt::BackwardBlock: layer ", layer,
                                              " is not in [0, ", config_.num_layers, ")"));
  }
  if (block == nullptr) return NullArgument("BackwardBlock", "block");
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
  const Ops& ops = backend_->ops();
  const auto defs = BlockDefs(config_.channels);
  const auto p = CarveTyped(block, DTypeSize(compute_dtype()), defs);
  const auto g = Carve(dblock, defs);
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, NH = config_.num_heads;
  BlockActs& b = Acts(layer);
  float* dx = a.dx.as<float>();  // in: d resid[layer + 1]; out: d resid[layer]
  float* dln = a.dln.as<float>();
  float* dfch_gelu = a.dbranch.as<float>();  // mlp part
  float* dfch = dfch_gelu + BT * 4 * C;
  float* datty = a.dbranch.as<float>();  // attention part, after the mlp's are dead
  float* dqkv = datty + BT * C;
  // mlp: dx is also the gradient of its output (residual add)
  FSDP_RETURN_IF_ERROR(Zero(dfch_gelu, BT * 4 * C));
  LinearBackward(dfch_gelu, g[t::kFcProjW], g[t::kFcProjB], dx, b.fch_gelu.as<float>(),
                 p[t::kFcProjW], BT, 4 * C, C);
  FSDP_RETURN_IF_ERROR(Zero(dfch, BT * 4 * C));
  ops.gelu_backward(dfch, b.fch.as<float>(), dfch_gelu, BT * 4 * C);
  FSDP_RETURN_IF_ERROR(Zero(dln, BT * C));
  LinearBackward(dln, g[t::kFcW], g[t::kFcB], dfch, b.ln2.as<float>(), p[t::kFcW], BT, C, 4 * C);
  ops.layernorm_backward(dx, g[t::kLn2W], g[t::kLn2B], dln, b.resid2.as<float>(),
                         ParamF32(p[t::kLn2W], C, 0), b.ln2_mean.as<float>(),
                         b.ln2_rstd.as<float>(), BT, C);
  // attention: dx is now d resid2, the gradient of the attention branch's output
  FSDP_RETURN_IF_ERROR(Zero(datty, BT * C));
  LinearBackward(datty, g[t::kAttnProjW], g[t::kAttnProjB], dx, b.atty.as<float>(),
                 p[t::kAttnProjW], BT, C, C);
  FSDP_RETURN_IF_ERROR(Zero(dqkv, BT * 3 * C));
  ops.attention_backward(dqkv, datty, b.qkv.as<float>(), b.att.as<float>(), B, T, C, NH);
  FSDP_RETURN_IF_ERROR(Zero(dln, BT * C));
  LinearBackward(dln, g[t::kAttnW], g[t::kAttnB], dqkv, b.ln1.as<float>(), p[t::kAttnW], BT, C,
                 3 * C);
  ops.layernorm_backward(dx, g[t::kLn1W], g[t::kLn1B], dln, a.resid[layer].as<float>(),
                         ParamF32(p[t::kLn1W], C, 0), b.ln1_mean.as<float>(),
                         b.ln1_rstd.as<float>(), BT, C);
  backward_next_ = layer - 1;
  return absl::OkStatus();
}

absl::Status Gpt::BackwardEmbed(float* droot) {
  if (backward_next_ != -1) {
    return absl::FailedPreconditionError(
        "Gpt::BackwardEmbed: run BackwardHead and every BackwardBlock first");
  }
  backward_next_ = -2;
  if (droot == nullptr) return absl::OkStatus();
  const Ops& ops = backend_->ops();
  const auto g = Carve(droot, RootDefs(config_.vocab_size, config_.block_size, config_.channels));
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  Activations& a = *acts_;
  // wte also received the lm_head's gradient in BackwardHead: the two add up.
  ops.embedding_backward(g[t::kWte], a.dx.as<float>(), idx_, BT, C);
  ops.embedding_backward(g[t::kWpe], a.dx.as<float>(), a.pos.as<int32_t>(), BT, C);
  return absl::OkStatus();
}

// ---- whole model -----------------------------------------------------------------------------

absl::StatusOr<float> Gpt::Forward(const std::vector<const void*>& units, const int32_t* idx,
                                   const int32_t* targets) {
  if (static_cast<int>(units.size()) != num_units()) {
    return absl::InvalidArgumentError(absl::StrCat("Gpt::Forward: got ", units.size(),
                                                   " unit buffers, the model has ", num_units()));
  }
  FSDP_RETURN_IF_ERROR(ForwardEmbed(units[0], idx));
  for (int i = 0; i < config_.num_layers; ++i) FSDP_RETURN_IF_ERROR(ForwardBlock(i, units[1 + i]));
  return ForwardHead(units[0], targets);
}

absl::StatusOr<float> Gpt::Forward(const std::vector<const float*>& units, const int32_t* idx,
                                   const int32_t* targets) {
  return Forward(std::vector<const void*>(units.begin(), units.end()), idx, targets);
}

absl::Status Gpt::Backward(const std::vector<const void*>& units,
                           const std::vector<float*>& grads, float loss_scale) {
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

absl::Status Gpt::Backward(const std::vector<const float*>& units,
                           const std::vector<float*>& grads, float loss_scale) {
  return Backward(std::vector<const void*>(units.begin(), units.end()), grads, loss_scale);
}

}  // namespace fsdp::nn
