// Helpers for the nn tests: a CPU backend bound to the test thread, a model's parameter and
// gradient unit buffers, and their bf16/f16 copies for mixed-precision models.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/dtype.h"
#include "fsdp/ops.h"
#include "fsdp/nn/model_config.h"
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

  static UnitBuffers Create(Backend* backend, const ModelConfig& config) {
    UnitBuffers u;
    for (int i = 0; i < config.num_units(); ++i) {
      const size_t bytes = config.UnitNumel(i) * sizeof(float);
      u.params.push_back(*Buffer::Create(backend, bytes));
      u.grads.push_back(*Buffer::Create(backend, bytes));
    }
    u.ZeroGrads();
    return u;
  }
  void Init(const ModelConfig& config, uint64_t seed) {
    for (const ParamSpec& s : config.ParamSpecs()) {
      config.InitParamSlice(s, seed, 0, s.numel, params[s.unit].as<float>() + s.offset);
    }
  }
  void ZeroGrads() {
    for (Buffer& g : grads) std::fill_n(g.as<float>(), g.bytes() / sizeof(float), 0.0f);
  }
  std::vector<View> param_views() const {
    std::vector<View> p;
    for (const Buffer& b : params) p.push_back(b.view());
    return p;
  }
  std::vector<View> grad_views() const {
    std::vector<View> p;
    for (const Buffer& b : grads) p.push_back(b.view());
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

  static LowpUnits Create(Backend* backend, const ModelConfig& config, DType dtype) {
    LowpUnits u;
    u.dtype = dtype;
    for (int i = 0; i < config.num_units(); ++i) {
      u.params.push_back(*Buffer::Create(backend, config.UnitNumel(i) * DTypeSize(dtype)));
    }
    return u;
  }
  void CastFrom(Backend& backend, const UnitBuffers& master) {
    for (size_t i = 0; i < params.size(); ++i) {
      backend.ops().Cast(Stream::kCompute, params[i].view(dtype), master.params[i].view());
    }
  }
  std::vector<View> views() const {
    std::vector<View> p;
    for (const Buffer& b : params) p.push_back(b.view(dtype));
    return p;
  }
};

// A host vector of token ids as an i32 view of the (host) backend.
// The model only reads token ids.
template <typename BackendPtr>  // Backend* or a smart pointer to one
inline View I32(const BackendPtr& backend, const std::vector<int32_t>& v) {
  return *WrapHostMemory(&*backend, const_cast<int32_t*>(v.data()), static_cast<int64_t>(v.size()),
                         DType::kI32);
}

// A host vector of floats as an f32 view of the (host) backend.
template <typename BackendPtr>
inline View F32(const BackendPtr& backend, std::vector<float>& v) {
  return *WrapHostMemory(&*backend, v.data(), static_cast<int64_t>(v.size()), DType::kF32);
}
template <typename BackendPtr>
inline View F32(const BackendPtr& backend, const std::vector<float>& v) {
  return F32(backend, const_cast<std::vector<float>&>(v));  // only read through
}

// n token ids in [0, V), a function of the seed.
inline std::vector<int32_t> RandomTokens(int n, int V, uint64_t seed) {
  std::mt19937 rng(static_cast<unsigned>(seed));
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % V);
  return t;
}

}  // namespace fsdp::nn::testing
