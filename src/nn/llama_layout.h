// The tensors of a Llama unit, in flat-buffer order (TensorDef and Carve of gpt_layout.h).
// q, k and v are consecutive, and so are gate and up: each pair is one [out, C] matrix that a
// single GEMM multiplies.
#pragma once

#include <array>
#include <cstdint>

#include "fsdp/nn/llama.h"
#include "src/nn/gpt_layout.h"

namespace fsdp::nn::internal {

enum LlamaRootTensor { kEmbed, kNorm, kLmHead, kNumLlamaRootTensors };
enum LlamaBlockTensor {
  kInNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown, kNumLlamaBlockTensors
};

// Names are suffixes after "" (root) or "model.layers.{i}." (block).
inline std::array<TensorDef, kNumLlamaRootTensors> LlamaRootDefs(const LlamaConfig& c) {
  return {{{"model.embed_tokens.weight", c.vocab_size, c.channels},
           {"model.norm.weight", c.channels, 0},
           {"lm_head.weight", c.vocab_size, c.channels}}};
}

inline std::array<TensorDef, kNumLlamaBlockTensors> LlamaBlockDefs(const LlamaConfig& c) {
  const int64_t C = c.channels, D = c.head_size(), F = c.mlp_hidden;
  const int64_t HD = static_cast<int64_t>(c.num_heads) * D;
  const int64_t KVD = static_cast<int64_t>(c.num_kv_heads) * D;
  return {{{"input_layernorm.weight", C, 0},
           {"self_attn.q_proj.weight", HD, C},
           {"self_attn.k_proj.weight", KVD, C},
           {"self_attn.v_proj.weight", KVD, C},
           {"self_attn.o_proj.weight", C, HD},
           {"post_attention_layernorm.weight", C, 0},
           {"mlp.gate_proj.weight", F, C},
           {"mlp.up_proj.weight", F, C},
           {"mlp.down_proj.weight", C, F}}};
}

}  // namespace fsdp::nn::internal
