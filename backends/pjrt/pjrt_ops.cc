// The PJRT backend's op table (pjrt_ops.h): every op of fsdp/ops.h as one StableHLO program,
// following the CPU reference kernels (fsdp/kernels_cpu.h) step by step where the order of
// the f32 operations matters; matmuls and reductions run in XLA's order (the conformance
// suite's tolerances).
#include "backends/pjrt/pjrt_ops.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace fsdp::pjrt {
namespace {

using P = Program;

Value Splat(P& p, double v, const Value& like) { return p.Constant(v, like.type, like.dims); }

// x + a scalar constant broadcast.
Value AddC(P& p, const Value& x, double c) { return p.Add(x, Splat(p, c, x)); }
Value MulC(P& p, const Value& x, double c) { return p.Mul(x, Splat(p, c, x)); }

// A scalar value broadcast to x's shape.
Value Bcast(P& p, const Value& scalar, const Value& like) {
  return p.Broadcast(scalar, like.dims, {});
}

// v of dims [N] broadcast to [N, C] (along the rows) or [C] to [N, C] (along the columns).
Value Rows(P& p, const Value& v, const std::vector<int64_t>& dims) {
  return p.Broadcast(v, dims, {0});
}
Value Cols(P& p, const Value& v, const std::vector<int64_t>& dims) {
  return p.Broadcast(v, dims, {static_cast<int64_t>(dims.size()) - 1});
}

// dst += x: loads dst, adds, stores (an accumulating gradient output).
void Accumulate(P& p, const View& dst, const Value& x) {
  p.Store(dst, p.Add(p.Load(dst, x.dims), x));
}

// Causal (grouped-query) attention, shared by the GPT and Llama layers, with the CPU kernels'
// contract (fsdp/kernels_cpu.h): forward stores out and the log-sum-exp of each row of the
// scaled scores, no T x T matrix; backward recomputes the probabilities from qkv and lse (XLA
// keeps them only inside the program). qkv[B,T,(NH+2NKV)*D], out[B,T,NH*D], lse[B,NH,T]
// (= [B,NKV,G,T], head h = kv head * G + its index in the group).
struct AttentionParts {
  Value q, k, v;  // [B,NKV,G,T,D], [B,NKV,T,D], [B,NKV,T,D]
};
AttentionParts SplitQkv(P& p, const Value& qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t D) {
  const int64_t G = NH / NKV, H = NH + 2 * NKV;
  const Value x = p.Reshape(qkv, {B, T, H, D});
  Value q = p.Slice(x, {0, 0, 0, 0}, {B, T, NH, D});
  Value k = p.Slice(x, {0, 0, NH, 0}, {B, T, NH + NKV, D});
  Value v = p.Slice(x, {0, 0, NH + NKV, 0}, {B, T, H, D});
  q = p.Transpose(p.Reshape(q, {B, T, NKV, G, D}), {0, 2, 3, 1, 4});
  k = p.Transpose(k, {0, 2, 1, 3});
  v = p.Transpose(v, {0, 2, 1, 3});
  return {q, k, v};
}

// [B,T,NH*D] (out, dout) as [B,NKV,G,T,D].
Value HeadsMajor(P& p, const View& x, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t D) {
  return p.Transpose(p.Reshape(p.Load(x, {B, T, NH * D}), {B, T, NKV, NH / NKV, D}),
                     {0, 2, 3, 1, 4});
}

// The scaled scores [B,NKV,G,T,T] and the causal mask (key index <= query index).
struct Scores {
  Value s, causal;
};
Scores CausalScores(P& p, const AttentionParts& in, int64_t D) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const Value s = MulC(p, p.Dot(in.q, in.k, {0, 1}, {0, 1}, {4}, {3}), scale);
  const Value causal = p.Compare("GE", p.Iota(s.dims, 3, "i32"), p.Iota(s.dims, 4, "i32"));
  return {s, causal};
}

void AttentionForwardProgram(P& p, const View& out, const View& lse, const View& qkv, int64_t B,
                             int64_t T, int64_t NH, int64_t NKV, int64_t D) {
  const AttentionParts in = SplitQkv(p, p.Load(qkv, {B, T, (NH + 2 * NKV) * D}), B, T, NH, NKV, D);
  const Scores sc = CausalScores(p, in, D);
  const std::vector<int64_t> dims = sc.s.dims;
  const Value s = p.Select(sc.causal, sc.s, Splat(p, -INFINITY, sc.s));
  const Value mx = p.Reduce(s, {4}, "maximum");
  const Value e = p.Select(
      sc.causal, p.Unary("exponential", p.Sub(s, p.Broadcast(mx, dims, {0, 1, 2, 3}))),
      Splat(p, 0.0, s));
  const Value sum = p.Reduce(p.Convert(e, "f64"), {4});
  const Value inv = p.Convert(p.Div(p.Constant(1.0, "f64", sum.dims), sum), "f32");
  const Value a = p.Mul(e, p.Broadcast(inv, dims, {0, 1, 2, 3}));
  p.Store(lse, p.Add(mx, p.Unary("log", p.Convert(sum, "f32"))));
  // out [B,NKV,G,T,D] -> [B,T,NKV,G,D]
  const Value o = p.Dot(a, in.v, {0, 1}, {0, 1}, {4}, {2});
  p.Store(out, p.Reshape(p.Transpose(o, {0, 3, 1, 2, 4}), {B, T, NH * D}));
}

void AttentionBackwardProgram(P& p, const View& dqkv, const View& dout, const View& qkv,
                              const View& out, const View& lse, int64_t B, int64_t T,
                              int64_t NH, int64_t NKV, int64_t D) {
  const int64_t G = NH / NKV, H = NH + 2 * NKV;
  const AttentionParts in = SplitQkv(p, p.Load(qkv, {B, T, H * D}), B, T, NH, NKV, D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // The probabilities, recomputed: exp(s - lse) on the causal part, else 0.
  const Scores sc = CausalScores(p, in, D);
  const std::vector<int64_t> dims = sc.s.dims;
  const Value l = p.Broadcast(p.Load(lse, {B, NKV, G, T}), dims, {0, 1, 2, 3});
  const Value a = p.Select(sc.causal, p.Unary("exponential", p.Sub(sc.s, l)), Splat(p, 0.0, sc.s));
  const Value dy = HeadsMajor(p, dout, B, T, NH, NKV, D);
  // dv [B,NKV,T,D] = sum over (G, T) of att * dy
  const Value dv = p.Dot(a, dy, {0, 1}, {0, 1}, {2, 3}, {2, 3});
  // datt [B,NKV,G,T,T] = dy v^T; ds = scale * att * (datt - dot), dot = sum_d dy * out
  const Value datt = p.Dot(dy, in.v, {0, 1}, {0, 1}, {4}, {3});
  const Value dot = p.Reduce(p.Mul(dy, HeadsMajor(p, out, B, T, NH, NKV, D)), {4});
  const Value ds = MulC(p, p.Mul(a, p.Sub(datt, p.Broadcast(dot, dims, {0, 1, 2, 3}))), scale);
  const Value dq = p.Dot(ds, in.k, {0, 1}, {0, 1}, {4}, {2});             // [B,NKV,G,T,D]
  const Value dk = p.Dot(ds, in.q, {0, 1}, {0, 1}, {2, 3}, {2, 3});       // [B,NKV,T,D]
  const Value q_part = p.Reshape(p.Transpose(dq, {0, 3, 1, 2, 4}), {B, T, NH, D});
  const Value k_part = p.Transpose(dk, {0, 2, 1, 3});
  const Value v_part = p.Transpose(dv, {0, 2, 1, 3});
  Accumulate(p, dqkv, p.Reshape(p.Concat({q_part, k_part, v_part}, 2), {B, T, H * D}));
}

// The cos and sin tables of RoPE, as the CPU kernel computes them (kernels/cpu/rope.cc).
void RopeTables(int64_t T, int64_t D, float theta, std::vector<float>& cos_t,
                std::vector<float>& sin_t) {
  const int64_t half = D / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(D);
    inv_freq[j] = 1.0f / std::pow(theta, exponent);
  }
  cos_t.resize(static_cast<size_t>(T * half));
  sin_t.resize(static_cast<size_t>(T * half));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      const float angle = static_cast<float>(t) * inv_freq[j];
      cos_t[t * half + j] = std::cos(angle);
      sin_t[t * half + j] = std::sin(angle);
    }
  }
}

void RopeProgram(P& p, const View& x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                 float theta, float sign) {
  const int64_t half = D / 2;
  std::vector<float> cos_t, sin_t;
  RopeTables(T, D, theta, cos_t, sin_t);
  const Value c = p.HostF32(cos_t, {T, half});
  Value s = p.HostF32(sin_t, {T, half});
  if (sign < 0) s = p.Unary("negate", s);
  const Value row = p.Load(x, {B, T, W});
  const Value heads = p.Reshape(p.Slice(row, {0, 0, 0}, {B, T, NH * D}), {B, T, NH, D});
  const Value lo = p.Slice(heads, {0, 0, 0, 0}, {B, T, NH, half});
  const Value hi = p.Slice(heads, {0, 0, 0, half}, {B, T, NH, D});
  const std::vector<int64_t> dims = lo.dims;
  const Value cb = p.Broadcast(c, dims, {1, 3});
  const Value sb = p.Broadcast(s, dims, {1, 3});
  const Value nlo = p.Sub(p.Mul(lo, cb), p.Mul(hi, sb));
  const Value nhi = p.Add(p.Mul(hi, cb), p.Mul(lo, sb));
  Value rotated = p.Reshape(p.Concat({nlo, nhi}, 3), {B, T, NH * D});
  if (NH * D < W) rotated = p.Concat({rotated, p.Slice(row, {0, 0, NH * D}, {B, T, W})}, 2);
  p.Store(x, rotated);
}

// [N, V]: whether column v is row n's target (targets i32 [N]; a negative one matches none).
Value TargetHit(P& p, const Value& t, const std::vector<int64_t>& nv) {
  return p.Compare("EQ", p.Iota(nv, 1, "i32"), Rows(p, t, nv));
}
Value Ignored(P& p, const Value& t) {
  return p.Compare("LT", t, p.Constant(0, "i32", t.dims));
}

// exp(min(-g, 87)) of the SwiGLU kernels.
Value ExpNeg(P& p, const Value& g) {
  const Value m = p.Binary("minimum", p.Unary("negate", g), Splat(p, 87.0, g));
  return p.Unary("exponential", m);
}

// exp(min(-2u, 80)) with u = sqrt(2/pi) (x + 0.044715 x^3): the GELU kernels' exponential.
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
Value GeluExp(P& p, const Value& x) {
  const Value x3 = p.Mul(p.Mul(MulC(p, x, kGeluCubic), x), x);
  const Value u = MulC(p, p.Add(x, x3), kSqrt2OverPi);
  return p.Unary("exponential",
                 p.Binary("minimum", MulC(p, u, -2.0), Splat(p, 80.0, u)));
}

class PjrtOps final : public Ops {
 public:
  explicit PjrtOps(LaunchFn launch) : launch_(std::move(launch)) {}

  void MatmulForward(Stream s, View out, View inp, View weight, View bias, int64_t M, int64_t K,
                     int64_t N) override {
    Run(s, "matmul_forward", [=](Program* p) {
      const DType dt = weight.dtype;
      const Value x = p->RoundTo(p->Load(inp, {M, K}), dt);
      const Value w = p->Load(weight, {N, K});
      Value y = p->Dot(x, w, {}, {}, {1}, {1});
      if (!bias.empty()) y = p->Add(y, Cols(*p, p->Load(bias, {N}), {M, N}));
      p->Store(out, y);
    });
  }
  void MatmulBackward(Stream s, View dinp, View dweight, View dbias, View dout, View inp,
                      View weight, int64_t M, int64_t K, int64_t N) override {
    if (dinp.empty() && dweight.empty() && dbias.empty()) return;
    Run(s, "matmul_backward", [=](Program* p) {
      const DType dt = weight.dtype;
      const Value d = p->Load(dout, {M, N});
      const Value dr = p->RoundTo(d, dt);
      if (!dinp.empty()) {
        Accumulate(*p, dinp, p->Dot(dr, p->Load(weight, {N, K}), {}, {}, {1}, {0}));
      }
      if (!dweight.empty()) {
        const Value x = p->RoundTo(p->Load(inp, {M, K}), dt);
        Accumulate(*p, dweight, p->Dot(dr, x, {}, {}, {0}, {0}));
      }
      if (!dbias.empty()) Accumulate(*p, dbias, p->Reduce(d, {0}));
    });
  }

  void LayernormForward(Stream s, View out, View mean, View rstd, View inp, View weight, View bias,
                        int64_t N, int64_t C, float eps) override {
    Run(s, "layernorm_forward", [=](Program* p) {
      const Value x = p->Load(inp, {N, C});
      const Value m = p->Div(p->Reduce(x, {1}), p->Constant(static_cast<float>(C), "f32", {N}));
      const Value dev = p->Sub(x, Rows(*p, m, {N, C}));
      const Value var =
          p->Div(p->Reduce(p->Mul(dev, dev), {1}), p->Constant(static_cast<float>(C), "f32", {N}));
      const Value r = p->Div(p->Constant(1.0, "f32", {N}), p->Unary("sqrt", AddC(*p, var, eps)));
      const Value y = p->Add(p->Mul(p->Mul(dev, Rows(*p, r, {N, C})), Cols(*p, p->Load(weight, {C}), {N, C})),
                             Cols(*p, p->Load(bias, {C}), {N, C}));
      p->Store(out, y);
      p->Store(mean, m);
      p->Store(rstd, r);
    });
  }
  void LayernormBackward(Stream s, View dinp, View dweight, View dbias, View dout, View inp,
                         View weight, View mean, View rstd, int64_t N, int64_t C) override {
    if (dinp.empty() && dweight.empty() && dbias.empty()) return;
    Run(s, "layernorm_backward", [=](Program* p) {
      const std::vector<int64_t> nc = {N, C};
      const Value x = p->Load(inp, nc);
      const Value dy = p->Load(dout, nc);
      const Value m = Rows(*p, p->Load(mean, {N}), nc);
      const Value r = Rows(*p, p->Load(rstd, {N}), nc);
      const Value xhat = p->Mul(p->Sub(x, m), r);
      if (!dinp.empty()) {
        const Value g = p->Mul(dy, Cols(*p, p->Load(weight, {C}), nc));
        const Value cn = p->Constant(static_cast<float>(C), "f32", {N});
        const Value g_mean = Rows(*p, p->Div(p->Reduce(g, {1}), cn), nc);
        const Value gx_mean = Rows(*p, p->Div(p->Reduce(p->Mul(g, xhat), {1}), cn), nc);
        Accumulate(*p, dinp, p->Mul(r, p->Sub(p->Sub(g, g_mean), p->Mul(xhat, gx_mean))));
      }
      if (!dweight.empty()) Accumulate(*p, dweight, p->Reduce(p->Mul(dy, xhat), {0}));
      if (!dbias.empty()) Accumulate(*p, dbias, p->Reduce(dy, {0}));
    });
  }

  void GeluForward(Stream s, View out, View inp) override {
    Run(s, "gelu_forward", [=](Program* p) {
      const Value x = p->Load(inp, {inp.count});
      p->Store(out, p->Div(x, AddC(*p, GeluExp(*p, x), 1.0)));
    });
  }
  void GeluBackward(Stream s, View dinp, View inp, View dout) override {
    Run(s, "gelu_backward", [=](Program* p) {
      const Value x = p->Load(inp, {inp.count});
      const Value e = GeluExp(*p, x);
      const Value sg = p->Div(Splat(*p, 1.0, x), AddC(*p, e, 1.0));
      const Value du =
          MulC(*p, AddC(*p, p->Mul(MulC(*p, x, 3.0f * kGeluCubic), x), 1.0), kSqrt2OverPi);
      const Value t = p->Mul(p->Mul(p->Mul(MulC(*p, x, 2.0), sg), p->Mul(e, sg)), du);
      Accumulate(*p, dinp, p->Mul(p->Load(dout, {inp.count}), p->Add(sg, t)));
    });
  }

  void AttentionForward(Stream s, View out, View lse, View qkv, int64_t B, int64_t T, int64_t C,
                        int64_t NH) override {
    Run(s, "attention_forward", [=](Program* p) {
      AttentionForwardProgram(*p, out, lse, qkv, B, T, NH, NH, C / NH);
    });
  }
  void AttentionBackward(Stream s, View dqkv, View dout, View qkv, View out, View lse, int64_t B,
                         int64_t T, int64_t C, int64_t NH) override {
    Run(s, "attention_backward", [=](Program* p) {
      AttentionBackwardProgram(*p, dqkv, dout, qkv, out, lse, B, T, NH, NH, C / NH);
    });
  }
  void GqaAttentionForward(Stream s, View out, View lse, View qkv, int64_t B, int64_t T, int64_t NH,
                           int64_t NKV, int64_t D) override {
    Run(s, "gqa_attention_forward", [=](Program* p) {
      AttentionForwardProgram(*p, out, lse, qkv, B, T, NH, NKV, D);
    });
  }
  void GqaAttentionBackward(Stream s, View dqkv, View dout, View qkv, View out, View lse,
                            int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t D) override {
    Run(s, "gqa_attention_backward", [=](Program* p) {
      AttentionBackwardProgram(*p, dqkv, dout, qkv, out, lse, B, T, NH, NKV, D);
    });
  }

  void RmsnormForward(Stream s, View out, View rstd, View inp, View weight, int64_t N, int64_t C,
                      float eps) override {
    Run(s, "rmsnorm_forward", [=](Program* p) {
      const Value x = p->Load(inp, {N, C});
      const Value ms =
          p->Div(p->Reduce(p->Mul(x, x), {1}), p->Constant(static_cast<float>(C), "f32", {N}));
      const Value r = p->Div(p->Constant(1.0, "f32", {N}), p->Unary("sqrt", AddC(*p, ms, eps)));
      p->Store(out, p->Mul(p->Mul(x, Rows(*p, r, {N, C})), Cols(*p, p->Load(weight, {C}), {N, C})));
      p->Store(rstd, r);
    });
  }
  void RmsnormBackward(Stream s, View dinp, View dweight, View dout, View inp, View weight,
                       View rstd, int64_t N, int64_t C) override {
    if (dinp.empty() && dweight.empty()) return;
    Run(s, "rmsnorm_backward", [=](Program* p) {
      const std::vector<int64_t> nc = {N, C};
      const Value x = p->Load(inp, nc);
      const Value dy = p->Load(dout, nc);
      const Value r = Rows(*p, p->Load(rstd, {N}), nc);
      const Value xs = p->Mul(x, r);
      if (!dinp.empty()) {
        const Value g = p->Mul(dy, Cols(*p, p->Load(weight, {C}), nc));
        const Value gx_mean = Rows(
            *p,
            p->Div(p->Reduce(p->Mul(g, xs), {1}), p->Constant(static_cast<float>(C), "f32", {N})),
            nc);
        Accumulate(*p, dinp, p->Mul(r, p->Sub(g, p->Mul(xs, gx_mean))));
      }
      if (!dweight.empty()) Accumulate(*p, dweight, p->Reduce(p->Mul(dy, xs), {0}));
    });
  }
  void RopeForward(Stream s, View x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                   float theta) override {
    Run(s, "rope_forward", [=](Program* p) {
      RopeProgram(*p, x, B, T, W, NH, D, theta, 1.0f);
    });
  }
  void RopeBackward(Stream s, View dx, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                    float theta) override {
    Run(s, "rope_backward", [=](Program* p) {
      RopeProgram(*p, dx, B, T, W, NH, D, theta, -1.0f);
    });
  }
  void SwigluForward(Stream s, View out, View gu, int64_t N, int64_t F) override {
    Run(s, "swiglu_forward", [=](Program* p) {
      const Value x = p->Load(gu, {N, 2 * F});
      const Value g = p->Slice(x, {0, 0}, {N, F});
      const Value u = p->Slice(x, {0, F}, {N, 2 * F});
      p->Store(out, p->Mul(p->Div(g, AddC(*p, ExpNeg(*p, g), 1.0)), u));
    });
  }
  void SwigluBackward(Stream s, View dgu, View dout, View gu, int64_t N, int64_t F) override {
    Run(s, "swiglu_backward", [=](Program* p) {
      const Value x = p->Load(gu, {N, 2 * F});
      const Value g = p->Slice(x, {0, 0}, {N, F});
      const Value u = p->Slice(x, {0, F}, {N, 2 * F});
      const Value dy = p->Load(dout, {N, F});
      const Value e = ExpNeg(*p, g);
      const Value one_e = AddC(*p, e, 1.0);
      const Value sg = p->Div(Splat(*p, 1.0, g), one_e);
      const Value dg =
          p->Mul(p->Mul(dy, u), p->Mul(sg, AddC(*p, p->Mul(g, p->Mul(e, sg)), 1.0)));
      const Value du = p->Mul(dy, p->Div(g, one_e));
      Accumulate(*p, dgu, p->Concat({dg, du}, 1));
    });
  }

  void SoftmaxCrossEntropyForward(Stream s, View losses, View probs, View logits, View targets,
                                  int64_t N, int64_t V) override {
    Run(s, "softmax_crossentropy_forward", [=](Program* p) {
      const std::vector<int64_t> nv = {N, V};
      const Value x = p->Load(logits, nv);
      const Value t = p->Load(targets, {N});
      const Value mx = p->Reduce(x, {1}, "maximum");
      const Value e = p->Unary("exponential", p->Sub(x, Rows(*p, mx, nv)));
      const Value sum = p->Reduce(p->Convert(e, "f64"), {1});
      const Value inv = p->Convert(p->Div(p->Constant(1.0, "f64", {N}), sum), "f32");
      p->Store(probs, p->Mul(e, Rows(*p, inv, nv)));
      const Value xt =
          p->Reduce(p->Select(TargetHit(*p, t, nv), x, p->Constant(0.0, "f32", nv)), {1});
      const Value loss = p->Sub(p->Add(mx, p->Unary("log", p->Convert(sum, "f32"))), xt);
      p->Store(losses, p->Select(Ignored(*p, t), p->Constant(0.0, "f32", {N}), loss));
    });
  }
  void SoftmaxCrossEntropyBackward(Stream s, View dlogits, View probs, View targets, float dloss,
                                   int64_t N, int64_t V) override {
    Run(s, "softmax_crossentropy_backward", [=](Program* p) {
      const std::vector<int64_t> nv = {N, V};
      const Value d = p->Load(dlogits, nv);
      const Value t = p->Load(targets, {N});
      const Value dl = Bcast(*p, p->Scalar(dloss), d);
      Value acc = p->Add(d, p->Mul(dl, p->Load(probs, nv)));
      acc = p->Select(TargetHit(*p, t, nv), p->Sub(acc, dl), acc);
      p->Store(dlogits, p->Select(Rows(*p, Ignored(*p, t), nv), d, acc));
    });
  }

  void EmbeddingForward(Stream s, View out, View idx, View table, int64_t N, int64_t C) override {
    Run(s, "embedding_forward", [=](Program* p) {
      const Value tab = p->Load(table, {table.count / C, C});
      p->Store(out, p->Gather(tab, p->Load(idx, {N})));
    });
  }
  void EmbeddingBackward(Stream s, View dtable, View dout, View idx, int64_t N,
                         int64_t C) override {
    Run(s, "embedding_backward", [=](Program* p) {
      const Value tab = p->Load(dtable, {dtable.count / C, C});
      p->Store(dtable, p->ScatterAdd(tab, p->Load(idx, {N}), p->Load(dout, {N, C})));
    });
  }

  void Add(Stream s, View out, View a, View b) override {
    const int64_t n = out.count;
    if (n == 0) return;
    Run(s, "add", [=](Program* p) {
      p->Store(out, p->Add(p->Load(a.Slice(0, n), {n}), p->Load(b.Slice(0, n), {n})));
    });
  }
  void AddBackward(Stream s, View da, View db, View dout) override {
    if (da.empty() && db.empty()) return;
    Run(s, "add_backward", [=](Program* p) {
      const int64_t n = da.empty() ? db.count : da.count;
      const Value d = p->Load(dout.Slice(0, n), {n});
      if (!da.empty()) Accumulate(*p, da, d);
      if (!db.empty()) Accumulate(*p, db, d);
    });
  }
  void Cast(Stream s, View out, View in) override {
    if (in.count == 0) return;
    Run(s, "cast", [=](Program* p) {
      p->Store(out, p->Load(in, {in.count}));
    });
  }
  void Scale(Stream s, View x, float factor) override {
    if (x.count == 0) return;
    Run(s, "scale", [=](Program* p) {
      const Value v = p->Load(x, {x.count});
      p->Store(x, p->Mul(v, Bcast(*p, p->Scalar(factor), v)));
    });
  }
  // Block quantization (fsdp/wire_format.h), as the CPU kernels compute it bit for bit: the
  // shard padded with zeros to whole blocks, each block's largest magnitude (a NaN poisons it),
  // scale = that / 127 (int8) or / 448 (fp8 e4m3), codes x / scale rounded to nearest even
  // (int8 clamped to +-127 and stored as two's complement bytes; fp8 clamped to +-448 and
  // converted, so it saturates as the CPU's), a block whose scale is zero or not finite all
  // zero codes.
  bool supports_wire_format(WireFormat) const override { return true; }
  void QuantizeBlocks(Stream s, View codes, View scales, View x, int64_t block,
                      WireFormat format) override {
    const int64_t n = x.count;
    if (n == 0) return;
    const int64_t blocks = (n + block - 1) / block, padded = blocks * block;
    const bool int8 = format == WireFormat::kInt8;
    Run(s, int8 ? "quantize_int8" : "quantize_fp8", [=](Program* p) {
      Value v = p->Load(x.Slice(0, n), {n});
      if (padded > n) v = p->Concat({v, p->Constant(0.0, "f32", {padded - n})}, 0);
      const Value grid = p->Reshape(v, {blocks, block});
      const Value amax = p->Reduce(p->Unary("abs", grid), {1}, "maximum");
      // The plugin's maximum may drop NaNs (XLA CPU's fast min/max): a NaN poisons its block's
      // scale as it does on the CPU, found apart.
      const Value nan_in_block = p->Reduce(
          p->Convert(p->Compare("NE", grid, grid), "f32"), {1}, "maximum");
      const Value zero = p->Constant(0.0, "f32", {blocks});
      const Value scale =
          p->Select(p->Compare("GT", nan_in_block, zero), p->Constant(std::nan(""), "f32", {blocks}),
                    // A run-time divisor: a constant one may be compiled as a product with its
                    // reciprocal, which rounds differently from the CPU's division.
                    p->Div(amax, p->Broadcast(p->Scalar(int8 ? 127.0 : 448.0), {blocks}, {})));
      p->Store(scales.Slice(0, blocks), scale);
      const Value usable = p->Binary("and", p->Compare("GT", scale, zero),
                                     p->Compare("EQ", p->Sub(scale, scale), zero));
      const Value divisor = p->Select(usable, scale, p->Constant(1.0, "f32", {blocks}));
      const Value q = p->Div(grid, p->Broadcast(divisor, {blocks, block}, {0}));
      const Value keep = p->Broadcast(usable, {blocks, block}, {0});
      const double limit = int8 ? 127.0 : 448.0;
      const Value clamped =
          p->Binary("minimum", p->Max(int8 ? p->Unary("round_nearest_even", q) : q,
                                      p->Constant(-limit, "f32", {blocks, block})),
                    p->Constant(limit, "f32", {blocks, block}));
      Value bytes;
      if (int8) {
        const Value c = p->Convert(clamped, "i32");
        const Value zi = p->Constant(0.0, "i32", {blocks, block});
        const Value twos =
            p->Select(p->Compare("LT", c, zi), p->Add(c, p->Constant(256.0, "i32", {blocks, block})), c);
        bytes = p->Select(keep, twos, zi);
      } else {
        const Value c = p->Bitcast(p->Convert(clamped, "f8E4M3FN"), "ui8");
        bytes = p->Select(keep, c, p->Constant(0.0, "ui8", {blocks, block}));
      }
      p->Store(codes.Slice(0, n), p->Slice(p->Reshape(bytes, {padded}), {0}, {n}));
    });
  }
  void DequantizeBlocks(Stream s, View out, View codes, View scales, int64_t block,
                        WireFormat format) override {
    const int64_t n = out.count;
    if (n == 0) return;
    const int64_t blocks = (n + block - 1) / block, padded = blocks * block;
    const bool int8 = format == WireFormat::kInt8;
    Run(s, int8 ? "dequantize_int8" : "dequantize_fp8", [=](Program* p) {
      Value c;
      if (int8) {
        const Value u = p->Load(codes.Slice(0, n), {n}, "i32");
        const Value signed_code = p->Select(p->Compare("GE", u, p->Constant(128.0, "i32", {n})),
                                            p->Sub(u, p->Constant(256.0, "i32", {n})), u);
        c = p->Convert(signed_code, "f32");
      } else {
        c = p->Convert(p->Bitcast(p->Load(codes.Slice(0, n), {n}, "ui8"), "f8E4M3FN"), "f32");
      }
      if (padded > n) c = p->Concat({c, p->Constant(0.0, "f32", {padded - n})}, 0);
      const Value scale = p->Load(scales.Slice(0, blocks), {blocks});
      const Value zero = p->Constant(0.0, "f32", {blocks});
      // A scale that is not finite decodes to NaN, never to a finite value.
      const Value finite = p->Compare("EQ", p->Sub(scale, scale), zero);
      const Value s_used = p->Select(finite, scale, p->Constant(std::nan(""), "f32", {blocks}));
      const Value y = p->Mul(p->Reshape(c, {blocks, block}), p->Broadcast(s_used, {blocks, block}, {0}));
      p->Store(out, p->Slice(p->Reshape(y, {padded}), {0}, {n}));
    });
  }

  void ScaleBy(Stream s, View x, View factor) override {
    if (x.count == 0) return;
    Run(s, "scale_by", [=](Program* p) {
      const Value v = p->Load(x, {x.count});
      const Value f = p->Reshape(p->Load(factor.Slice(0, 1), {1}), {});
      p->Store(x, p->Mul(v, Bcast(*p, f, v)));
    });
  }
  void Reduce(Stream s, View out, std::span<const View> ins, ReduceOp op) override {
    const int64_t n = out.count;
    if (n == 0 || ins.empty()) return;
    std::vector<View> all(ins.begin(), ins.end());  // the builder outlives the span
    Run(s, "reduce", [=](Program* p) {
      Value acc = p->Load(all[0].Slice(0, n), {n}, "f32");
      for (size_t i = 1; i < all.size(); ++i) {
        const Value x = p->Load(all[i].Slice(0, n), {n}, "f32");
        acc = op == ReduceOp::kMax ? p->Max(acc, x) : p->Add(acc, x);
      }
      if (op == ReduceOp::kAvg) acc = p->Div(acc, Splat(*p, static_cast<float>(all.size()), acc));
      p->Store(out, acc);
    });
  }

  void AdamW(Stream s, View param, View grad, View m, View v, const AdamWScalars& k) override {
    const int64_t n = param.count;
    if (n == 0) return;
    Run(s, "adamw", [=](Program* p) {
      const Value g = p->Load(grad, {n});
      const auto S = [&](float x) { return Bcast(*p, p->Scalar(x), g); };
      const Value mi =
          p->Add(p->Mul(S(k.beta1), p->Load(m, {n})), p->Mul(S(k.one_minus_beta1), g));
      const Value vi =
          p->Add(p->Mul(S(k.beta2), p->Load(v, {n})), p->Mul(p->Mul(S(k.one_minus_beta2), g), g));
      p->Store(m, mi);
      p->Store(v, vi);
      // The new parameter reads the moments back from their arrays (the same values): computed
      // from mi and vi, XLA fuses their math into the parameter's update, which then reads the
      // old moments after their in-place update, so XLA copies both whole arrays (the unit's
      // moments, for an update of one tensor) to keep them.
      const Value denom =
          p->Add(p->Mul(p->Unary("sqrt", p->Load(v, {n})), S(k.inv_bc2_sqrt)), S(k.eps));
      const Value np = p->Sub(p->Mul(p->Load(param, {n}), S(k.decay)),
                              p->Div(p->Mul(S(k.step_size), p->Load(m, {n})), denom));
      p->Store(param, np);
    });
  }
  void Sgd(Stream s, View param, View grad, View momentum_buf, float lr, float momentum,
           float dampening, float weight_decay, bool nesterov, bool first_step) override {
    const int64_t n = param.count;
    if (n == 0) return;
    Run(s, "sgd", [=](Program* p) {
      const Value x = p->Load(param, {n});
      const auto S = [&](float f) { return Bcast(*p, p->Scalar(f), x); };
      if (momentum == 0.0f) {
        p->Store(param,
                 p->Sub(x, p->Mul(S(lr), p->Add(p->Load(grad, {n}), p->Mul(S(weight_decay), x)))));
      } else {
        const Value g = p->Add(p->Load(grad, {n}), p->Mul(S(weight_decay), x));
        const Value buf =
            first_step ? g
                       : p->Add(p->Mul(S(momentum), p->Load(momentum_buf, {n})),
                                p->Mul(S(1.0f - dampening), g));
        p->Store(momentum_buf, buf);
        // Read back from its array, as AdamW's moments (no copy of the whole buffer).
        const Value b = p->Load(momentum_buf, {n});
        const Value d = nesterov ? p->Add(g, p->Mul(S(momentum), b)) : b;
        p->Store(param, p->Sub(x, p->Mul(S(lr), d)));
      }
    });
  }

  void SumSquares(Stream s, View out, View x) override {
    Run(s, "sum_squares", [=](Program* p) {
      const View o = out.Slice(0, 1);
      Value acc = p->Reshape(p->Load(o, {1}), {});
      if (x.count > 0) {
        const Value w = p->Convert(p->Load(x, {x.count}), "f64");
        acc = p->Add(acc, p->Reduce(p->Mul(w, w), {0}));
      }
      p->Store(o, acc);
    });
  }
  void SplitF64(Stream s, View out, View in) override {
    Run(s, "split_f64", [=](Program* p) {
      const Value v = p->Reshape(p->Load(in.Slice(0, 1), {1}), {});
      const Value hi = p->Convert(v, "f32");
      const Value lo = p->Convert(p->Sub(v, p->Convert(hi, "f64")), "f32");
      p->Store(out.Slice(0, 2),
               p->Concat({p->Reshape(hi, {1}), p->Reshape(lo, {1})}, 0));
    });
  }
  void GlobalNormClip(Stream s, View total_sq, View factor, View partials, double k,
                      float max_norm) override {
    Run(s, "global_norm_clip", [=](Program* p) {
      const bool wide = partials.dtype == DType::kF64;
      const int64_t n = wide ? partials.count : partials.count / 2;
      Value sum = p->Constant(0.0, "f64");
      if (n > 0) {
        const Value parts = wide ? p->Load(partials.Slice(0, n), {n, 1})
                                 : p->Convert(p->Load(partials.Slice(0, 2 * n), {n, 2}), "f64");
        // In rank order, as the CPU sums them.
        for (int64_t r = 0; r < n; ++r) {
          Value term = p->Reshape(p->Slice(parts, {r, 0}, {r + 1, 1}), {});
          if (!wide) term = p->Add(term, p->Reshape(p->Slice(parts, {r, 1}, {r + 1, 2}), {}));
          sum = p->Add(sum, term);
        }
      }
      p->Store(total_sq.Slice(0, 1), sum);
      // ClipCoefficient(sqrt(sum) / k, max_norm) / k (fsdp/optim_scalars.h).
      const Value kk = p->Scalar(k, "f64");
      const Value mn = p->Scalar(max_norm, "f64");
      const Value norm = p->Div(p->Unary("sqrt", sum), kk);
      const Value clip =
          p->Convert(p->Convert(p->Div(mn, p->Add(norm, p->Constant(1e-6, "f64"))), "f32"), "f64");
      const Value clips = p->Binary("and", p->Compare("GT", mn, p->Constant(0.0, "f64")),
                                    p->Compare("GT", norm, mn));
      const Value coef = p->Select(clips, clip, p->Constant(1.0, "f64"));
      p->Store(factor.Slice(0, 1), p->Convert(p->Div(coef, kk), "f32"));
    });
  }
  void Mean(Stream s, View out, View x) override {
    Run(s, "mean", [=](Program* p) {
      const Value sum = x.count == 0 ? p->Constant(0.0, "f64")
                                     : p->Reduce(p->Convert(p->Load(x, {x.count}), "f64"), {0});
      p->Store(out.Slice(0, 1),
               p->Convert(p->Div(sum, p->Constant(static_cast<double>(x.count), "f64")), "f32"));
    });
  }

 private:
  void Run(Stream s, const char* name, std::function<void(Program*)> build) {
    launch_(s, OpBuilder{name, std::move(build)});
  }
  LaunchFn launch_;
};

}  // namespace

std::unique_ptr<Ops> MakeOps(LaunchFn launch) { return std::make_unique<PjrtOps>(std::move(launch)); }

}  // namespace fsdp::pjrt
