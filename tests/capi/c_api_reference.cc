// The two-layer perceptron of mlp.h trained through the C++ API (fsdp/sharding.h) on every
// configuration of mlp_run.h, ranks as threads; writes one reference file per configuration
// into the directory argv[1], for c_api_train_test to compare the C API's run with, bit by bit.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/registry.h"
#include "fsdp/local_world.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/sharding.h"
#include "tests/capi/mlp_cpp.h"
#include "tests/capi/mlp_run.h"

namespace {

absl::Status TrainRank(fsdp::Communicator& comm, const mlp_config& cfg, std::vector<float>& out) {
  const int rank = comm.rank();
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::Backend> backend,
                        fsdp::CreateBackend("cpu", {}, rank));
  fsdp::ShardingOptions o;
  o.strategy = static_cast<fsdp::ShardingStrategy>(cfg.strategy);
  o.hybrid_shard_size = cfg.hybrid_shard_size;
  o.max_grad_norm = 0.07f;  // clips steps 0 and 3
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::ShardingRuntime> rt,
                        fsdp::ShardingRuntime::Create(backend.get(), comm, o));
  FSDP_RETURN_IF_ERROR(fsdp_capi_test::RegisterMlp(*rt));
  mlp_acts a;
  float* losses = out.data() + rank * MLP_LOSSES;
  float* norms = out.data() + cfg.world * MLP_LOSSES + rank * MLP_STEPS;
  for (int step = 0; step < MLP_STEPS; ++step) {
    for (int m = 0; m < MLP_MICRO_BATCHES; ++m) {
      FSDP_ASSIGN_OR_RETURN(losses[step * MLP_MICRO_BATCHES + m],
                            fsdp_capi_test::MlpMicroBatch(*rt, a, rank, step, m));
    }
    FSDP_ASSIGN_OR_RETURN(fsdp::StepStats s, rt->Step(MLP_LR));
    norms[step] = static_cast<float>(s.grad_norm);
  }
  float* params = out.data() + cfg.world * (MLP_LOSSES + MLP_STEPS);
  std::vector<float> unit(MLP_UNIT0 + MLP_UNIT1);
  FSDP_RETURN_IF_ERROR(rt->GatherUnit(0, unit.data()));
  FSDP_RETURN_IF_ERROR(rt->GatherUnit(1, unit.data() + MLP_UNIT0));
  if (rank == 0) std::copy(unit.begin(), unit.end(), params);
  return absl::OkStatus();
}

// The bundled model through the C++ API: "nano", FULL_SHARD, GPT_RANKS ranks.
absl::Status TrainGpt(fsdp::Communicator& comm, std::vector<float>& out) {
  const int rank = comm.rank();
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::Backend> backend,
                        fsdp::CreateBackend("cpu", {}, rank));
  fsdp::nn::ShardedModelOptions o;
  o.batch_size = GPT_BATCH;
  o.seq_len = GPT_SEQ;
  o.sharding.max_grad_norm = 1.0f;
  FSDP_ASSIGN_OR_RETURN(fsdp::nn::ModelConfig config, fsdp::nn::ModelConfig::FromName("nano"));
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::nn::ShardedModel> model,
                        fsdp::nn::ShardedModel::Create(config, backend.get(), comm, o));
  std::vector<int32_t> inputs(GPT_BATCH * GPT_SEQ), targets(GPT_BATCH * GPT_SEQ);
  float* r = out.data() + rank * (2 * GPT_STEPS + 1);
  for (int step = 0; step < GPT_STEPS; ++step) {
    gpt_tokens(rank, step, config.vocab_size(), inputs.data(), targets.data());
    FSDP_ASSIGN_OR_RETURN(r[step], model->ForwardBackward(inputs.data(), targets.data()));
    FSDP_ASSIGN_OR_RETURN(fsdp::StepStats s, model->Step(GPT_LR));
    r[GPT_STEPS + step] = static_cast<float>(s.grad_norm);
  }
  gpt_tokens(rank, GPT_STEPS, config.vocab_size(), inputs.data(), targets.data());
  FSDP_ASSIGN_OR_RETURN(r[2 * GPT_STEPS], model->Forward(inputs.data(), targets.data()));
  return absl::OkStatus();
}

absl::Status WriteFloats(const std::string& path, const std::vector<float>& out) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(out.data(), sizeof(float), out.size(), f) != out.size() ||
      std::fclose(f) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  for (const mlp_config& cfg : kMlpConfigs) {
    std::vector<float> out(MLP_REF_FLOATS(cfg.world));
    const absl::Status s = fsdp::LocalWorld::Run(
        cfg.world, {}, [&](fsdp::Communicator& comm) { return TrainRank(comm, cfg, out); });
    if (!s.ok()) {
      std::fprintf(stderr, "c_api_reference: %s: %s\n", cfg.name, std::string(s.message()).c_str());
      return 1;
    }
    const std::string path = absl::StrCat(argv[1], "/", cfg.name, ".bin");
    if (const absl::Status w = WriteFloats(path, out); !w.ok()) {
      std::fprintf(stderr, "c_api_reference: %s\n", std::string(w.message()).c_str());
      return 1;
    }
    std::printf("c_api_reference: %s: %d ranks, %d steps of %d micro-batches -> %s\n", cfg.name,
                cfg.world, MLP_STEPS, MLP_MICRO_BATCHES, path.c_str());
  }
  std::vector<float> gpt(GPT_REF_FLOATS);
  absl::Status s = fsdp::LocalWorld::Run(
      GPT_RANKS, {}, [&](fsdp::Communicator& comm) { return TrainGpt(comm, gpt); });
  const std::string path = absl::StrCat(argv[1], "/gpt_nano.bin");
  if (s.ok()) s = WriteFloats(path, gpt);
  if (!s.ok()) {
    std::fprintf(stderr, "c_api_reference: gpt_nano: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("c_api_reference: gpt_nano: %d ranks, %d steps -> %s\n", GPT_RANKS, GPT_STEPS,
              path.c_str());
  return 0;
}
