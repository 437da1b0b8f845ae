// A naive double-precision GPT (MODEL_SPEC.md) written from the spec with plain loops and no
// code shared with the library: the oracle for the model's loss, logits and gradients.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/dtype.h"
#include "fsdp/nn/gpt.h"
#include "tests/nn/reference_rounding.h"

namespace fsdp::nn::testing {

class ReferenceGpt {
 public:
  using Units = std::vector<std::vector<double>>;  // flat unit buffers, the library's layout

  // stored: kF32 computes everything in double. kBF16 / kF16 emulate autocast-style mixed
  // precision (give parameters already rounded to that dtype): the inputs of every Linear
  // layer and the tensors the layers after a Linear read (q/k/v, the mlp's pre-activation) are
  // rounded to `stored`; the norms, softmax, residual stream and loss stay in double.
  explicit ReferenceGpt(GptConfig c, DType stored = DType::kF32)
      : c_(std::move(c)), stored_(stored) {
    for (const ParamSpec& s : GptParamSpecs(c_)) where_[s.name] = {s.unit, s.offset};
  }

  // Mean cross-entropy; fills `logits` ([B, T, V]) when not null.
  double Loss(const Units& u, const std::vector<int32_t>& idx, const std::vector<int32_t>& tgt,
              int B, int T, std::vector<double>* logits = nullptr) const {
    const int C = c_.channels, V = c_.vocab_size, NH = c_.num_heads, D = C / NH;
    const double* wte = P(u, "transformer.wte.weight");
    const double* wpe = P(u, "transformer.wpe.weight");
    std::vector<double> x(static_cast<size_t>(B) * T * C);
    for (int n = 0; n < B * T; ++n) {
      for (int c = 0; c < C; ++c) x[n * C + c] = wte[idx[n] * C + c] + wpe[(n % T) * C + c];
    }
    for (int l = 0; l < c_.num_layers; ++l) {
      const std::string pre = "transformer.h." + std::to_string(l) + ".";
      auto h = LayerNorm(x, P(u, pre + "ln_1.weight"), P(u, pre + "ln_1.bias"), B * T);
      auto qkv = Round(Linear(Round(h), P(u, pre + "attn.c_attn.weight"),
                              P(u, pre + "attn.c_attn.bias"), B * T, C, 3 * C));
      std::vector<double> y(x.size(), 0.0);
      for (int b = 0; b < B; ++b) {
        for (int hd = 0; hd < NH; ++hd) {
          for (int t = 0; t < T; ++t) {
            const double* q = &qkv[((b * T + t) * 3 * C) + hd * D];
            std::vector<double> s(t + 1);
            double mx = -1e300;
            for (int t2 = 0; t2 <= t; ++t2) {
              const double* k = &qkv[((b * T + t2) * 3 * C) + C + hd * D];
              double dot = 0;
              for (int d = 0; d < D; ++d) dot += q[d] * k[d];
              s[t2] = dot / std::sqrt(static_cast<double>(D));
              mx = std::max(mx, s[t2]);
            }
            double z = 0;
            for (double& v : s) z += (v = std::exp(v - mx));
            for (int t2 = 0; t2 <= t; ++t2) {
              const double* v = &qkv[((b * T + t2) * 3 * C) + 2 * C + hd * D];
              for (int d = 0; d < D; ++d) y[(b * T + t) * C + hd * D + d] += s[t2] / z * v[d];
            }
          }
        }
      }
      auto a = Linear(Round(y), P(u, pre + "attn.c_proj.weight"), P(u, pre + "attn.c_proj.bias"),
                      B * T, C, C);
      for (size_t i = 0; i < x.size(); ++i) x[i] += a[i];
      auto h2 = LayerNorm(x, P(u, pre + "ln_2.weight"), P(u, pre + "ln_2.bias"), B * T);
      auto f = Round(Linear(Round(h2), P(u, pre + "mlp.c_fc.weight"),
                            P(u, pre + "mlp.c_fc.bias"), B * T, C, 4 * C));
      for (double& v : f) {
        v = 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (v + 0.044715 * v * v * v)));
      }
      auto m = Linear(Round(f), P(u, pre + "mlp.c_proj.weight"), P(u, pre + "mlp.c_proj.bias"), B * T,
                      4 * C, C);
      for (size_t i = 0; i < x.size(); ++i) x[i] += m[i];
    }
    auto xf = LayerNorm(x, P(u, "transformer.ln_f.weight"), P(u, "transformer.ln_f.bias"), B * T);
    auto lg = Linear(Round(xf), wte, nullptr, B * T, C, V);  // tied lm_head
    double loss = 0;
    for (int n = 0; n < B * T; ++n) {
      double mx = -1e300;
      for (int v = 0; v < V; ++v) mx = std::max(mx, lg[n * V + v]);
      double z = 0;
      for (int v = 0; v < V; ++v) z += std::exp(lg[n * V + v] - mx);
      loss += std::log(z) + mx - lg[n * V + tgt[n]];
    }
    if (logits != nullptr) *logits = lg;
    return loss / (B * T);
  }

 private:
  std::vector<double> Round(std::vector<double> v) const {
    return RoundedTo(stored_, std::move(v));
  }

  const double* P(const Units& u, const std::string& name) const {
    const auto& [unit, offset] = where_.at(name);
    return u[unit].data() + offset;
  }

  std::vector<double> LayerNorm(const std::vector<double>& x, const double* w, const double* b,
                                int N) const {
    const int C = c_.channels;
    std::vector<double> out(x.size());
    for (int n = 0; n < N; ++n) {
      double mean = 0, var = 0;
      for (int c = 0; c < C; ++c) mean += x[n * C + c];
      mean /= C;
      for (int c = 0; c < C; ++c) var += (x[n * C + c] - mean) * (x[n * C + c] - mean);
      var /= C;
      const double rstd = 1.0 / std::sqrt(var + 1e-5);
      for (int c = 0; c < C; ++c) out[n * C + c] = (x[n * C + c] - mean) * rstd * w[c] + b[c];
    }
    return out;
  }

  // out[M, N] = in[M, K] W[N, K]^T + bias
  static std::vector<double> Linear(const std::vector<double>& in, const double* w,
                                    const double* bias, int M, int K, int N) {
    std::vector<double> out(static_cast<size_t>(M) * N);
    for (int m = 0; m < M; ++m) {
      for (int n = 0; n < N; ++n) {
        double s = bias != nullptr ? bias[n] : 0.0;
        for (int k = 0; k < K; ++k) s += in[m * K + k] * w[n * K + k];
        out[m * N + n] = s;
      }
    }
    return out;
  }

  GptConfig c_;
  DType stored_;
  std::map<std::string, std::pair<int, int64_t>> where_;
};

}  // namespace fsdp::nn::testing
