// Helpers for the nn tests: a CPU backend bound to the test thread, and a model's parameter
// and gradient unit buffers.
#pragma once

#include <memory>
#include <vector>

#include "fsdp/backend.h"
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
};

}  // namespace fsdp::nn::testing
