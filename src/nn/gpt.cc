// The GPT model (MODEL_SPEC.md), llm.c style: each stage calls the forward or backward kernels
// of its layers in order through the backend's op table, on activations allocated at Create.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/nn/gpt.h"
#include "src/nn/gpt_layout.h"

namespace fsdp::nn {

using internal::BlockDefs;
using internal::Carve;
using internal::RootDefs;
namespace t = internal;

// Activations of one B x T step. Per block, everything its backward reads is kept (llm.c
// style), so all forwards can run before all backwards.
struct Gpt::Activations {
  struct Block {
    Buffer ln1, ln1_mean, ln1_rstd, qkv, atty, att, resid2, ln2, ln2_mean, ln2_rstd, fch,
        fch_gelu;
  };
  Buffer pos;                 // [B*T] int32 position of each token, for the wpe lookup
  std::vector<Buffer> resid;  // L+1 x [B,T,C]: resid[i] is the input of block i
  std::vector<Block> blocks;
  Buffer proj;  // [B,T,C] output of a c_proj, consumed at once by the residual add
  Buffer lnf, lnf_mean, lnf_rstd, logits, probs, losses;
  // Gradient scratch, reused by every block. dx is the gradient of the residual stream: the
  // residual adds pass it through unchanged, so one buffer accumulates it across blocks.
  Buffer dx, dln, datty, dqkv, dfch, dfch_gelu;
  int64_t bytes = 0;
};

namespace {

// Allocates every buffer of `acts` on `backend` (n floats each, or n int32).
class Allocator {
 public:
  explicit Allocator(Backend* backend, int64_t* bytes) : backend_(backend), bytes_(bytes) {}
  absl::Status operator()(Buffer& b, int64_t n) {
    auto r = Buffer::Create(backend_, static_cast<size_t>(n) * sizeof(float));
    if (!r.ok()) return r.status();
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

}  // namespace

Gpt::Gpt(GptConfig config, Backend* backend, int B, int T)
    : config_(std::move(config)), backend_(backend), B_(B), T_(T),
      specs_(GptParamSpecs(config_)), acts_(std::make_unique<Activations>()) {}

Gpt::~Gpt() = default;

absl::StatusOr<std::unique_ptr<Gpt>> Gpt::Create(const GptConfig& config, Backend* backend,
                                                 int B, int T) {
  FSDP_RETURN_IF_ERROR(config.Validate());
  if (backend == nullptr) return absl::InvalidArgumentError("Gpt::Create: backend is null");
  if (B <= 0 || T <= 0 || T > config.block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gpt::Create: need B >= 1 and 1 <= T <= block_size (", config.block_size,
                     "), got B=", B, " T=", T));
  }
  std::unique_ptr<Gpt> gpt(new Gpt(config, backend, B, T));
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
  a.blocks.resize(L);
  for (Activations::Block& b : a.blocks) {
    for (Buffer* buf : {&b.ln1, &b.atty, &b.resid2, &b.ln2}) {
      FSDP_RETURN_IF_ERROR(alloc(*buf, BT * C));
    }
    for (Buffer* buf : {&b.ln1_mean, &b.ln1_rstd, &b.ln2_mean, &b.ln2_rstd}) {
      FSDP_RETURN_IF_ERROR(alloc(*buf, BT));
    }
    FSDP_RETURN_IF_ERROR(alloc(b.qkv, BT * 3 * C));
    FSDP_RETURN_IF_ERROR(alloc(b.att, B * NH * T * T));
    FSDP_RETURN_IF_ERROR(alloc(b.fch, BT * 4 * C));
    FSDP_RETURN_IF_ERROR(alloc(b.fch_gelu, BT * 4 * C));
  }
  for (Buffer* buf : {&a.proj, &a.lnf, &a.dx, &a.dln, &a.datty}) {
    FSDP_RETURN_IF_ERROR(alloc(*buf, BT * C));
  }
  for (Buffer* buf : {&a.lnf_mean, &a.lnf_rstd, &a.losses}) FSDP_RETURN_IF_ERROR(alloc(*buf, BT));
  FSDP_RETURN_IF_ERROR(alloc(a.logits, BT * V));
  FSDP_RETURN_IF_ERROR(alloc(a.probs, BT * V));
  FSDP_RETURN_IF_ERROR(alloc(a.dqkv, BT * 3 * C));
  FSDP_RETURN_IF_ERROR(alloc(a.dfch, BT * 4 * C));
  FSDP_RETURN_IF_ERROR(alloc(a.dfch_gelu, BT * 4 * C));
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

absl::Status Gpt::Zero(float* p, int64_t n) const {
  return backend_->Memset(p, 0, static_cast<size_t>(n) * sizeof(float));
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

absl::Status Gpt::ForwardEmbed(const float* root, const int32_t* idx) {
  if (root == nullptr) return NullArgument("ForwardEmbed", "root");
  if (idx == nullptr) return NullArgument("ForwardEmbed", "idx");
  FSDP_RETURN_IF_ERROR(CheckTokens(idx, "idx"));
  const Ops& ops = backend_->ops();
  const auto p = Carve(root, RootDefs(config_.vocab_size, config_.block_size, config_.channels));
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  Activations& a = *acts_;
  float* x = a.resid[0].as<float>();
  // x = wte[idx] + wpe[pos]
  ops.embedding_forward(x, idx, p[t::kWte], BT, C);
  ops.embedding_forward(a.proj.as<float>(), a.pos.as<int32_t>(), p[t::kWpe], BT, C);
  ops.residual_forward(x, x, a.proj.as<float>(), BT * C);
  idx_ = idx;
  forward_blocks_done_ = 0;
  head_done_ = false;
  backward_next_ = -2;
  return absl::OkStatus();
}

absl::Status Gpt::ForwardBlock(int layer, const float* block) {
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
  const auto p = Carve(block, BlockDefs(config_.channels));
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, NH = config_.num_heads;
  Activations& a = *acts_;
  Activations::Block& b = a.blocks[layer];
  const float* x = a.resid[layer].as<float>();
  float* proj = a.proj.as<float>();
  // x + attn(ln_1(x))
  ops.layernorm_forward(b.ln1.as<float>(), b.ln1_mean.as<float>(), b.ln1_rstd.as<float>(), x,
                        p[t::kLn1W], p[t::kLn1B], BT, C, 1e-5f);
  ops.matmul_forward(b.qkv.as<float>(), b.ln1.as<float>(), p[t::kAttnW], p[t::kAttnB], BT, C,
                     3 * C);
  ops.attention_forward(b.atty.as<float>(), b.att.as<float>(), b.qkv.as<float>(), B, T, C, NH);
  ops.matmul_forward(proj, b.atty.as<float>(), p[t::kAttnProjW], p[t::kAttnProjB], BT, C, C);
  ops.residual_forward(b.resid2.as<float>(), x, proj, BT * C);
  // + mlp(ln_2(.))
  ops.layernorm_forward(b.ln2.as<float>(), b.ln2_mean.as<float>(), b.ln2_rstd.as<float>(),
                        b.resid2.as<float>(), p[t::kLn2W], p[t::kLn2B], BT, C, 1e-5f);
  ops.matmul_forward(b.fch.as<float>(), b.ln2.as<float>(), p[t::kFcW], p[t::kFcB], BT, C, 4 * C);
  ops.gelu_forward(b.fch_gelu.as<float>(), b.fch.as<float>(), BT * 4 * C);
  ops.matmul_forward(proj, b.fch_gelu.as<float>(), p[t::kFcProjW], p[t::kFcProjB], BT, 4 * C, C);
  ops.residual_forward(a.resid[layer + 1].as<float>(), b.resid2.as<float>(), proj, BT * C);
  forward_blocks_done_ = std::max(forward_blocks_done_, layer + 1);
  return absl::OkStatus();
}

absl::StatusOr<float> Gpt::ForwardHead(const float* root, const int32_t* targets) {
  if (root == nullptr) return NullArgument("ForwardHead", "root");
  if (forward_blocks_done_ < config_.num_layers) {
    return absl::FailedPreconditionError(
        "Gpt::ForwardHead: run ForwardEmbed and every ForwardBlock first");
  }
  if (targets != nullptr) FSDP_RETURN_IF_ERROR(CheckTokens(targets, "targets"));
  const Ops& ops = backend_->ops();
  const auto p = Carve(root, RootDefs(config_.vocab_size, config_.block_size, config_.channels));
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  Activations& a = *acts_;
  ops.layernorm_forward(a.lnf.as<float>(), a.lnf_mean.as<float>(), a.lnf_rstd.as<float>(),
                        a.resid[config_.num_layers].as<float>(), p[t::kLnfW], p[t::kLnfB], BT,
                        C, 1e-5f);
  // The lm_head is tied to wte: logits = ln_f(x) wte^T.
  ops.matmul_forward(a.logits.as<float>(), a.lnf.as<float>(), p[t::kWte], nullptr, BT, C, V);
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

absl::Status Gpt::BackwardHead(const float* root, float* droot) {
  if (root == nullptr) return NullArgument("BackwardHead", "root");
  if (!head_done_) {
    return absl::FailedPreconditionError(
        "Gpt::BackwardHead: no ForwardHead with targets since the last backward");
  }
  const Ops& ops = backend_->ops();
  const auto defs = RootDefs(config_.vocab_size, config_.block_size, config_.channels);
  const auto p = Carve(root, defs);
  const auto g = Carve(droot, defs);
  const int64_t BT = static_cast<int64_t>(B_) * T_, C = config_.channels;
  const int64_t V = config_.vocab_size;
  Activations& a = *acts_;
  float* dlogits = a.logits.as<float>();  // the logits are no longer needed
  FSDP_RETURN_IF_ERROR(Zero(dlogits, BT * V));
  ops.softmax_crossentropy_backward(dlogits, a.probs.as<float>(), targets_,
                                    1.0f / static_cast<float>(BT), BT, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dln.as<float>(), BT * C));
  ops.matmul_backward(a.dln.as<float>(), g[t::kWte], nullptr, dlogits, a.lnf.as<float>(),
                      p[t::kWte], BT, C, V);
  FSDP_RETURN_IF_ERROR(Zero(a.dx.as<float>(), BT * C));
  ops.layernorm_backward(a.dx.as<float>(), g[t::kLnfW], g[t::kLnfB], a.dln.as<float>(),
                         a.resid[config_.num_layers].as<float>(), p[t::kLnfW],
                         a.lnf_mean.as<float>(), a.lnf_rstd.as<float>(), BT, C);
  head_done_ = false;
  backward_next_ = config_.num_layers - 1;
  return absl::OkStatus();
}

absl::Status Gpt::BackwardBlock(int layer, const float* block, float* dblock) {
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
  const Ops& ops = backend_->ops();
  const auto defs = BlockDefs(config_.channels);
  const auto p = Carve(block, defs);
  const auto g = Carve(dblock, defs);
  const int64_t B = B_, T = T_, BT = B * T, C = config_.channels, NH = config_.num_heads;
  Activations& a = *acts_;
  Activations::Block& b = a.blocks[layer];
  float* dx = a.dx.as<float>();  // in: d resid[layer + 1]; out: d resid[layer]
  float* dln = a.dln.as<float>();
  // mlp: dx is also the gradient of its output (residual add)
  FSDP_RETURN_IF_ERROR(Zero(a.dfch_gelu.as<float>(), BT * 4 * C));
  ops.matmul_backward(a.dfch_gelu.as<float>(), g[t::kFcProjW], g[t::kFcProjB], dx,
                      b.fch_gelu.as<float>(), p[t::kFcProjW], BT, 4 * C, C);
  FSDP_RETURN_IF_ERROR(Zero(a.dfch.as<float>(), BT * 4 * C));
  ops.gelu_backward(a.dfch.as<float>(), b.fch.as<float>(), a.dfch_gelu.as<float>(), BT * 4 * C);
  FSDP_RETURN_IF_ERROR(Zero(dln, BT * C));
  ops.matmul_backward(dln, g[t::kFcW], g[t::kFcB], a.dfch.as<float>(), b.ln2.as<float>(),
                      p[t::kFcW], BT, C, 4 * C);
  ops.layernorm_backward(dx, g[t::kLn2W], g[t::kLn2B], dln, b.resid2.as<float>(), p[t::kLn2W],
                         b.ln2_mean.as<float>(), b.ln2_rstd.as<float>(), BT, C);
  // attention: dx is now d resid2, the gradient of the attention branch's output
  FSDP_RETURN_IF_ERROR(Zero(a.datty.as<float>(), BT * C));
  ops.matmul_backward(a.datty.as<float>(), g[t::kAttnProjW], g[t::kAttnProjB], dx,
                      b.atty.as<float>(), p[t::kAttnProjW], BT, C, C);
  FSDP_RETURN_IF_ERROR(Zero(a.dqkv.as<float>(), BT * 3 * C));
  ops.attention_backward(a.dqkv.as<float>(), a.datty.as<float>(), b.qkv.as<float>(),
                         b.att.as<float>(), B, T, C, NH);
  FSDP_RETURN_IF_ERROR(Zero(dln, BT * C));
  ops.matmul_backward(dln, g[t::kAttnW], g[t::kAttnB], a.dqkv.as<float>(), b.ln1.as<float>(),
                      p[t::kAttnW], BT, C, 3 * C);
  ops.layernorm_backward(dx, g[t::kLn1W], g[t::kLn1B], dln, a.resid[layer].as<float>(),
                         p[t::kLn1W], b.ln1_mean.as<float>(), b.ln1_rstd.as<float>(), BT, C);
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

absl::StatusOr<float> Gpt::Forward(const std::vector<const float*>& units, const int32_t* idx,
                                   const int32_t* targets) {
  if (static_cast<int>(units.size()) != num_units()) {
    return absl::InvalidArgumentError(absl::StrCat("Gpt::Forward: got ", units.size(),
                                                   " unit buffers, the model has ", num_units()));
  }
  FSDP_RETURN_IF_ERROR(ForwardEmbed(units[0], idx));
  for (int i = 0; i < config_.num_layers; ++i) FSDP_RETURN_IF_ERROR(ForwardBlock(i, units[1 + i]));
  return ForwardHead(units[0], targets);
}

absl::Status Gpt::Backward(const std::vector<const float*>& units,
                           const std::vector<float*>& grads) {
  if (static_cast<int>(units.size()) != num_units() ||
      static_cast<int>(grads.size()) != num_units()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gpt::Backward: got ", units.size(), " unit and ", grads.size(),
                     " gradient buffers, the model has ", num_units(), " units"));
  }
  FSDP_RETURN_IF_ERROR(BackwardHead(units[0], grads[0]));
  for (int i = config_.num_layers - 1; i >= 0; --i) {
    FSDP_RETURN_IF_ERROR(BackwardBlock(i, units[1 + i], grads[1 + i]));
  }
  return BackwardEmbed(grads[0]);
}

}  // namespace fsdp::nn
