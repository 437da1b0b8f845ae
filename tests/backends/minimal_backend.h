// A runtime-only backend written from scratch against the device contract, as small as one can
// be: host memory from the allocator, streams that run each call at once (every event is
// complete), the host data plane (MakeHostDataPlane), and the eight runtime ops (RuntimeOps)
// with the CPU reference kernels. It has no model ops (model_ops() is nullptr): it trains a
// framework's own model through the sharding runtime's hooks, which is what docs/backends.md's
// checklist shows. A device backend differs in where the bytes live and in running the streams
// asynchronously; the interface is the same.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "fsdp/backend.h"
#include "fsdp/data_plane.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/ops.h"

namespace fsdp::testing {

class MinimalOps final : public RuntimeOps {
 public:
  void Cast(Stream, View out, View in) override {
    const int64_t n = in.count;
    if (out.dtype == in.dtype) {
      std::memmove(out.host(), in.host(), static_cast<size_t>(in.bytes()));
    } else if (in.dtype == DType::kF32 && out.dtype == DType::kBF16) {
      kernels::cpu::cast_f32_to_bf16(out.host_as<uint16_t>(), in.host_as<float>(), n);
    } else if (in.dtype == DType::kF32 && out.dtype == DType::kF16) {
      kernels::cpu::cast_f32_to_f16(out.host_as<uint16_t>(), in.host_as<float>(), n);
    } else if (in.dtype == DType::kBF16 && out.dtype == DType::kF32) {
      kernels::cpu::cast_bf16_to_f32(out.host_as<float>(), in.host_as<uint16_t>(), n);
    } else if (in.dtype == DType::kF16 && out.dtype == DType::kF32) {
      kernels::cpu::cast_f16_to_f32(out.host_as<float>(), in.host_as<uint16_t>(), n);
    }
  }
  void Add(Stream, View out, View a, View b) override {
    kernels::cpu::residual_forward(out.host_as<float>(), a.host_as<float>(), b.host_as<float>(),
                                   out.count);
  }
  void ScaleBy(Stream, View x, View factor) override {
    const float f = *factor.host_as<float>();
    if (f != 1.0f) kernels::cpu::scale_inplace(x.host_as<float>(), f, x.count);
  }
  void Scale(Stream, View x, float factor) override {
    kernels::cpu::scale_inplace(x.host_as<float>(), factor, x.count);
  }
  void AdamW(Stream, View param, View grad, View m, View v, const AdamWScalars& k) override {
    kernels::cpu::adamw_update(param.host_as<float>(), grad.host_as<float>(), m.host_as<float>(),
                               v.host_as<float>(), param.count, k);
  }
  void Sgd(Stream, View param, View grad, View momentum_buf, float lr, float momentum,
           float dampening, float weight_decay, bool nesterov, bool first_step) override {
    kernels::cpu::sgd_update(param.host_as<float>(), grad.host_as<float>(),
                             momentum_buf.host_as<float>(), param.count, lr, momentum, dampening,
                             weight_decay, nesterov, first_step);
  }
  void SumSquares(Stream, View out, View x) override {
    *out.host_as<double>() += kernels::cpu::sum_squares(x.host_as<float>(), x.count);
  }
  void SplitF64(Stream, View out, View in) override {
    const double v = *in.host_as<double>();
    float* o = out.host_as<float>();
    o[0] = static_cast<float>(v);
    o[1] = static_cast<float>(v - o[0]);
  }
  void GlobalNormClip(Stream, View total_sq, View factor, View partials, double k,
                      float max_norm) override {
    const bool wide = partials.dtype == DType::kF64;
    const int64_t n = wide ? partials.count : partials.count / 2;
    double sum = 0;
    for (int64_t r = 0; r < n; ++r) {
      sum += wide ? partials.host_as<double>()[r]
                  : static_cast<double>(partials.host_as<float>()[2 * r]) +
                        partials.host_as<float>()[2 * r + 1];
    }
    *total_sq.host_as<double>() = sum;
    *factor.host_as<float>() = static_cast<float>(ClipCoefficient(std::sqrt(sum) / k, max_norm) / k);
  }
};

class MinimalBackend final : public Backend {
 public:
  std::string_view name() const override { return "minimal"; }
  bool is_host() const override { return true; }

  absl::StatusOr<Allocation> Allocate(size_t bytes) override {
    const size_t rounded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("minimal: cannot allocate ", bytes, " bytes"));
    }
    const int64_t now = in_use_.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    allocs_.fetch_add(1);
    return Allocation{p, p, bytes};
  }
  // The streams have run everything issued: the bytes can go back at once.
  void Free(const Allocation& a) override {
    std::free(a.storage);
    in_use_.fetch_sub(static_cast<int64_t>(a.bytes));
  }
  MemoryStats memory_stats() const override { return {in_use_.load(), peak_.load(), allocs_.load()}; }
  void ResetPeak() override { peak_.store(in_use_.load()); }

  absl::Status CopyFromHost(View dst, const void* src, Stream) override {
    std::memcpy(dst.host(), src, static_cast<size_t>(dst.bytes()));
    return absl::OkStatus();
  }
  absl::Status Copy(View dst, View src, Stream) override {
    std::memmove(dst.host(), src.host(), static_cast<size_t>(src.bytes()));
    return absl::OkStatus();
  }
  absl::Status Memset(View dst, int byte, Stream) override {
    std::memset(dst.host(), byte, static_cast<size_t>(dst.bytes()));
    return absl::OkStatus();
  }
  // Synchronous streams: the work issued so far has run, so the event is complete (empty).
  Event Record(Stream) override { return Event(); }
  // A collective's event may still be pending: a synchronous stream waits for it here.
  absl::Status Wait(Stream, const Event& e) override { return e.Wait(); }

  RuntimeOps& runtime_ops() override { return ops_; }
  absl::StatusOr<std::unique_ptr<DataPlane>> CreateDataPlane(Communicator& group) override {
    return MakeHostDataPlane(this, group);
  }

 protected:
  absl::Status DoCopyToHost(void* dst, View src, Stream) override {
    std::memcpy(dst, src.host(), static_cast<size_t>(src.bytes()));
    return absl::OkStatus();
  }

 private:
  MinimalOps ops_;
  std::atomic<int64_t> in_use_{0}, peak_{0}, allocs_{0};
};

}  // namespace fsdp::testing
