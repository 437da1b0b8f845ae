// Part of the kit the device backends share (backends/common): an op table that checks every
// call's views (backends/common/op_checks.h) before it reaches the backend's own table. No op
// returns a status, so a bad call (a view of a dtype the op does not take, one smaller than the
// sizes need, sizes that do not fit together) runs nothing and fails the backend through
// `fail` with the op and the view named; the backend makes that failure sticky, as a device's
// asynchronous error is. The checks cost a few comparisons a call, on the host.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "backends/common/op_checks.h"
#include "fsdp/ops.h"

namespace fsdp::backend_kit {

class CheckedOps final : public Ops {
 public:
  // Called with the op's name and what was wrong; the backend fails there, in stream order.
  using FailFn = std::function<void(Stream, const char* op, const absl::Status& why)>;
  CheckedOps(std::unique_ptr<Ops> inner, FailFn fail)
      : inner_(std::move(inner)), fail_(std::move(fail)) {}

  bool supports_op(ModelOp op) const override { return inner_->supports_op(op); }
  bool supports_wire_format(WireFormat format) const override {
    return inner_->supports_wire_format(format);
  }

  // ---- the runtime's ops -----------------------------------------------------------------------
  void Cast(Stream s, View out, View in) override {
    if (Ok(s, "Cast", CheckCast(out, in))) inner_->Cast(s, out, in);
  }
  void CastKeepingRounded(Stream s, View low, View x) override {
    if (Ok(s, "CastKeepingRounded",
           FirstError({CheckView("x", x, 0, {kF32}),
                       CheckView("the kept copy", low, x.count, {DType::kBF16, DType::kF16})}))) {
      inner_->CastKeepingRounded(s, low, x);
    }
  }
  void Add(Stream s, View out, View a, View b) override {
    if (Ok(s, "Add", FirstError({CheckView("out", out, 0, {kF32}),
                                 CheckView("a", a, out.count, {kF32}),
                                 CheckView("b", b, out.count, {kF32})}))) {
      inner_->Add(s, out, a, b);
    }
  }
  void ScaleBy(Stream s, View x, View factor) override {
    if (Ok(s, "ScaleBy", FirstError({CheckView("x", x, 0, {kF32}),
                                     CheckView("the factor", factor, 1, {kF32})}))) {
      inner_->ScaleBy(s, x, factor);
    }
  }
  void Scale(Stream s, View x, float factor) override {
    if (Ok(s, "Scale", CheckView("x", x, 0, {kF32}))) inner_->Scale(s, x, factor);
  }
  void AdamW(Stream s, View param, View grad, View m, View v, const AdamWScalars& k) override {
    const int64_t n = param.count;
    if (Ok(s, "AdamW", FirstError({CheckView("the parameter", param, 0, {kF32}),
                                   CheckView("the gradient", grad, n, {kF32}),
                                   CheckView("m", m, n, {kF32}), CheckView("v", v, n, {kF32})}))) {
      inner_->AdamW(s, param, grad, m, v, k);
    }
  }
  void Sgd(Stream s, View param, View grad, View momentum_buf, float lr, float momentum,
           float dampening, float weight_decay, bool nesterov, bool first_step) override {
    const int64_t n = param.count;
    const absl::Status buf = momentum == 0.0f
                                 ? CheckOptionalView("the momentum buffer", momentum_buf, n, {kF32})
                                 : CheckView("the momentum buffer", momentum_buf, n, {kF32});
    if (Ok(s, "Sgd", FirstError({CheckView("the parameter", param, 0, {kF32}),
                                 CheckView("the gradient", grad, n, {kF32}), buf}))) {
      inner_->Sgd(s, param, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov,
                  first_step);
    }
  }
  void SumSquares(Stream s, View out, View x) override {
    if (Ok(s, "SumSquares", FirstError({CheckView("out", out, 1, {DType::kF64}),
                                        CheckView("x", x, 0, {kF32})}))) {
      inner_->SumSquares(s, out, x);
    }
  }
  void SplitF64(Stream s, View out, View in) override {
    if (Ok(s, "SplitF64", FirstError({CheckView("out", out, 2, {kF32}),
                                      CheckView("in", in, 1, {DType::kF64})}))) {
      inner_->SplitF64(s, out, in);
    }
  }
  void GlobalNormClip(Stream s, View total_sq, View factor, View partials, double k,
                      float max_norm) override {
    absl::Status pairs = CheckView("the partials", partials, 0, {kF32, DType::kF64});
    if (pairs.ok() && partials.dtype == kF32 && partials.count % 2 != 0) {
      pairs = absl::InvalidArgumentError(absl::StrCat(
          "the partials are ", partials.count, " f32 values; they are (hi, lo) pairs"));
    }
    if (Ok(s, "GlobalNormClip",
           FirstError({CheckView("the total", total_sq, 1, {DType::kF64}),
                       CheckView("the factor", factor, 1, {kF32}), pairs}))) {
      inner_->GlobalNormClip(s, total_sq, factor, partials, k, max_norm);
    }
  }
  void QuantizeBlocks(Stream s, View codes, View scales, View x, int64_t block,
                      WireFormat format) override {
    if (Ok(s, "QuantizeBlocks",
           FirstError({CheckBlock(block), CheckView("x", x, 0, {kF32}),
                       CheckView("the codes", codes, x.count, {DType::kU8}),
                       CheckView("the scales", scales, Blocks(x.count, block), {kF32})}))) {
      inner_->QuantizeBlocks(s, codes, scales, x, block, format);
    }
  }
  void DequantizeBlocks(Stream s, View out, View codes, View scales, int64_t block,
                        WireFormat format) override {
    if (Ok(s, "DequantizeBlocks",
           FirstError({CheckBlock(block),
                       CheckView("out", out, 0, {kF32, DType::kBF16, DType::kF16}),
                       CheckView("the codes", codes, out.count, {DType::kU8}),
                       CheckView("the scales", scales, Blocks(out.count, block), {kF32})}))) {
      inner_->DequantizeBlocks(s, out, codes, scales, block, format);
    }
  }

  // ---- the layers ------------------------------------------------------------------------------
  void MatmulForward(Stream s, View out, View inp, View weight, View bias, int64_t M, int64_t K,
                     int64_t N) override {
    if (Ok(s, "MatmulForward", CheckMatmulForward(out, inp, weight, bias, M, K, N))) {
      inner_->MatmulForward(s, out, inp, weight, bias, M, K, N);
    }
  }
  void MatmulBackward(Stream s, View dinp, View dweight, View dbias, View dout, View inp,
                      View weight, int64_t M, int64_t K, int64_t N) override {
    if (Ok(s, "MatmulBackward",
           CheckMatmulBackward(dinp, dweight, dbias, dout, inp, weight, M, K, N))) {
      inner_->MatmulBackward(s, dinp, dweight, dbias, dout, inp, weight, M, K, N);
    }
  }
  void LayernormForward(Stream s, View out, View mean, View rstd, View inp, View weight,
                        View bias, int64_t N, int64_t C, float eps) override {
    if (Ok(s, "LayernormForward",
           FirstError({CheckSizes({N, C}), CheckView("the output", out, N * C, {kF32}),
                       CheckView("mean", mean, N, {kF32}), CheckView("rstd", rstd, N, {kF32}),
                       CheckView("the input", inp, N * C, {kF32}),
                       CheckView("the weight", weight, C, {kF32}),
                       CheckView("the bias", bias, C, {kF32})}))) {
      inner_->LayernormForward(s, out, mean, rstd, inp, weight, bias, N, C, eps);
    }
  }
  void LayernormBackward(Stream s, View dinp, View dweight, View dbias, View dout, View inp,
                         View weight, View mean, View rstd, int64_t N, int64_t C) override {
    if (Ok(s, "LayernormBackward",
           FirstError({CheckSizes({N, C}), CheckOptionalView("dinp", dinp, N * C, {kF32}),
                       CheckOptionalView("dweight", dweight, C, {kF32}),
                       CheckOptionalView("dbias", dbias, C, {kF32}),
                       CheckView("dout", dout, N * C, {kF32}),
                       CheckView("the input", inp, N * C, {kF32}),
                       CheckView("the weight", weight, C, {kF32}),
                       CheckView("mean", mean, N, {kF32}),
                       CheckView("rstd", rstd, N, {kF32})}))) {
      inner_->LayernormBackward(s, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
    }
  }
  void GeluForward(Stream s, View out, View inp) override {
    if (Ok(s, "GeluForward", CheckGeluForward(out, inp))) inner_->GeluForward(s, out, inp);
  }
  void GeluBackward(Stream s, View dinp, View inp, View dout) override {
    if (Ok(s, "GeluBackward", CheckGeluBackward(dinp, inp, dout))) {
      inner_->GeluBackward(s, dinp, inp, dout);
    }
  }
  void AttentionForward(Stream s, View out, View lse, View qkv, int64_t B, int64_t T, int64_t C,
                        int64_t NH) override {
    const absl::Status heads = CheckHeadsSplit(C, NH);
    if (Ok(s, "AttentionForward",
           heads.ok() ? CheckAttentionForward(out, lse, qkv, B, T, NH, NH, C / NH) : heads)) {
      inner_->AttentionForward(s, out, lse, qkv, B, T, C, NH);
    }
  }
  void AttentionBackward(Stream s, View dqkv, View dout, View qkv, View out, View lse, int64_t B,
                         int64_t T, int64_t C, int64_t NH) override {
    const absl::Status heads = CheckHeadsSplit(C, NH);
    if (Ok(s, "AttentionBackward",
           heads.ok() ? CheckAttentionBackward(dqkv, dout, qkv, out, lse, B, T, NH, NH, C / NH)
                      : heads)) {
      inner_->AttentionBackward(s, dqkv, dout, qkv, out, lse, B, T, C, NH);
    }
  }
  void GqaAttentionForward(Stream s, View out, View lse, View qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t D) override {
    if (Ok(s, "GqaAttentionForward", CheckAttentionForward(out, lse, qkv, B, T, NH, NKV, D))) {
      inner_->GqaAttentionForward(s, out, lse, qkv, B, T, NH, NKV, D);
    }
  }
  void GqaAttentionBackward(Stream s, View dqkv, View dout, View qkv, View out, View lse,
                            int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t D) override {
    if (Ok(s, "GqaAttentionBackward",
           CheckAttentionBackward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, D))) {
      inner_->GqaAttentionBackward(s, dqkv, dout, qkv, out, lse, B, T, NH, NKV, D);
    }
  }
  void RmsnormForward(Stream s, View out, View rstd, View inp, View weight, int64_t N, int64_t C,
                      float eps) override {
    if (Ok(s, "RmsnormForward",
           FirstError({CheckSizes({N, C}), CheckView("the output", out, N * C, {kF32}),
                       CheckView("rstd", rstd, N, {kF32}),
                       CheckView("the input", inp, N * C, {kF32}),
                       CheckView("the weight", weight, C, {kF32})}))) {
      inner_->RmsnormForward(s, out, rstd, inp, weight, N, C, eps);
    }
  }
  void RmsnormBackward(Stream s, View dinp, View dweight, View dout, View inp, View weight,
                       View rstd, int64_t N, int64_t C) override {
    if (Ok(s, "RmsnormBackward",
           FirstError({CheckSizes({N, C}), CheckOptionalView("dinp", dinp, N * C, {kF32}),
                       CheckOptionalView("dweight", dweight, C, {kF32}),
                       CheckView("dout", dout, N * C, {kF32}),
                       CheckView("the input", inp, N * C, {kF32}),
                       CheckView("the weight", weight, C, {kF32}),
                       CheckView("rstd", rstd, N, {kF32})}))) {
      inner_->RmsnormBackward(s, dinp, dweight, dout, inp, weight, rstd, N, C);
    }
  }
  void RopeForward(Stream s, View x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                   float theta) override {
    if (Ok(s, "RopeForward", CheckRope(x, B, T, W, NH, D))) {
      inner_->RopeForward(s, x, B, T, W, NH, D, theta);
    }
  }
  void RopeBackward(Stream s, View dx, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                    float theta) override {
    if (Ok(s, "RopeBackward", CheckRope(dx, B, T, W, NH, D))) {
      inner_->RopeBackward(s, dx, B, T, W, NH, D, theta);
    }
  }
  void SwigluForward(Stream s, View out, View gu, int64_t N, int64_t F) override {
    if (Ok(s, "SwigluForward", CheckSwigluForward(out, gu, N, F))) {
      inner_->SwigluForward(s, out, gu, N, F);
    }
  }
  void SwigluBackward(Stream s, View dgu, View dout, View gu, int64_t N, int64_t F) override {
    if (Ok(s, "SwigluBackward", CheckSwigluBackward(dgu, dout, gu, N, F))) {
      inner_->SwigluBackward(s, dgu, dout, gu, N, F);
    }
  }
  void SoftmaxCrossEntropyForward(Stream s, View losses, View probs, View logits, View targets,
                                  int64_t N, int64_t V) override {
    if (Ok(s, "SoftmaxCrossEntropyForward",
           FirstError({CheckSizes({N, V}), CheckView("the losses", losses, N, {kF32}),
                       CheckView("probs", probs, N * V, {kF32}),
                       CheckView("the logits", logits, N * V, {kF32}),
                       CheckView("the targets", targets, N, {DType::kI32})}))) {
      inner_->SoftmaxCrossEntropyForward(s, losses, probs, logits, targets, N, V);
    }
  }
  void SoftmaxCrossEntropyBackward(Stream s, View dlogits, View probs, View targets, float dloss,
                                   int64_t N, int64_t V) override {
    if (Ok(s, "SoftmaxCrossEntropyBackward",
           FirstError({CheckSizes({N, V}), CheckView("dlogits", dlogits, N * V, {kF32}),
                       CheckView("probs", probs, N * V, {kF32}),
                       CheckView("the targets", targets, N, {DType::kI32})}))) {
      inner_->SoftmaxCrossEntropyBackward(s, dlogits, probs, targets, dloss, N, V);
    }
  }
  void EmbeddingForward(Stream s, View out, View idx, View table, int64_t N,
                        int64_t C) override {
    if (Ok(s, "EmbeddingForward",
           FirstError({CheckSizes({N, C}), CheckView("the output", out, N * C, {kF32}),
                       CheckView("the ids", idx, N, {DType::kI32}),
                       CheckView("the table", table, C, {kF32})}))) {
      inner_->EmbeddingForward(s, out, idx, table, N, C);
    }
  }
  void EmbeddingBackward(Stream s, View dtable, View dout, View idx, int64_t N,
                         int64_t C) override {
    if (Ok(s, "EmbeddingBackward",
           FirstError({CheckSizes({N, C}), CheckView("dtable", dtable, C, {kF32}),
                       CheckView("dout", dout, N * C, {kF32}),
                       CheckView("the ids", idx, N, {DType::kI32})}))) {
      inner_->EmbeddingBackward(s, dtable, dout, idx, N, C);
    }
  }
  void AddBackward(Stream s, View da, View db, View dout) override {
    const int64_t n = dout.count;
    if (Ok(s, "AddBackward", FirstError({CheckView("dout", dout, 0, {kF32}),
                                         CheckOptionalView("da", da, n, {kF32}),
                                         CheckOptionalView("db", db, n, {kF32})}))) {
      inner_->AddBackward(s, da, db, dout);
    }
  }
  void Reduce(Stream s, View out, std::span<const View> ins, ReduceOp op) override {
    absl::Status st = CheckView("out", out, 0, {kF32, DType::kBF16, DType::kF16});
    for (const View& in : ins) {
      if (!st.ok()) break;
      st = CheckView("an input", in, out.count, {out.dtype});
    }
    if (Ok(s, "Reduce", st)) inner_->Reduce(s, out, ins, op);
  }
  void Mean(Stream s, View out, View x) override {
    if (Ok(s, "Mean", FirstError({CheckView("out", out, 1, {kF32}),
                                  CheckView("x", x, 1, {kF32})}))) {
      inner_->Mean(s, out, x);
    }
  }

 private:
  static constexpr DType kF32 = DType::kF32;

  bool Ok(Stream s, const char* op, const absl::Status& why) {
    if (why.ok()) return true;
    fail_(s, op, why);
    return false;
  }
  // out = in converted: the same dtype (a copy), or between f32 and bf16 / f16.
  static absl::Status CheckCast(const View& out, const View& in) {
    const bool same = out.dtype == in.dtype;
    const bool widen = out.dtype == kF32 && (in.dtype == DType::kBF16 || in.dtype == DType::kF16);
    const bool narrow = in.dtype == kF32 && (out.dtype == DType::kBF16 || out.dtype == DType::kF16);
    if (!same && !widen && !narrow) {
      return absl::InvalidArgumentError(absl::StrCat(
          "no cast from ", std::string(DTypeName(in.dtype)), " to ",
          std::string(DTypeName(out.dtype)),
          "; Cast copies one dtype or converts between f32 and bf16 / f16"));
    }
    return CheckView("out", out, in.count, {out.dtype});
  }
  static absl::Status CheckBlock(int64_t block) {
    if (block > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("the block is ", block, " elements"));
  }
  static int64_t Blocks(int64_t n, int64_t block) {
    return block > 0 ? (n + block - 1) / block : 0;
  }
  // Rotary embeddings on the first NH heads of D (even) columns of rows of W.
  static absl::Status CheckRope(const View& x, int64_t B, int64_t T, int64_t W, int64_t NH,
                                int64_t D) {
    if (B < 0 || T < 0 || NH < 0 || D <= 0 || D % 2 != 0 || NH * D > W) {
      return absl::InvalidArgumentError(absl::StrCat(
          "B=", B, " T=", T, " W=", W, " heads=", NH, " head size=", D,
          ": the head size must be even and the heads fit in a row of W"));
    }
    return CheckView("x", x, B * T * W, {kF32});
  }

  std::unique_ptr<Ops> inner_;
  FailFn fail_;
};

}  // namespace fsdp::backend_kit
