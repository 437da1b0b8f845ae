// Checkpoint saves against training: how long a synchronous save and a background save
// (AsyncCheckpointer) stop the training thread. One run per mode trains a model (default
// llama-mini, FULL_SHARD) and saves every N steps; it prints, per mode, the median step without
// a save, the median step during which a save starts (with the save's blocking part), the
// median blocking time of a save, and for the background mode the median write time and the
// snapshot's host memory; then the two targets: the step during which a background save starts
// within 1.2x a step plus the snapshot copy, and the background save's blocking time within
// 0.1x the synchronous save's.
//
//   checkpoint_bench [--model llama-mini] [--steps 40] [--every 10] [--batch 4] [--seq 128]
//                    [--dir DIR] [--ranks 2]
//   mpirun -np 2 --bind-to none checkpoint_bench ...   (one rank per process; rank 0 prints)
//
// Without mpirun the ranks are threads of this process (--ranks). Checkpoints go to DIR
// (default: a new directory under $TMPDIR, removed at the end).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fsdp/checkpoint.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/local_world.h"
#include "fsdp/mpi_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/optim.h"
#include "tools/command_line.h"

ABSL_FLAG(std::string, model, "llama-mini", "a bundled model (fsdp_plan --help lists them)");
ABSL_FLAG(int, steps, 40, "training steps per mode");
ABSL_FLAG(int, every, 10, "a save every this many steps");
ABSL_FLAG(int, batch, 4, "sequences per rank");
ABSL_FLAG(int, seq, 128, "sequence length");
ABSL_FLAG(int, ranks, 2, "ranks as threads (without mpirun)");
ABSL_FLAG(std::string, dir, "", "where the checkpoints go (default: a new temporary directory)");

namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct ModeResult {
  std::vector<double> plain_steps, save_steps, blocked, written;
  uint64_t snapshot_bytes = 0;
};

// One rank's run of one mode; rank 0's figures in `out`.
absl::Status RunMode(fsdp::Communicator& world, bool async, const std::string& dir,
                     ModeResult& out) {
  const int steps = absl::GetFlag(FLAGS_steps), every = absl::GetFlag(FLAGS_every);
  FSDP_ASSIGN_OR_RETURN(fsdp::nn::ModelConfig config,
                        fsdp::nn::ModelConfig::FromName(absl::GetFlag(FLAGS_model)));
  FSDP_ASSIGN_OR_RETURN(auto backend,
                        fsdp::CpuBackend::Create({.ranks_sharing_cores = world.size()}));
  backend->BindCurrentThread();
  fsdp::nn::ShardedModelOptions o;
  o.batch_size = absl::GetFlag(FLAGS_batch);
  o.seq_len = absl::GetFlag(FLAGS_seq);
  FSDP_ASSIGN_OR_RETURN(auto model,
                        fsdp::nn::ShardedModel::Create(config, backend.get(), world, o));
  static const auto* data =
      new fsdp::nn::TokenDataset(fsdp::nn::TokenDataset::FromText(fsdp::nn::EmbeddedCorpus()));
  FSDP_ASSIGN_OR_RETURN(fsdp::nn::DataLoader loader,
                        fsdp::nn::DataLoader::Create(
                            data, {.batch_size = o.batch_size, .seq_len = o.seq_len,
                                   .rank = world.rank(), .world_size = world.size()}));
  std::unique_ptr<fsdp::AsyncCheckpointer> saver;
  if (async) {
    FSDP_ASSIGN_OR_RETURN(saver, fsdp::AsyncCheckpointer::Create(model->runtime()));
  }
  const fsdp::WarmupCosine schedule(2, steps, 3e-4f, 3e-5f);
  for (int step = 1; step <= steps; ++step) {
    FSDP_RETURN_IF_ERROR(world.Barrier());  // every rank's step starts together
    const auto t0 = Clock::now();
    const fsdp::nn::Batch b = loader.Next();
    FSDP_RETURN_IF_ERROR(model->ForwardBackward(b.inputs.data(), b.targets.data()).status());
    FSDP_RETURN_IF_ERROR(model->runtime().Step(schedule).status());
    double blocked = 0;
    const bool save = step % every == 0;
    if (save) {
      const std::string to = absl::StrCat(dir, async ? "/async-" : "/sync-", step);
      const auto s0 = Clock::now();
      fsdp::TrainingState st;
      st.data = loader.state();
      if (async) {
        FSDP_RETURN_IF_ERROR(saver->Save(to, st).status());
      } else {
        FSDP_RETURN_IF_ERROR(fsdp::SaveCheckpoint(model->runtime(), to, st));
      }
      blocked = std::chrono::duration<double>(Clock::now() - s0).count();
    }
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    if (step <= 2) continue;  // warm-up
    (save ? out.save_steps : out.plain_steps).push_back(took);
    if (save) out.blocked.push_back(blocked);
  }
  if (saver != nullptr) {
    FSDP_RETURN_IF_ERROR(saver->Wait());
    for (const fsdp::AsyncSaveResult& r : saver->TakeFinished()) {
      FSDP_RETURN_IF_ERROR(r.status);
      out.written.push_back(r.write_seconds);
    }
    out.snapshot_bytes = saver->snapshot_bytes();
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::cli::ParseCommandLine(argc, argv);
  const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  std::unique_ptr<fsdp::Communicator> mpi;
  if (under_mpi) {
    auto w = fsdp::CreateMpiWorld();
    if (!w.ok()) return fsdp::FinishMpi(w.status(), "checkpoint_bench");
    mpi = *std::move(w);
  }
  const bool rank0 = mpi == nullptr || mpi->rank() == 0;
  std::string dir = absl::GetFlag(FLAGS_dir);
  const bool temporary = dir.empty();
  if (temporary) {
    const char* tmp = std::getenv("TMPDIR");
    // Under mpirun the ranks of one host share their launcher's pid (give --dir on a shared
    // file system when they span hosts).
    dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/checkpoint_bench-",
                       mpi != nullptr ? ::getppid() : ::getpid());
  }
  ModeResult modes[2];
  for (int m = 0; m < 2; ++m) {
    auto run = [&](fsdp::Communicator& world) -> absl::Status {
      ModeResult mine;
      FSDP_RETURN_IF_ERROR(RunMode(world, m == 1, dir, mine));
      if (world.rank() == 0) modes[m] = std::move(mine);
      return absl::OkStatus();
    };
    absl::Status s = mpi != nullptr ? run(*mpi)
                                    : fsdp::LocalWorld::Run(absl::GetFlag(FLAGS_ranks), {}, run);
    if (!s.ok()) {
      if (rank0) std::fprintf(stderr, "checkpoint_bench: %s\n", s.ToString().c_str());
      if (mpi != nullptr) return fsdp::FinishMpi(s, "checkpoint_bench");
      return 1;
    }
  }
  int rc = 0;
  if (rank0) {
    const int ranks = mpi != nullptr ? mpi->size() : absl::GetFlag(FLAGS_ranks);
    std::printf("checkpoint_bench: %s, FULL_SHARD on %d ranks (%s), B=%d T=%d, a save every %d "
                "steps, %d steps per mode; medians in ms\n",
                absl::GetFlag(FLAGS_model).c_str(), ranks, mpi != nullptr ? "mpirun" : "threads",
                absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_seq), absl::GetFlag(FLAGS_every),
                absl::GetFlag(FLAGS_steps));
    std::printf("%-12s %10s %16s %12s %12s %14s\n", "save", "step", "step with save",
                "blocked", "written", "snapshot MiB");
    const char* names[2] = {"synchronous", "background"};
    for (int m = 0; m < 2; ++m) {
      const ModeResult& r = modes[m];
      const std::string written = m == 1 ? absl::StrFormat("%.1f", Median(r.written) * 1e3) : "-";
      const std::string snapshot =
          m == 1 ? absl::StrFormat("%.2f", r.snapshot_bytes / 1048576.0) : "-";
      std::printf("%-12s %10.1f %16.1f %12.1f %12s %14s\n", names[m], Median(r.plain_steps) * 1e3,
                  Median(r.save_steps) * 1e3, Median(r.blocked) * 1e3, written.c_str(),
                  snapshot.c_str());
    }
    const ModeResult& a = modes[1];
    const ModeResult& s = modes[0];
    const double step = Median(a.plain_steps), with_save = Median(a.save_steps);
    const double blocked = Median(a.blocked), sync_blocked = Median(s.blocked);
    const bool step_ok = with_save <= 1.2 * step + blocked;
    const bool block_ok = blocked <= 0.1 * sync_blocked;
    std::printf("target: the step during which a background save starts, %.1f ms, <= 1.2 x a "
                "step (%.1f ms) + the snapshot copy (%.1f ms) = %.1f ms: %s\n",
                with_save * 1e3, step * 1e3, blocked * 1e3, (1.2 * step + blocked) * 1e3,
                step_ok ? "PASS" : "FAIL");
    std::printf("target: a background save blocks training for %.1f ms, <= 0.1 x a synchronous "
                "save's %.1f ms (ratio %.3f): %s\n",
                blocked * 1e3, sync_blocked * 1e3, sync_blocked > 0 ? blocked / sync_blocked : 0,
                block_ok ? "PASS" : "FAIL");
    rc = step_ok && block_ok ? 0 : 1;
    if (temporary) std::filesystem::remove_all(dir);
  }
  if (mpi != nullptr) {
    mpi.reset();
    return fsdp::FinishMpi(absl::OkStatus(), "checkpoint_bench") == 0 ? rc : 1;
  }
  return rc;
}
