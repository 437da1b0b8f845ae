// The tensors of a GPT unit, in flat-buffer order: the one definition that the parameter
// specs, the initialiser and the model's views of a flat buffer are all built from.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/nn/model.h"

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

// The spec of tensor `d` of unit `unit`, named prefix + d.name, at `offset` in the unit.
inline ParamSpec SpecOf(const std::string& prefix, const TensorDef& d, int unit,
                        int64_t offset) {
  ParamSpec s;
  s.name = prefix + d.name;
  s.shape = d.cols == 0 ? std::vector<int64_t>{d.rows} : std::vector<int64_t>{d.rows, d.cols};
  s.numel = d.numel();
  s.offset = offset;
  s.unit = unit;
  s.weight_decay = d.cols != 0;
  return s;
}

// All parameter specs of a model: the root unit's tensors named root_prefix + name, then, for
// each block i of `layers`, the block's tensors named block_prefix + i + "." + name.
template <size_t R, size_t K>
std::vector<ParamSpec> ModelSpecs(const std::string& root_prefix,
                                  const std::array<TensorDef, R>& root,
                                  const std::string& block_prefix,
                                  const std::array<TensorDef, K>& block, int layers) {
  std::vector<ParamSpec> specs;
  int64_t offset = 0;
  for (const TensorDef& d : root) {
    specs.push_back(SpecOf(root_prefix, d, 0, offset));
    offset += d.numel();
  }
  for (int i = 0; i < layers; ++i) {
    const std::string prefix = block_prefix + std::to_string(i) + ".";
    offset = 0;
    for (const TensorDef& d : block) {
      specs.push_back(SpecOf(prefix, d, 1 + i, offset));
      offset += d.numel();
    }
  }
  return specs;
}

// Each tensor of a unit's flat buffer as a view (dtype and all come from `flat`; an empty
// `flat` gives empty views: a gradient that is not computed).
template <size_t N>
std::array<View, N> Carve(const View& flat, const std::array<TensorDef, N>& defs) {
  std::array<View, N> out{};
  int64_t offset = 0;
  for (size_t i = 0; i < N; ++i) {
    if (!flat.empty()) out[i] = flat.Slice(offset, defs[i].numel());
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
