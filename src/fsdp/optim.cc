// AdamW and SGD over one flat buffer and its decay ranges, LR schedules, the clip coefficient.
#include "fsdp/optim.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "fsdp/ops.h"

namespace fsdp {
namespace {

// Sorted copy of `ranges` with empty ranges dropped and touching neighbours that have the same
// flag merged, so a unit of many tensors costs a few kernel calls, not one per tensor.
std::vector<DecayRange> Normalize(std::vector<DecayRange> ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const DecayRange& a, const DecayRange& b) { return a.begin < b.begin; });
  std::vector<DecayRange> out;
  for (const DecayRange& r : ranges) {
    if (r.begin == r.end) continue;
    if (!out.empty() && out.back().end == r.begin && out.back().weight_decay == r.weight_decay) {
      out.back().end = r.end;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

absl::StatusOr<Buffer> ZeroedState(Backend* backend, int64_t numel) {
  FSDP_ASSIGN_OR_RETURN(Buffer b, Buffer::Create(backend, static_cast<size_t>(numel) * 4));
  FSDP_RETURN_IF_ERROR(backend->Memset(b.view(), 0));
  return b;
}

}  // namespace

std::vector<DecayRange> SliceDecayRanges(const std::vector<DecayRange>& ranges, int64_t lo,
                                         int64_t hi) {
  std::vector<DecayRange> out;
  for (const DecayRange& r : ranges) {
    const int64_t b = std::max(r.begin, lo), e = std::min(r.end, hi);
    if (b < e) out.push_back({b - lo, e - lo, r.weight_decay});
  }
  return out;
}

absl::Status Optimizer::CheckViews(const View& param, const View& grad) const {
  if (param.count < numel_ || grad.count < numel_ || param.dtype != DType::kF32 ||
      grad.dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Optimizer::Step: param and grad must hold ", numel_, " f32 elements, got ",
        param.count, " ", std::string(DTypeName(param.dtype)), " and ", grad.count, " ",
        std::string(DTypeName(grad.dtype))));
  }
  return absl::OkStatus();
}

absl::Status Optimizer::ValidateRanges(const std::vector<DecayRange>& ranges, int64_t numel) {
  if (numel < 0) return absl::InvalidArgumentError(absl::StrCat("optimizer: numel ", numel));
  for (size_t i = 0; i < ranges.size(); ++i) {
    const DecayRange& r = ranges[i];
    if (r.begin < 0 || r.begin > r.end || r.end > numel) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer: decay range [", r.begin, ", ",
                                                     r.end, ") is not inside [0, ", numel, ")"));
    }
    if (i > 0 && r.begin < ranges[i - 1].end) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer: decay ranges overlap at element ", r.begin));
    }
  }
  return absl::OkStatus();
}

// ---- AdamW -----------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<AdamW>> AdamW::Create(Backend* backend, int64_t numel,
                                                     std::vector<DecayRange> ranges,
                                                     AdamWOptions options) {
  if (backend == nullptr) return absl::InvalidArgumentError("AdamW: backend is null");
  ranges = Normalize(std::move(ranges));
  FSDP_RETURN_IF_ERROR(ValidateRanges(ranges, numel));
  if (!(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1 &&
        options.eps >= 0 && std::isfinite(options.eps) && options.lr >= 0 &&
        std::isfinite(options.lr) && options.weight_decay >= 0 &&
        std::isfinite(options.weight_decay))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AdamW: need finite lr, eps, weight_decay >= 0 and betas in [0, 1); got lr=", options.lr,
        " betas=(", options.beta1, ", ", options.beta2, ") eps=", options.eps,
        " weight_decay=", options.weight_decay));
  }
  std::unique_ptr<AdamW> opt(new AdamW(backend, numel, std::move(ranges), options));
  FSDP_ASSIGN_OR_RETURN(opt->m_, ZeroedState(backend, numel));
  FSDP_ASSIGN_OR_RETURN(opt->v_, ZeroedState(backend, numel));
  return opt;
}

absl::Status AdamW::Step(View param, View grad) {
  FSDP_RETURN_IF_ERROR(CheckViews(param, grad));
  ++step_;
  RuntimeOps& ops = backend_->runtime_ops();
  const View m = m_.view(), v = v_.view();
  for (const DecayRange& r : ranges_) {
    const int64_t n = r.end - r.begin;
    ops.AdamW(Stream::kCompute, param.Slice(r.begin, n), grad.Slice(r.begin, n),
              m.Slice(r.begin, n), v.Slice(r.begin, n),
              AdamWStepScalars(lr_, options_.beta1, options_.beta2, options_.eps,
                               r.weight_decay ? options_.weight_decay : 0.0f, step_));
  }
  return absl::OkStatus();
}

std::vector<OptimizerState> AdamW::state() {
  return {{"exp_avg", m_.view(), m_.bytes()}, {"exp_avg_sq", v_.view(), v_.bytes()}};
}

// ---- SGD -------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Sgd>> Sgd::Create(Backend* backend, int64_t numel,
                                                 std::vector<DecayRange> ranges,
                                                 SgdOptions options) {
  if (backend == nullptr) return absl::InvalidArgumentError("Sgd: backend is null");
  ranges = Normalize(std::move(ranges));
  FSDP_RETURN_IF_ERROR(ValidateRanges(ranges, numel));
  if (!(options.lr >= 0 && std::isfinite(options.lr) && options.momentum >= 0 &&
        std::isfinite(options.momentum) && options.weight_decay >= 0 &&
        std::isfinite(options.weight_decay) && std::isfinite(options.dampening))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Sgd: lr, momentum and weight_decay must be finite and >= 0; got lr=", options.lr,
        " momentum=", options.momentum, " weight_decay=", options.weight_decay));
  }
  if (options.nesterov && (options.momentum <= 0 || options.dampening != 0)) {
    return absl::InvalidArgumentError("Sgd: nesterov needs momentum > 0 and dampening 0");
  }
  std::unique_ptr<Sgd> opt(new Sgd(backend, numel, std::move(ranges), options));
  if (options.momentum != 0) {
    FSDP_ASSIGN_OR_RETURN(opt->momentum_, ZeroedState(backend, numel));
  }
  return opt;
}

absl::Status Sgd::Step(View param, View grad) {
  FSDP_RETURN_IF_ERROR(CheckViews(param, grad));
  ++step_;
  RuntimeOps& ops = backend_->runtime_ops();
  const View buf = momentum_.view();
  for (const DecayRange& r : ranges_) {
    const int64_t n = r.end - r.begin;
    ops.Sgd(Stream::kCompute, param.Slice(r.begin, n), grad.Slice(r.begin, n),
            buf.empty() ? View{} : buf.Slice(r.begin, n), lr_, options_.momentum,
            options_.dampening, r.weight_decay ? options_.weight_decay : 0.0f, options_.nesterov,
            step_ == 1);
  }
  return absl::OkStatus();
}

std::vector<OptimizerState> Sgd::state() {
  if (momentum_.bytes() == 0) return {};
  return {{"momentum_buffer", momentum_.view(), momentum_.bytes()}};
}

// ---- schedules and clipping ------------------------------------------------------------------

float WarmupCosine::At(int64_t step) const {
  if (step < warmup_steps_) {
    return max_lr_ * static_cast<float>(step + 1) / static_cast<float>(warmup_steps_);
  }
  if (step >= total_steps_) return min_lr_;
  const double ratio = static_cast<double>(step - warmup_steps_) /
                       static_cast<double>(total_steps_ - warmup_steps_);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));
  return static_cast<float>(min_lr_ + coeff * (max_lr_ - min_lr_));
}

AdamWScalars AdamWStepScalars(float lr, float beta1, float beta2, float eps, float weight_decay,
                              int64_t step) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  AdamWScalars k;
  k.beta1 = beta1;
  k.beta2 = beta2;
  k.eps = eps;
  k.one_minus_beta1 = 1.0f - beta1;
  k.one_minus_beta2 = 1.0f - beta2;
  k.decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
  k.step_size = static_cast<float>(lr / bc1);
  k.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  return k;
}

}  // namespace fsdp
