// Uses the installed libfsdp as README.md's first program does: two ranks as threads,
// FULL_SHARD, the nano GPT on the embedded corpus. Keep the two in step.
#include <cmath>
#include <cstdio>

#include "fsdp/local_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_gpt.h"

// Two ranks as threads, FULL_SHARD, the nano GPT on the embedded corpus.
absl::Status Train() {
  auto config = *fsdp::nn::GptConfig::FromName("nano");
  const auto data = fsdp::nn::TokenDataset::FromText(fsdp::nn::EmbeddedCorpus());
  return fsdp::LocalWorld::Run(2, {}, [&](fsdp::Communicator& world) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend,
                          fsdp::CpuBackend::Create({.ranks_sharing_cores = world.size()}));
    backend->BindCurrentThread();  // this rank's share of the cores
    fsdp::nn::ShardedGptOptions options;
    options.sharding.strategy = fsdp::ShardingStrategy::kFullShard;
    options.sharding.max_grad_norm = 1.0f;
    options.batch_size = 8;
    options.seq_len = 64;
    FSDP_ASSIGN_OR_RETURN(auto model,
                          fsdp::nn::ShardedGpt::Create(config, backend.get(), world, options));
    FSDP_ASSIGN_OR_RETURN(auto loader, fsdp::nn::DataLoader::Create(
        &data, {.batch_size = 8, .seq_len = 64, .rank = world.rank(),
                .world_size = world.size()}));
    float first = 0, loss = 0;
    for (int step = 0; step < 100; ++step) {
      fsdp::nn::Batch batch = loader.Next();
      FSDP_ASSIGN_OR_RETURN(loss,
                            model->ForwardBackward(batch.inputs.data(), batch.targets.data()));
      FSDP_ASSIGN_OR_RETURN(fsdp::StepStats stats, model->Step(1e-3f));
      (void)stats;
      if (step == 0) first = loss;
    }
    if (world.rank() == 0) std::printf("consumer: loss %.3f -> %.3f\n", first, loss);
    if (!(loss < first - 1.0f)) return absl::InternalError("the loss did not fall");
    return absl::OkStatus();
  });
}

int main() {
  const absl::Status s = Train();
  if (!s.ok()) {
    std::fprintf(stderr, "consumer: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("consumer: fsdp::fsdp works from an installed package\n");
  return 0;
}
