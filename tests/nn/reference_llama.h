// A naive double-precision Llama 2 (MODEL_SPEC.md, section "Llama") written from the spec with
// plain loops and no code shared with the library: separate q, k, v, gate and up products,
// RoPE written with rotate_half, query head h reading kv head h / (H / Hkv). The oracle for the
// model's loss, logits and gradients (by finite differences).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/dtype.h"
#include "fsdp/nn/llama.h"
#include "tests/nn/reference_rounding.h"

namespace fsdp::nn::testing {

class ReferenceLlama {
 public:
  using Units = std::vector<std::vector<double>>;  // flat unit buffers, the library's layout

  // stored: kF32 computes everything in double. kBF16 / kF16 emulate autocast-style mixed
  // precision (give parameters already rounded to that dtype): the inputs of every Linear
  // layer and what attention and SwiGLU read (q and k after RoPE, v, gate and up) are rounded
  // to `stored`; the norms, softmax, residual stream and loss stay in double.
  explicit ReferenceLlama(LlamaConfig c, DType stored = DType::kF32)
      : c_(std::move(c)), stored_(stored) {
    for (const ParamSpec& s : LlamaParamSpecs(c_)) where_[s.name] = {s.unit, s.offset};
  }

  // Mean cross-entropy; fills `logits` ([B, T, V]) when not null.
  double Loss(const Units& u, const std::vector<int32_t>& idx, const std::vector<int32_t>& tgt,
              int B, int T, std::vector<double>* logits = nullptr) const {
    const int C = c_.channels, V = c_.vocab_size, H = c_.num_heads, KV = c_.num_kv_heads;
    const int D = C / H, F = c_.mlp_hidden, group = H / KV;
    const double* emb = P(u, "model.embed_tokens.weight");
    std::vector<double> x(static_cast<size_t>(B) * T * C);
    for (int n = 0; n < B * T; ++n) {
      for (int c = 0; c < C; ++c) x[n * C + c] = emb[idx[n] * C + c];
    }
    for (int l = 0; l < c_.num_layers; ++l) {
      const std::string pre = "model.layers." + std::to_string(l) + ".";
      auto h = RmsNorm(x, P(u, pre + "input_layernorm.weight"), B * T);
      h = Round(h);
      auto q = Linear(h, P(u, pre + "self_attn.q_proj.weight"), B * T, C, H * D);
      auto k = Linear(h, P(u, pre + "self_attn.k_proj.weight"), B * T, C, KV * D);
      auto v = Round(Linear(h, P(u, pre + "self_attn.v_proj.weight"), B * T, C, KV * D));
      Rope(q, B, T, H, D);
      Rope(k, B, T, KV, D);
      q = Round(q);
      k = Round(k);
      std::vector<double> y(static_cast<size_t>(B) * T * H * D, 0.0);
      for (int b = 0; b < B; ++b) {
        for (int hd = 0; hd < H; ++hd) {
          const int g = hd / group;
          for (int t = 0; t < T; ++t) {
            const double* qr = &q[((b * T + t) * H + hd) * D];
            std::vector<double> s(t + 1);
            double mx = -1e300;
            for (int t2 = 0; t2 <= t; ++t2) {
              const double* kr = &k[((b * T + t2) * KV + g) * D];
              double dot = 0;
              for (int d = 0; d < D; ++d) dot += qr[d] * kr[d];
              s[t2] = dot / std::sqrt(static_cast<double>(D));
              mx = std::max(mx, s[t2]);
            }
            double z = 0;
            for (double& e : s) z += (e = std::exp(e - mx));
            for (int t2 = 0; t2 <= t; ++t2) {
              const double* vr = &v[((b * T + t2) * KV + g) * D];
              for (int d = 0; d < D; ++d) y[((b * T + t) * H + hd) * D + d] += s[t2] / z * vr[d];
            }
          }
        }
      }
      auto o = Linear(Round(y), P(u, pre + "self_attn.o_proj.weight"), B * T, H * D, C);
      for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
      auto h2 = Round(RmsNorm(x, P(u, pre + "post_attention_layernorm.weight"), B * T));
      auto gate = Round(Linear(h2, P(u, pre + "mlp.gate_proj.weight"), B * T, C, F));
      auto up = Round(Linear(h2, P(u, pre + "mlp.up_proj.weight"), B * T, C, F));
      for (size_t i = 0; i < gate.size(); ++i) {
        gate[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      }
      auto down = Linear(Round(gate), P(u, pre + "mlp.down_proj.weight"), B * T, F, C);
      for (size_t i = 0; i < x.size(); ++i) x[i] += down[i];
    }
    auto hf = RmsNorm(x, P(u, "model.norm.weight"), B * T);
    auto lg = Linear(Round(hf), P(u, "lm_head.weight"), B * T, C, V);
    double loss = 0;
    for (int n = 0; n < B * T; ++n) {
      const double* row = &lg[n * V];
      const double mx = *std::max_element(row, row + V);
      double z = 0;
      for (int j = 0; j < V; ++j) z += std::exp(row[j] - mx);
      loss += std::log(z) + mx - row[tgt[n]];
    }
    if (logits != nullptr) *logits = std::move(lg);
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
  std::vector<double> RmsNorm(const std::vector<double>& x, const double* w, int N) const {
    const int C = c_.channels;
    std::vector<double> out(x.size());
    for (int n = 0; n < N; ++n) {
      double ms = 0;
      for (int c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c];
      const double r = 1.0 / std::sqrt(ms / C + static_cast<double>(c_.norm_eps));
      for (int c = 0; c < C; ++c) out[n * C + c] = x[n * C + c] * r * w[c];
    }
    return out;
  }
  // out[N, out_dim] = x[N, in] W[out_dim, in]^T
  static std::vector<double> Linear(const std::vector<double>& x, const double* w, int N,
                                    int in, int out_dim) {
    std::vector<double> out(static_cast<size_t>(N) * out_dim);
    for (int n = 0; n < N; ++n) {
      for (int o = 0; o < out_dim; ++o) {
        double s = 0;
        for (int i = 0; i < in; ++i) s += x[n * in + i] * w[o * in + i];
        out[n * out_dim + o] = s;
      }
    }
    return out;
  }
  // x[B, T, heads, D] <- x cos + rotate_half(x) sin at position t.
  void Rope(std::vector<double>& x, int B, int T, int heads, int D) const {
    const int half = D / 2;
    for (int b = 0; b < B; ++b) {
      for (int t = 0; t < T; ++t) {
        for (int hd = 0; hd < heads; ++hd) {
          double* r = &x[((b * T + t) * heads + hd) * D];
          std::vector<double> rot(D);
          for (int d = 0; d < half; ++d) {
            rot[d] = -r[d + half];
            rot[d + half] = r[d];
          }
          std::vector<double> out(D);
          for (int d = 0; d < D; ++d) {
            const double inv_freq =
                std::pow(static_cast<double>(c_.rope_theta), -2.0 * (d % half) / D);
            const double angle = t * inv_freq;
            out[d] = r[d] * std::cos(angle) + rot[d] * std::sin(angle);
          }
          std::copy(out.begin(), out.end(), r);
        }
      }
    }
  }

  LlamaConfig c_;
  DType stored_;
  std::map<std::string, std::pair<int, int64_t>> where_;
};

}  // namespace fsdp::nn::testing
