// The two-layer perceptron of mlp.h through the C++ API: registration and one micro-batch of
// hooks, shared by the C++ reference run (c_api_reference) and bench/c_api_bench.
#pragma once

#include <vector>

#include "fsdp/sharding.h"
#include "tests/capi/mlp.h"

namespace fsdp_capi_test {

// Registers the two units (layer1: w1, b1; layer2: w2, b2) and finalises them with mlp_init.
inline absl::Status RegisterMlp(fsdp::ShardingRuntime& rt) {
  const char* names[2][2] = {{"w1", "b1"}, {"w2", "b2"}};
  for (int u = 0; u < 2; ++u) {
    std::vector<fsdp::ParamInfo> params;
    for (int p = 0; p < 2; ++p) {
      int64_t shape[2];
      mlp_param_shape(u, p, shape);
      params.emplace_back(names[u][p], std::vector<int64_t>(shape, shape + mlp_param_ndim(u, p)));
    }
    FSDP_RETURN_IF_ERROR(rt.RegisterUnit(u == 0 ? "layer1" : "layer2", params).status());
  }
  return rt.Finalize([](int u, const fsdp::ParamInfo& param, int64_t begin, int64_t end,
                        float* dst) {
    const int p = param.name[0] == 'w' ? 0 : 1;
    for (int64_t i = begin; i < end; ++i) dst[i - begin] = mlp_init(u, p, i);
  });
}

// Micro-batch `m` of step `step` on rank `rank`: forward, loss, backward through the hooks
// (gradient sync on the last micro-batch only). Returns the loss.
inline absl::StatusOr<float> MlpMicroBatch(fsdp::ShardingRuntime& rt, mlp_acts& a, int rank,
                                           int step, int m) {
  const int64_t b1 = rt.unit_tensors(0)[1].offset, b2 = rt.unit_tensors(1)[1].offset;
  mlp_batch(rank, step, m, a.x, a.t);
  rt.set_sync_gradients(m == MLP_MICRO_BATCHES - 1);
  FSDP_ASSIGN_OR_RETURN(fsdp::UnitView v0, rt.PreForward(0));
  mlp_forward1(&a, v0.params, v0.params + b1);
  FSDP_RETURN_IF_ERROR(rt.PostForward(0));
  FSDP_ASSIGN_OR_RETURN(fsdp::UnitView v1, rt.PreForward(1));
  const float loss = mlp_forward2(&a, v1.params, v1.params + b2);
  FSDP_RETURN_IF_ERROR(rt.PostForward(1));
  FSDP_ASSIGN_OR_RETURN(v1, rt.PreBackward(1));
  mlp_backward2(&a, v1.params, v1.grads, v1.grads + b2);
  FSDP_RETURN_IF_ERROR(rt.PostBackward(1));
  FSDP_ASSIGN_OR_RETURN(v0, rt.PreBackward(0));
  mlp_backward1(&a, v0.grads, v0.grads + b1);
  FSDP_RETURN_IF_ERROR(rt.PostBackward(0));
  FSDP_RETURN_IF_ERROR(rt.FinishBackward());
  return loss;
}

}  // namespace fsdp_capi_test
