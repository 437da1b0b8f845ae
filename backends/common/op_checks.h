// Part of the kit the device backends share (backends/common): the checks of the views of the
// ops whose element types vary (fsdp/ops.h): the Linear layers, and the ops that read a kept
// bf16 / f16 copy or write one. Each says whether every view has a dtype the op takes and at
// least the elements its sizes need, and otherwise what was wrong and what the op takes, so
// that a backend fails with that message instead of reading a 16-bit tensor as f32 or past its
// end. An empty gradient view (not computed) and an empty bias (none) pass.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fsdp/backend.h"
#include "fsdp/dtype.h"

namespace fsdp::backend_kit {

// `what` has one of `dtypes` and at least `need` elements.
inline absl::Status CheckView(const char* what, const View& v, int64_t need,
                              std::initializer_list<DType> dtypes) {
  bool typed = false;
  std::string names;
  for (DType d : dtypes) {
    typed = typed || v.dtype == d;
    absl::StrAppend(&names, names.empty() ? "" : " or ", std::string(DTypeName(d)));
  }
  if (typed && v.count >= need) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", std::string(DTypeName(v.dtype)), " with ", v.count,
                   " elements, where the op takes ", names, " with at least ", need));
}
// As CheckView, but an empty view (a gradient not computed, no bias) passes.
inline absl::Status CheckOptionalView(const char* what, const View& v, int64_t need,
                                      std::initializer_list<DType> dtypes) {
  return v.empty() ? absl::OkStatus() : CheckView(what, v, need, dtypes);
}

inline absl::Status CheckSizes(std::initializer_list<int64_t> sizes) {
  for (int64_t n : sizes) {
    if (n < 0) {
      return absl::InvalidArgumentError(absl::StrCat("a size is negative (", n, ")"));
    }
  }
  return absl::OkStatus();
}

// The first failed check of a list, or OK.
inline absl::Status FirstError(std::initializer_list<absl::Status> checks) {
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Linear: weight f32, bf16 or f16, the bias (if any) the weight's dtype; inp f32 or the
// weight's dtype (a kept copy); out and the gradients f32.
inline absl::Status CheckLinearWeight(const View& weight, const View& bias, int64_t N,
                                      int64_t K) {
  const DType d = weight.dtype;
  return FirstError({CheckView("the weight", weight, N * K, {DType::kF32, DType::kBF16,
                                                             DType::kF16}),
                     CheckOptionalView("the bias", bias, N, {d})});
}
inline absl::Status CheckMatmulForward(const View& out, const View& inp, const View& weight,
                                       const View& bias, int64_t M, int64_t K, int64_t N) {
  return FirstError({CheckSizes({M, K, N}), CheckLinearWeight(weight, bias, N, K),
                     CheckView("the input", inp, M * K, {DType::kF32, weight.dtype}),
                     CheckView("the output", out, M * N, {DType::kF32})});
}
inline absl::Status CheckMatmulBackward(const View& dinp, const View& dweight, const View& dbias,
                                        const View& dout, const View& inp, const View& weight,
                                        int64_t M, int64_t K, int64_t N) {
  return FirstError(
      {CheckSizes({M, K, N}), CheckLinearWeight(weight, View{}, N, K),
       CheckView("dout", dout, M * N, {DType::kF32}),
       dweight.empty() ? absl::OkStatus()
                       : CheckView("the input", inp, M * K, {DType::kF32, weight.dtype}),
       CheckOptionalView("dinp", dinp, M * K, {DType::kF32}),
       CheckOptionalView("dweight", dweight, N * K, {DType::kF32}),
       CheckOptionalView("dbias", dbias, N, {DType::kF32})});
}

// GELU (n = inp.count): forward's out f32, bf16 or f16; backward's inp f32 or a kept copy.
inline absl::Status CheckGeluForward(const View& out, const View& inp) {
  return FirstError({CheckView("the input", inp, 0, {DType::kF32}),
                     CheckView("the output", out, inp.count,
                               {DType::kF32, DType::kBF16, DType::kF16})});
}
inline absl::Status CheckGeluBackward(const View& dinp, const View& inp, const View& dout) {
  return FirstError({CheckView("the input", inp, 0, {DType::kF32, DType::kBF16, DType::kF16}),
                     CheckView("dout", dout, inp.count, {DType::kF32}),
                     CheckView("dinp", dinp, inp.count, {DType::kF32})});
}

// Multi-head attention's C channels split into NH heads of equal size.
inline absl::Status CheckHeadsSplit(int64_t C, int64_t NH) {
  if (NH > 0 && C > 0 && C % NH == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("C=", C, " does not split into NH=", NH, " heads of equal size"));
}
// The heads of causal attention: positive, and NKV divides NH.
inline absl::Status CheckHeads(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t D) {
  if (B >= 0 && T >= 0 && NH > 0 && NKV > 0 && D > 0 && NH % NKV == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "B=", B, " T=", T, " heads=", NH, " kv heads=", NKV, " head size=", D,
      ": the heads and the head size must be positive and the kv heads divide the heads"));
}
// Causal attention forward (all f32): qkv rows of (NH + 2 NKV) D elements, out rows of NH D.
inline absl::Status CheckAttentionForward(const View& out, const View& lse, const View& qkv,
                                          int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                          int64_t D) {
  const absl::Status heads = CheckHeads(B, T, NH, NKV, D);
  if (!heads.ok()) return heads;
  const int64_t rows = B * T;
  return FirstError({CheckView("qkv", qkv, rows * (NH + 2 * NKV) * D, {DType::kF32}),
                     CheckView("the output", out, rows * NH * D, {DType::kF32}),
                     CheckView("lse", lse, B * NH * T, {DType::kF32})});
}
// Causal attention backward on rows of `width` = (NH + 2 NKV) D elements (qkv) and NH D (out);
// qkv and out f32 or kept bf16 / f16 copies, the rest f32. NKV divides NH.
inline absl::Status CheckAttentionBackward(const View& dqkv, const View& dout, const View& qkv,
                                           const View& out, const View& lse, int64_t B,
                                           int64_t T, int64_t NH, int64_t NKV, int64_t D) {
  const absl::Status heads = CheckHeads(B, T, NH, NKV, D);
  if (!heads.ok()) return heads;
  const int64_t rows = B * T, width = (NH + 2 * NKV) * D;
  return FirstError(
      {CheckView("qkv", qkv, rows * width, {DType::kF32, DType::kBF16, DType::kF16}),
       CheckView("the forward's output", out, rows * NH * D,
                 {DType::kF32, DType::kBF16, DType::kF16}),
       CheckView("lse", lse, B * NH * T, {DType::kF32}),
       CheckView("dout", dout, rows * NH * D, {DType::kF32}),
       CheckView("dqkv", dqkv, rows * width, {DType::kF32})});
}

// SwiGLU over gu[N, 2F]: forward's out f32, bf16 or f16; backward's gu f32 or a kept copy.
inline absl::Status CheckSwigluForward(const View& out, const View& gu, int64_t N, int64_t F) {
  return FirstError({CheckSizes({N, F}), CheckView("gu", gu, 2 * N * F, {DType::kF32}),
                     CheckView("the output", out, N * F,
                               {DType::kF32, DType::kBF16, DType::kF16})});
}
inline absl::Status CheckSwigluBackward(const View& dgu, const View& dout, const View& gu,
                                        int64_t N, int64_t F) {
  return FirstError({CheckSizes({N, F}),
                     CheckView("gu", gu, 2 * N * F, {DType::kF32, DType::kBF16, DType::kF16}),
                     CheckView("dout", dout, N * F, {DType::kF32}),
                     CheckView("dgu", dgu, 2 * N * F, {DType::kF32})});
}

}  // namespace fsdp::backend_kit
