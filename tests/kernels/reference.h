// Test helpers for the kernel tests: random data, double-precision reference forwards of the
// layers in kernels_cpu.h (written independently of the kernels, as plainly as possible),
// central finite differences, and tolerance comparisons.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/dtype.h"
#include "fsdp/kernels_cpu.h"
#include "gtest/gtest.h"

namespace fsdp::kernels::cpu::testing {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

inline Vec Random(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  Vec v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// x rounded to bf16 / f16 by the library's casts (raw 16-bit values), and those widened back.
inline std::vector<uint16_t> ToLowp(const Vec& x, DType d) {
  std::vector<uint16_t> out(x.size());
  const auto n = static_cast<int64_t>(x.size());
  if (d == DType::kBF16) {
    cast_f32_to_bf16(out.data(), x.data(), n);
  } else {
    cast_f32_to_f16(out.data(), x.data(), n);
  }
  return out;
}
inline Vec FromLowp(const std::vector<uint16_t>& x, DType d) {
  Vec out(x.size());
  const auto n = static_cast<int64_t>(x.size());
  if (d == DType::kBF16) {
    cast_bf16_to_f32(out.data(), x.data(), n);
  } else {
    cast_f16_to_f32(out.data(), x.data(), n);
  }
  return out;
}

inline DVec ToDouble(const Vec& v) { return DVec(v.begin(), v.end()); }
inline Vec ToFloat(const DVec& v) {
  Vec out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}

inline double Dot(const DVec& a, const Vec& w) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * w[i];
  return s;
}

// |got - want| <= atol + rtol |want| element-wise; reports the first few offenders.
template <typename Want>
void ExpectClose(const Vec& got, const std::vector<Want>& want, double atol, double rtol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = static_cast<double>(want[i]);
    if (!(std::fabs(got[i] - w) <= atol + rtol * std::fabs(w))) {
      if (++bad <= 5) ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << w;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements differ";
}

// The analytic gradient a kernel added to `after` (which held `before`) versus `want`.
inline void ExpectAccumulatedClose(const Vec& after, const Vec& before, const DVec& want,
                                   double atol, double rtol, const std::string& what) {
  Vec delta(after.size());
  for (size_t i = 0; i < after.size(); ++i) delta[i] = after[i] - before[i];
  ExpectClose(delta, want, atol, rtol, what);
}

// Central differences of a scalar function of x, in double.
inline DVec NumericGrad(const std::function<double(const DVec&)>& f, DVec x, double h = 1e-5) {
  DVec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double fp = f(x);
    x[i] = saved - h;
    const double fm = f(x);
    x[i] = saved;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// ---- double-precision references ----------------------------------------------------------

// out[M,N] = inp[M,K] weight[N,K]^T + bias (bias empty = none)
inline DVec MatmulRef(const DVec& inp, const DVec& weight, const DVec& bias, int64_t M,
                      int64_t K, int64_t N) {
  DVec out(M * N);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double s = bias.empty() ? 0.0 : bias[n];
      for (int64_t k = 0; k < K; ++k) s += inp[m * K + k] * weight[n * K + k];
      out[m * N + n] = s;
    }
  }
  return out;
}

inline DVec LayernormRef(const DVec& inp, const DVec& weight, const DVec& bias, int64_t N,
                         int64_t C, DVec* mean = nullptr, DVec* rstd = nullptr) {
  DVec out(N * C);
  if (mean) mean->assign(N, 0.0);
  if (rstd) rstd->assign(N, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double mu = 0;
    for (int64_t c = 0; c < C; ++c) mu += inp[n * C + c];
    mu /= C;
    double var = 0;
    for (int64_t c = 0; c < C; ++c) var += (inp[n * C + c] - mu) * (inp[n * C + c] - mu);
    var /= C;
    const double s = 1.0 / std::sqrt(var + 1e-5);
    for (int64_t c = 0; c < C; ++c) {
      out[n * C + c] = (inp[n * C + c] - mu) * s * weight[c] + bias[c];
    }
    if (mean) (*mean)[n] = mu;
    if (rstd) (*rstd)[n] = s;
  }
  return out;
}

inline double GeluRef(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}

// Grouped-query causal attention: qkv[B,T,(NH+2NKV)D] -> out[B,T,NH*D]; query head h uses kv
// head h / (NH / NKV). lse (optional) gets [B,NH,T], the log-sum-exp of each row of the scaled
// causal scores; att (optional) [B,NH,T,T], the probabilities (0 above the diagonal).
inline DVec GqaAttentionRef(const DVec& qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                            int64_t D, DVec* lse = nullptr, DVec* att = nullptr) {
  const int64_t W = (NH + 2 * NKV) * D, C = NH * D;
  DVec out(B * T * C, 0.0);
  if (lse) lse->assign(B * NH * T, 0.0);
  if (att) att->assign(B * NH * T * T, 0.0);
  std::vector<double> p(T);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / (NH / NKV);
      for (int64_t t = 0; t < T; ++t) {
        const double* q = &qkv[(b * T + t) * W + h * D];
        double mx = -INFINITY;
        for (int64_t s = 0; s <= t; ++s) {
          const double* k = &qkv[(b * T + s) * W + (NH + g) * D];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          p[s] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, p[s]);
        }
        double sum = 0;
        for (int64_t s = 0; s <= t; ++s) sum += (p[s] = std::exp(p[s] - mx));
        if (lse) (*lse)[(b * NH + h) * T + t] = mx + std::log(sum);
        for (int64_t s = 0; s <= t; ++s) {
          p[s] /= sum;
          if (att) (*att)[((b * NH + h) * T + t) * T + s] = p[s];
          const double* v = &qkv[(b * T + s) * W + (NH + NKV + g) * D];
          for (int64_t d = 0; d < D; ++d) out[(b * T + t) * C + h * D + d] += p[s] * v[d];
        }
      }
    }
  }
  return out;
}

// d <out, dout> / d qkv of grouped-query attention in closed form, in double (for shapes too
// large for finite differences).
inline DVec GqaAttentionBackwardRef(const DVec& qkv, const std::vector<float>& dout, int64_t B,
                                    int64_t T, int64_t NH, int64_t NKV, int64_t D) {
  const int64_t W = (NH + 2 * NKV) * D, C = NH * D;
  DVec att;
  GqaAttentionRef(qkv, B, T, NH, NKV, D, nullptr, &att);
  DVec dqkv(qkv.size(), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / (NH / NKV);
      const auto q = [&](int64_t s) { return (b * T + s) * W + h * D; };
      const auto k = [&](int64_t s) { return (b * T + s) * W + (NH + g) * D; };
      const auto v = [&](int64_t s) { return (b * T + s) * W + (NH + NKV + g) * D; };
      for (int64_t t = 0; t < T; ++t) {
        const double* p = &att[((b * NH + h) * T + t) * T];
        DVec dp(t + 1, 0.0);
        for (int64_t s = 0; s <= t; ++s) {
          for (int64_t d = 0; d < D; ++d) {
            const double dy = dout[(b * T + t) * C + h * D + d];
            dp[s] += dy * qkv[v(s) + d];
            dqkv[v(s) + d] += p[s] * dy;
          }
        }
        double dot = 0;
        for (int64_t s = 0; s <= t; ++s) dot += p[s] * dp[s];
        for (int64_t s = 0; s <= t; ++s) {
          const double ds = p[s] * (dp[s] - dot) * scale;
          for (int64_t d = 0; d < D; ++d) {
            dqkv[q(t) + d] += ds * qkv[k(s) + d];
            dqkv[k(s) + d] += ds * qkv[q(t) + d];
          }
        }
      }
    }
  }
  return dqkv;
}

// Causal multi-head attention: qkv[B,T,3C] -> out[B,T,C], lse and att as GqaAttentionRef.
inline DVec AttentionRef(const DVec& qkv, int64_t B, int64_t T, int64_t C, int64_t NH,
                         DVec* lse = nullptr, DVec* att = nullptr) {
  return GqaAttentionRef(qkv, B, T, NH, NH, C / NH, lse, att);
}

// RMSNorm: out = inp / sqrt(mean(inp^2) + eps) * weight; rstd (optional) gets [N].
inline DVec RmsnormRef(const DVec& inp, const DVec& weight, int64_t N, int64_t C,
                       DVec* rstd = nullptr, double eps = 1e-5) {
  DVec out(N * C);
  if (rstd) rstd->assign(N, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += inp[n * C + c] * inp[n * C + c];
    const double s = 1.0 / std::sqrt(ms / C + eps);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = inp[n * C + c] * s * weight[c];
    if (rstd) (*rstd)[n] = s;
  }
  return out;
}

// Rotary embeddings (Hugging Face layout) on the first NH heads of D columns of x[B,T,W], the
// angles p * theta^(-2j/D) in double: x * cos + rotate_half(x) * sin with cos, sin the half
// repeated, rotate_half(x) = [-x[D/2:], x[:D/2]].
inline DVec RopeRef(const DVec& x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                    double theta) {
  DVec out = x;
  const int64_t half = D / 2;
  DVec cos(D), sin(D), rot(D);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < D; ++i) {
        const double angle = t * std::pow(theta, -2.0 * static_cast<double>(i % half) / D);
        cos[i] = std::cos(angle);
        sin[i] = std::sin(angle);
      }
      for (int64_t h = 0; h < NH; ++h) {
        const double* in = &x[(b * T + t) * W + h * D];
        for (int64_t i = 0; i < D; ++i) rot[i] = i < half ? -in[i + half] : in[i - half];
        for (int64_t i = 0; i < D; ++i) {
          out[(b * T + t) * W + h * D + i] = in[i] * cos[i] + rot[i] * sin[i];
        }
      }
    }
  }
  return out;
}

// SwiGLU: gu[N,2F] = [gate | up] -> out[N,F] = gate * sigmoid(gate) * up.
inline DVec SwigluRef(const DVec& gu, int64_t N, int64_t F) {
  DVec out(N * F);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      const double g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
      out[n * F + f] = g / (1.0 + std::exp(-g)) * u;
    }
  }
  return out;
}

// losses[N] (0 where target < 0) and probs[N,V].
inline DVec CrossEntropyRef(const DVec& logits, const std::vector<int32_t>& targets, int64_t N,
                            int64_t V, DVec* probs = nullptr) {
  DVec losses(N, 0.0);
  if (probs) probs->assign(N * V, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, logits[n * V + v]);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[n * V + v] - mx);
    if (probs) {
      for (int64_t v = 0; v < V; ++v) (*probs)[n * V + v] = std::exp(logits[n * V + v] - mx) / sum;
    }
    if (targets[n] >= 0) losses[n] = mx + std::log(sum) - logits[n * V + targets[n]];
  }
  return losses;
}

}  // namespace fsdp::kernels::cpu::testing
