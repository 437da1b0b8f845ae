// Uses the installed libfsdp: a CPU backend, one kernel through the op table, the GPT config.
#include <cmath>
#include <cstdio>

#include "fsdp/backend.h"
#include "fsdp/nn/gpt.h"

int main() {
  auto backend = fsdp::CpuBackend::Create({.num_threads = 1});
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  // out[1,2] = inp[1,3] . w[2,3]^T + b
  const float inp[3] = {1, 2, 3}, w[6] = {1, 0, 0, 0, 1, 1}, b[2] = {0.5f, -1};
  float out[2];
  (*backend)->ops().matmul_forward(out, inp, w, b, 1, 3, 2);
  auto config = fsdp::nn::GptConfig::FromName("nano");
  if (!config.ok() || std::fabs(out[0] - 1.5f) > 1e-6f || std::fabs(out[1] - 4.0f) > 1e-6f) {
    std::fprintf(stderr, "consumer: unexpected result %f %f\n", out[0], out[1]);
    return 1;
  }
  std::printf("consumer: fsdp::fsdp works (nano has %lld parameters)\n",
              static_cast<long long>(config->num_parameters()));
  return 0;
}
