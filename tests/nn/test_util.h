// Helpers for the nn tests: a CPU backend bound to the test thread, a model's parameter and
// gradient unit buffers, and their bf16/f16 copies for mixed-precision models.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/dtype.h"
#include "fsdp/nn/gpt.h"
#include "gtest/gtest.h"

namespace fsdp::nn::testing {

inline std::unique_ptr<CpuBackend> MakeCpuBackend(int threads = 0) {
  auto backend = CpuBackend::Create({.num_threads = threads});
  EXPECT_TRUE(backend.ok()) << backend.status();
  (*backend)->BindCurrentThread();
  return std::move(*backend);
}

// One flat parameter buffer and one gradient buffer per unit. The CPU backend's memory is
// host memory, so tests read and write it directly.
struct UnitBuffers {
  std::vector<Buffer> params, grads;

  static UnitBuffers Create(Backend* backend, const GptConfig& config) {
    UnitBuffers u;
    for (int i = 0; i < GptNumUnits(config); ++i) {
      const size_t bytes = GptUnitNumel(config, i) * sizeof(float);
      u.params.push_back(*Buffer::Create(backend, bytes));
      u.grads.push_back(*Buffer::Create(backend, bytes));
    }
    u.ZeroGrads();
    return u;
  }
  void Init(const GptConfig& config, uint64_t seed) {
    for (size_t i = 0; i < params.size(); ++i) {
      InitUnit(config, static_cast<int>(i), seed, params[i].as<float>());
    }
  }
  void ZeroGrads() {
    for (Buffer& g : grads) std::fill_n(g.as<float>(), g.bytes() / sizeof(float), 0.0f);
  }
  std::vector<const float*> param_ptrs() const {
    std::vector<const float*> p;
    for (const Buffer& b : params) p.push_back(b.as<float>());
    return p;
  }
  std::vector<float*> grad_ptrs() const {
    std::vector<float*> p;
    for (const Buffer& b : grads) p.push_back(b.as<float>());
    return p;
  }
  // A copy of every gradient, unit by unit.
  std::vector<std::vector<float>> grad_values() const {
    std::vector<std::vector<float>> out;
    for (const Buffer& b : grads) {
      const float* p = b.as<float>();
      out.emplace_back(p, p + b.bytes() / sizeof(float));
    }
    return out;
  }
};

// The parameters of a UnitBuffers in a compute dtype (f32: a plain copy), as a mixed-precision
// step casts its f32 master weights before the forward.
struct LowpUnits {
  DType dtype = DType::kF32;
  std::vector<Buffer> params;

  static LowpUnits Create(Backend* backend, const GptConfig& config, DType dtype) {
    LowpUnits u;
    u.dtype = dtype;
    for (int i = 0; i < GptNumUnits(config); ++i) {
      u.params.push_back(*Buffer::Create(backend, GptUnitNumel(config, i) * DTypeSize(dtype)));
    }
    return u;
  }
  void CastFrom(const Backend& backend, const UnitBuffers& master) {
    const Ops& ops = backend.ops();
    for (size_t i = 0; i < params.size(); ++i) {
      const float* src = master.params[i].as<float>();
      const int64_t n = static_cast<int64_t>(master.params[i].bytes() / sizeof(float));
      switch (dtype) {
        case DType::kF32: std::copy_n(src, n, params[i].as<float>()); break;
        case DType::kBF16: ops.cast_f32_to_bf16(params[i].as<uint16_t>(), src, n); break;
        case DType::kF16: ops.cast_f32_to_f16(params[i].as<uint16_t>(), src, n); break;
        default: break;
      }
    }
  }
  std::vector<const void*> ptrs() const {
    std::vector<const void*> p;
    for (const Buffer& b : params) p.push_back(b.data());
    return p;
  }
};

// n token ids in [0, V), a function of the seed.
inline std::vector<int32_t> RandomTokens(int n, int V, uint64_t seed) {
  std::mt19937 rng(static_cast<unsigned>(seed));
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % V);
  return t;
}

}  // namespace fsdp::nn::testing
