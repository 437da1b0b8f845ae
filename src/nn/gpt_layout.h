// The tensors of a GPT unit, in flat-buffer order: the one definition that the parameter
// specs, the initialiser and the model's views of a flat buffer are all built from.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace fsdp::nn::internal {

// A 2-D tensor [rows, cols], or a 1-D tensor [rows] when cols == 0.
struct TensorDef {
  const char* name;  // suffix after "transformer." (root) or "transformer.h.{i}." (block)
  int64_t rows, cols;
  int64_t numel() const { return cols == 0 ? rows : rows * cols; }
};

enum RootTensor { kWte, kWpe, kLnfW, kLnfB, kNumRootTensors };
enum BlockTensor {
  kLn1W, kLn1B, kAttnW, kAttnB, kAttnProjW, kAttnProjB,
  kLn2W, kLn2B, kFcW, kFcB, kFcProjW, kFcProjB, kNumBlockTensors
};

inline std::array<TensorDef, kNumRootTensors> RootDefs(int64_t V, int64_t T, int64_t C) {
  return {{{"wte.weight", V, C}, {"wpe.weight", T, C}, {"ln_f.weight", C, 0},
           {"ln_f.bias", C, 0}}};
}

inline std::array<TensorDef, kNumBlockTensors> BlockDefs(int64_t C) {
  return {{{"ln_1.weight", C, 0}, {"ln_1.bias", C, 0},
           {"attn.c_attn.weight", 3 * C, C}, {"attn.c_attn.bias", 3 * C, 0},
           {"attn.c_proj.weight", C, C}, {"attn.c_proj.bias", C, 0},
           {"ln_2.weight", C, 0}, {"ln_2.bias", C, 0},
           {"mlp.c_fc.weight", 4 * C, C}, {"mlp.c_fc.bias", 4 * C, 0},
           {"mlp.c_proj.weight", C, 4 * C}, {"mlp.c_proj.bias", C, 0}}};
}

// Pointers to each tensor of a flat buffer (F = float for gradients, const float for params).
template <typename F, size_t N>
std::array<F*, N> Carve(F* flat, const std::array<TensorDef, N>& defs) {
  std::array<F*, N> out{};
  int64_t offset = 0;
  for (size_t i = 0; i < N; ++i) {
    out[i] = flat == nullptr ? nullptr : flat + offset;
    offset += defs[i].numel();
  }
  return out;
}

// The same for parameters in the compute dtype: elements of `elem_bytes` bytes, at the same
// element offsets as in f32.
template <size_t N>
std::array<const void*, N> CarveTyped(const void* flat, size_t elem_bytes,
                                      const std::array<TensorDef, N>& defs) {
  std::array<const void*, N> out{};
  int64_t offset = 0;
  for (size_t i = 0; i < N; ++i) {
    out[i] = flat == nullptr ? nullptr
                             : static_cast<const char*>(flat) +
                                   offset * static_cast<int64_t>(elem_bytes);
    offset += defs[i].numel();
  }
  return out;
}

template <size_t N>
int64_t TotalNumel(const std::array<TensorDef, N>& defs) {
  int64_t n = 0;
  for (const auto& d : defs) n += d.numel();
  return n;
}

}  // namespace fsdp::nn::internal
