// train_gpt's flags and their checks (train_gpt_settings.h). Every check happens here, before
// any rank starts: a flag value or combination, the data, the checkpoint and export paths and
// their free space, the backend (through the registry) and whether the model fits the device's
// memory (the memory planner).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "fsdp/agreement.h"
#include "fsdp/backend.h"
#include "fsdp/checkpoint.h"
#include "fsdp/communicator.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/files.h"
#include "fsdp/plan.h"
#include "fsdp/registry.h"
#include "fsdp/local_world.h"
#include "fsdp/mpi_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/optim.h"
#include "tools/command_line.h"

#include "examples/train_gpt_settings.h"

ABSL_FLAG(std::string, model, "",
          "the model: GPT nano, mini, gpt2, gpt2-medium, gpt2-xl; Llama 2 llama-nano, "
          "llama-mini, llama2-7b, llama2-13b, llama2-70b (default: nano)");
ABSL_FLAG(std::string, config, "", "the older name of --model (default: nano)");
ABSL_FLAG(int, layers, 0, "override the config's number of layers L (0 = keep the config's)");
ABSL_FLAG(int, channels, 0, "override the config's width C (0 = keep the config's)");
ABSL_FLAG(int, heads, 0, "override the config's number of heads H (0 = keep the config's)");
ABSL_FLAG(int, kv_heads, 0,
          "Llama only: override the number of key/value heads Hkv (0 = keep the config's)");
ABSL_FLAG(int, ranks, 2, "data-parallel ranks, as threads of this process (ignored under mpirun)");
ABSL_FLAG(int, ranks_per_process, 1,
          "under mpirun: ranks each process plays as threads (1 to 1024), e.g. one per device of "
          "a PJRT plugin's client; the world is processes x this, rank = process * this + thread");
ABSL_FLAG(std::string, strategy, "FULL_SHARD",
          "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_GRAD_OP");
ABSL_FLAG(int, hybrid_shard, 0,
          "ranks per shard group, for the HYBRID strategies only (a divisor of the rank count); "
          "0 = the ranks of one host (under mpirun: each host a shard group)");
ABSL_FLAG(int, secondary_shard, 0,
          "FULL_SHARD and HYBRID_SHARD: after a unit's forward keep 1/N of its parameters on "
          "each rank, so that backward gathers it from the N ranks of its host only (DeepSpeed "
          "ZeRO++'s hpZ, FSDP2's reshard_after_forward=N); N divides the shard group and the "
          "ranks of a host, 2 <= N < shard group size; 0 = off");
ABSL_FLAG(bool, prefetch, true, "prefetch the next units' all-gathers while a unit computes");
ABSL_FLAG(int, prefetch_units, 1,
          "with --prefetch: units gathered ahead of the one computing (FSDP's limit_all_gathers; "
          "each raises the peak of gathered parameters by one unit)");
ABSL_FLAG(int, batch, 16,
          "sequences per step, over all ranks (a multiple of ranks x micro_batches)");
ABSL_FLAG(int, micro_batches, 1, "gradient accumulation: micro-batches per step");
ABSL_FLAG(std::string, accumulate, "auto",
          "how micro-batches accumulate their gradients: no_sync (whole gradients held until "
          "the last micro-batch, one reduction per step), sharded (reduce-scattered every "
          "micro-batch into the gradient shard; HYBRID all-reduces across replicas only in the "
          "last), every (every reduction every micro-batch), or auto (sharded for the HYBRID "
          "strategies, every with them under --offload all, no_sync for the others)");
ABSL_FLAG(int, seq, 64, "sequence length T (at most the config's block size)");
ABSL_FLAG(int, steps, 1000, "optimizer steps (a resumed run continues up to this step)");
ABSL_FLAG(double, lr, 3e-4, "peak learning rate (AdamW; MODEL_SPEC.md's default)");
ABSL_FLAG(
    std::string, schedule, "cosine",
    "cosine: warmup, then a half cosine down to lr / 10 at --steps; constant: warmup, then lr");
ABSL_FLAG(int, warmup, 50, "linear warmup steps (0 = none)");
ABSL_FLAG(double, beta1, 0.9, "AdamW beta1");
ABSL_FLAG(double, beta2, 0.95, "AdamW beta2");
ABSL_FLAG(double, eps, 1e-8, "AdamW epsilon");
ABSL_FLAG(double, weight_decay, 0.1, "AdamW weight decay of weights and embeddings");
ABSL_FLAG(double, clip, 1.0, "clip gradients to this global L2 norm (0 = off)");
ABSL_FLAG(std::string, param_dtype, "f32",
          "mixed precision: f32, bf16 or f16 for the gathered parameters and the matmuls");
ABSL_FLAG(std::string, reduce_dtype, "f32",
          "mixed precision: f32, bf16 or f16 for gradient reductions");
ABSL_FLAG(std::string, all_gather_format, "dtype",
          "what the parameter all-gather carries: dtype (param_dtype), int8 or fp8 (e4m3 codes "
          "with one f32 scale per --quant_block elements: about a quarter of f32's bytes; "
          "DeepSpeed ZeRO++'s qwZ)");
ABSL_FLAG(std::string, reduction_format, "dtype",
          "what the gradient reduction carries: dtype (reduce_dtype), int8 or fp8 (codes with "
          "one f32 scale per --quant_block elements, each rank's gradient quantized once and "
          "the sum taken in f32: an all_to_all in the shard group, an all_gather of the reduced "
          "shard's codes across replicas; DeepSpeed ZeRO++'s qgZ). Needs --reduce_dtype f32");
ABSL_FLAG(int, quant_block, 256,
          "elements per scale of a quantized all-gather or reduction: a power of two from 16 "
          "to 65536");
ABSL_FLAG(double, loss_scaling, 0,
          "dynamic loss scaling starting from this scale, e.g. 65536 (for f16; 0 = off)");
ABSL_FLAG(int, checkpoint_every_blocks, 0,
          "activation checkpointing: recompute block i in backward when i % K == 0 (1 = every "
          "block; 0 = off)");
ABSL_FLAG(uint64_t, seed, 1, "seed of the initialisation, the data order and the sampling");
ABSL_FLAG(int, threads, 0,
          "OpenMP threads per rank (0 = the cores divided among the ranks; at most the "
          "machine's hardware threads)");
ABSL_FLAG(std::string, data, "",
          "token file (.bin of uint16) or text file; default: the embedded corpus");
ABSL_FLAG(int64_t, max_data_bytes,
          static_cast<int64_t>(fsdp::nn::TokenDataset::kDefaultMaxFileBytes),
          "largest --data file read (it is held in memory, 2 bytes per token)");
ABSL_FLAG(int, log_every, 50, "print a progress line every this many steps");
ABSL_FLAG(int, eval_every, 250, "validation loss every this many steps (0 = only at the end)");
ABSL_FLAG(int, sample_tokens, 300, "tokens to sample after training (0 = none)");
ABSL_FLAG(double, temperature, 0.8, "sampling temperature (0 = greedy)");
ABSL_FLAG(std::string, prompt, "This License", "text the samples start from");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "sharded checkpoints go to DIR/step-N; training resumes from the latest intact one");
ABSL_FLAG(int, checkpoint_every, 0,
          "save a checkpoint every this many steps (0 = at the end); needs --checkpoint_dir");
ABSL_FLAG(bool, checkpoint_async, false,
          "save checkpoints in the background: each rank's shards are copied to host memory "
          "and written while training goes on (at most one save in flight: a save waits for "
          "the previous one); needs --checkpoint_dir");
ABSL_FLAG(int64_t, checkpoint_async_max_mib, 0,
          "--checkpoint_async: the most host memory a rank's snapshot may take, MiB (0: no "
          "bound); a save over it is left out, saying so, and training goes on (the run's last "
          "save is not: its failure fails the run)");
ABSL_FLAG(bool, checkpoint_fallback, true,
          "resume past a checkpoint one of whose files is damaged or missing, from the next "
          "older intact one, saying so; false: such a checkpoint stops the run with the file "
          "and the reason");
ABSL_FLAG(std::string, init_safetensors, "",
          "start from the parameters of this .safetensors file, index (.index.json) or "
          "directory in the Hugging Face layout (a checkpoint to resume from wins)");
ABSL_FLAG(std::string, export_safetensors, "",
          "write the trained model to this .safetensors file (a new file, or a safetensors "
          "file it replaces)");
ABSL_FLAG(std::string, export_hf_dir, "",
          "write the trained model to this directory in the Hugging Face layout "
          "(model.safetensors, or files of at most --export_max_file_mb with "
          "model.safetensors.index.json; config.json for Llama models, so that "
          "LlamaForCausalLM.from_pretrained loads it): a new directory or an earlier export, "
          "which it replaces");
ABSL_FLAG(double, export_max_file_mb, 5000,
          "--export_hf_dir: the largest file, in MB of 10^6 bytes (5000: transformers' 5GB; "
          "0.5: 500 KB)");
ABSL_FLAG(bool, allow_model_change, false,
          "resume from a checkpoint, or start from --init_safetensors, that records another "
          "model configuration (e.g. another number of heads) with tensors of the same shapes; "
          "without it such a file is refused");
ABSL_FLAG(std::string, nonfinite, "error",
          "when the gradients hold inf or NaN: error (stop, exit 1) or skip (skip the step on "
          "every rank and count it)");
ABSL_FLAG(std::string, backend, "cpu",
          "cpu; sim: the strict simulated accelerator (device memory the host cannot read, "
          "every op asynchronous on a stream; ranks as threads only), to check an integration "
          "against the device contract; or pjrt: a PJRT plugin's devices, one per rank (ranks as "
          "threads; under mpirun --ranks_per_process ranks per process; --pjrt_plugin); or cuda: NVIDIA GPUs, rank r on GPU r mod the GPUs "
          "this process sees (ranks as threads may share one GPU)");
ABSL_FLAG(std::string, pjrt_plugin, "",
          "with --backend pjrt: the PJRT plugin to load (a .so exporting GetPjrtApi: the XLA CPU "
          "plugin, libtpu, the Neuron plugin); empty: $FSDP_PJRT_PLUGIN");
ABSL_FLAG(int64_t, device_memory_mib, 0,
          "memory each rank's device may hold, in MiB (0 = what the system gives); past it an "
          "allocation is an out-of-memory error naming the buffer, as on an accelerator");
ABSL_FLAG(std::string, offload, "none",
          "none, optimizer: the AdamW state of the units --offload_budget_mib takes lives in "
          "host memory and is updated there, overlapped with the device, or all: their parameter "
          "and gradient shards too (device backends: sim, cuda; the cpu backend's device is the "
          "host)");
ABSL_FLAG(int64_t, offload_budget_mib, -1,
          "with --offload optimizer|all: host memory per rank the offload may take, in MiB (16 "
          "bytes per shard element of a unit, 20 with all; units are taken largest first while "
          "they fit); -1 = every unit");
ABSL_FLAG(double, sim_host_gbps, 0,
          "with --backend sim: the simulated host-device link in GB/s (PCIe 4 x16: about 25), "
          "which offload's copies cross (0 = unlimited)");

namespace train_gpt {
namespace {

using fsdp::nn::ModelConfig;

// A bad flag value, naming the flag, the value and what is allowed, e.g.
// "--steps=-1: allowed: 1 or more optimizer steps".
template <typename T>
absl::Status BadFlag(std::string_view flag, const T& value, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", std::string(flag), "=", value, ": ", std::string(what)));
}
// The same with a message from the library (its own status code).
absl::Status FlagError(std::string_view flag, std::string_view value, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("--", std::string(flag), "=", std::string(value),
                                             ": ", s.message()));
}

bool Finite(double x) { return std::isfinite(x); }
// A value that becomes an f32 of the optimizer: finite as a float too (1e308 is not), and
// not flushed to zero when it is > 0 (1e-50 is).
bool FiniteAsFloat(double x) {
  const float f = static_cast<float>(x);
  return std::isfinite(x) && std::isfinite(f) && (x <= 0 || f > 0);
}

// A flag naming a float dtype (f32, bf16 or f16).
absl::StatusOr<fsdp::DType> FloatDTypeFlag(std::string_view flag, const std::string& value) {
  const std::optional<fsdp::DType> d = fsdp::ParseDType(value);
  if (d.has_value() && fsdp::IsFloat16Or32(*d)) return *d;
  return BadFlag(flag, value, "allowed: f32, bf16 or f16");
}

// A file a flag names must be a regular file we can open.
absl::Status CheckReadableFile(std::string_view flag, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return BadFlag(flag, path, absl::StrCat("cannot open it: ", std::strerror(errno)));
  struct stat st;
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  ::close(fd);
  if (!regular) return BadFlag(flag, path, "not a regular file");
  return absl::OkStatus();
}

// Smallest corpus whose last 10% (the validation split) and first 90% both hold `need` tokens.
int64_t SmallestCorpus(int64_t need, double val_fraction) {
  int64_t n = need;
  while (static_cast<int64_t>(val_fraction * n) < need ||
         n - static_cast<int64_t>(val_fraction * n) < need) {
    ++n;
  }
  return n;
}

// Whether the run saves a checkpoint after step `n` (1-based), starting after step `start`.
bool SavesAt(const Settings& s, int64_t n, int64_t start) {
  return n > start && n <= s.steps &&
         (n == s.steps || (s.checkpoint_every > 0 && n % s.checkpoint_every == 0));
}

// How many checkpoints a run from step `start` saves.
int64_t SavesPlanned(const Settings& s, int64_t start) {
  if (start >= s.steps) return 0;
  if (s.checkpoint_every <= 0) return 1;
  const int64_t every = s.checkpoint_every;
  return s.steps / every - start / every + (s.steps % every != 0 ? 1 : 0);
}

// A cleaned-up entry as train_gpt says it: "removed PATH: why" or "PATH: what was done".
std::string Said(const fsdp::CheckpointCleanup& c) {
  constexpr std::string_view kRemoved = "removed: ";
  if (c.action.starts_with(kRemoved)) {
    return absl::StrCat("removed ", c.path, ": ", c.action.substr(kRemoved.size()));
  }
  return absl::StrCat(c.path, ": ", c.action);
}

// "step-N" with N in decimal as train_gpt names its saves: N, else 0.
int64_t SaveStepOf(const std::string& name) {
  if (!name.starts_with("step-") || name.size() < 6 || name.size() > 15 || name[5] == '0') {
    return 0;
  }
  const std::string digits = name.substr(5);
  if (!std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
    return 0;
  }
  return std::stoll(digits);
}

// Rank 0: takes the checkpoint directory's lock for the run (no second job saves there),
// cleans up what crashed saves left, and finds any entry in the way of a save this run will
// make. Returns the number of checkpoints the run saves.
absl::StatusOr<int64_t> PrepareCheckpointDir(Settings& s) {
  const std::string& dir = s.checkpoint_dir;
  auto lock = fsdp::CheckpointDirLock::Acquire(dir);
  if (!lock.ok()) return FlagError("checkpoint_dir", dir, lock.status());
  s.checkpoint_lock = std::make_shared<fsdp::CheckpointDirLock>(*std::move(lock));
  auto cleaned = fsdp::CleanUpCheckpointDirectory(dir);
  if (!cleaned.ok()) return FlagError("checkpoint_dir", dir, cleaned.status());
  for (const fsdp::CheckpointCleanup& c : *cleaned) s.notes.push_back(Said(c));
  int64_t start = 0;  // the step the run resumes from
  if (absl::StatusOr<std::string> latest = fsdp::LatestCheckpoint(dir); latest.ok()) {
    start = fsdp::CheckpointStep(*latest).value_or(0);
  }
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const int64_t n = SaveStepOf(name);
    if (n == 0 || !SavesAt(s, n, start)) continue;
    if (absl::Status in_the_way = fsdp::CheckCanSaveCheckpoint(e.path().string());
        !in_the_way.ok()) {
      return FlagError("checkpoint_dir", dir,
                       absl::InvalidArgumentError(absl::StrCat("this run saves ", name,
                                                               " after step ", n, ", but ",
                                                               in_the_way.message())));
    }
  }
  return SavesPlanned(s, start);
}

// Rank 0: the export is a new file or a safetensors file, not a file the run reads; the
// temporary files of killed exports beside it are removed.
absl::Status PrepareExport(Settings& s, const std::string& data_path) {
  std::vector<std::string> inputs;
  if (!data_path.empty()) inputs.push_back("--data=" + data_path);
  if (!s.init_safetensors.empty()) inputs.push_back("--init_safetensors=" + s.init_safetensors);
  if (absl::Status w = fsdp::CheckExportPathWritable(s.export_path, inputs); !w.ok()) {
    return FlagError("export_safetensors", s.export_path, w);
  }
  auto removed = fsdp::RemoveDeadExportTemporaries(s.export_path);
  if (!removed.ok()) return FlagError("export_safetensors", s.export_path, removed.status());
  for (const std::string& r : *removed) {
    s.notes.push_back(absl::StrCat("removed ", r, ": the temporary file of an export that was "
                                   "killed"));
  }
  return absl::OkStatus();
}

// Rank 0, the rule for free space: refused when the first checkpoint (with the export, when
// both are on one file system) cannot fit; a warning when not all the `saves` checkpoints of
// the run can (train_gpt keeps every one).
absl::Status CheckFreeSpace(Settings& s, int world_size, int64_t saves) {
  const fsdp::nn::ModelConfig& c = s.config;
  const int64_t tensors = static_cast<int64_t>(c.ParamSpecs().size());
  const uint64_t ckpt = fsdp::CheckpointBytes(c.num_parameters(), tensors, 2, world_size);
  const uint64_t exported =
      fsdp::SafetensorsExportBytes(c.num_parameters(), tensors, fsdp::DType::kF32);
  const bool to_ckpt = !s.checkpoint_dir.empty() && saves > 0, to_export = !s.export_path.empty();
  const bool same_fs = to_ckpt && to_export && fsdp::SameFileSystem(s.checkpoint_dir,
                                                                      s.export_path);
  auto too_little = [](const std::string& flag, const std::string& where, uint64_t free,
                       const std::string& what, uint64_t need) {
    return FlagError(flag, where, absl::ResourceExhaustedError(absl::StrCat(
        "the file system has ", fsdp::FormatBytes(free), " free, and ", what, " needs ",
        fsdp::FormatBytes(need), ": free some space or write elsewhere")));
  };
  if (to_ckpt) {
    const uint64_t extra = same_fs ? exported : 0;
    absl::StatusOr<uint64_t> free = fsdp::FreeBytesAt(s.checkpoint_dir);
    if (free.ok() && *free < ckpt + extra) {
      return too_little("checkpoint_dir", s.checkpoint_dir, *free,
                        same_fs ? "a checkpoint and the export" : "one checkpoint", ckpt + extra);
    }
    const uint64_t all = ckpt * static_cast<uint64_t>(saves) + extra;
    if (free.ok() && *free < all) {
      s.warnings.push_back(absl::StrCat(
          "--checkpoint_dir=", s.checkpoint_dir, ": the file system has ",
          fsdp::FormatBytes(*free), " free, less than the ", fsdp::FormatBytes(all), " that the ",
          saves, " checkpoints of this run (", fsdp::FormatBytes(ckpt), " each, every one kept)",
          same_fs ? " and the export" : "", " need: saves will fail when it is full"));
    }
  }
  if (to_export && !same_fs) {
    absl::StatusOr<uint64_t> free = fsdp::FreeBytesAt(s.export_path);
    if (free.ok() && *free < exported) {
      return too_little("export_safetensors", s.export_path, *free, "the export", exported);
    }
  }
  if (!s.export_hf_dir.empty()) {
    absl::StatusOr<uint64_t> free = fsdp::FreeBytesAt(s.export_hf_dir);
    if (free.ok() && *free < exported) {
      return too_little("export_hf_dir", s.export_hf_dir, *free, "the export", exported);
    }
  }
  return absl::OkStatus();
}

// Rank 0, at start-up, for the files the run will write (each error is bad usage).
absl::Status PrepareOutputs(Settings& s, int world_size, const std::string& data_path) {
  int64_t saves = 0;
  if (!s.checkpoint_dir.empty()) {
    FSDP_ASSIGN_OR_RETURN(saves, PrepareCheckpointDir(s));
  }
  if (!s.export_path.empty()) FSDP_RETURN_IF_ERROR(PrepareExport(s, data_path));
  if (!s.export_hf_dir.empty()) {
    if (absl::Status w = fsdp::CheckExportDirectoryWritable(s.export_hf_dir, {"config.json"});
        !w.ok()) {
      return FlagError("export_hf_dir", s.export_hf_dir, w);
    }
  }
  return CheckFreeSpace(s, world_size, saves);
}

// Before anything is allocated: the memory planner's peak per rank against the device's
// memory (--device_memory_mib) and, for the backends whose device memory is the host's, the
// host's memory for the ranks on this host.
absl::Status CheckFitsMemory(const Settings& s, int world_size, const std::string& backend) {
  fsdp::PlanRequest r;
  r.model = s.config.name();
  r.config = s.config;
  r.world_size = world_size;
  r.ranks_per_host = world_size % s.ranks_on_host == 0 ? s.ranks_on_host : 0;
  r.strategy = s.model.sharding.strategy;
  r.hybrid_shard_size = s.model.sharding.hybrid_shard_size;
  r.param_dtype = s.model.sharding.mixed_precision.param_dtype;
  r.reduce_dtype = s.model.sharding.mixed_precision.reduce_dtype;
  r.checkpoint_every = s.model.checkpoint_every;
  r.batch_size = s.model.batch_size;
  r.seq_len = s.model.seq_len;
  r.forward_prefetch = s.model.sharding.forward_prefetch;
  r.backward_prefetch = s.model.sharding.backward_prefetch;
  r.max_prefetch_units = s.model.sharding.max_prefetch_units;
  r.communication = s.model.sharding.communication;
  r.secondary_shard_size = s.model.sharding.secondary_shard_size;
  r.async_checkpoint = s.checkpoint_async;
  r.offload = s.model.sharding.offload;
  // The peak of K >= 2 micro-batches is that of 2: the second holds whatever the first kept.
  r.micro_batches = std::min(s.micro_batches, 2);
  r.accumulation = s.accumulation;
  const absl::StatusOr<fsdp::MemoryPlan> plan = fsdp::PlanMemory(r);
  if (!plan.ok()) {
    return absl::Status(plan.status().code(),
                        absl::StrCat("the memory planner: ", plan.status().message()));
  }
  absl::Status fits = fsdp::CheckPlanFits(*plan, s.device_memory_bytes, s.ranks_on_host,
                                          /*device_is_host=*/backend == "cpu" || backend == "sim",
                                          /*can_offload=*/backend != "cpu");
  if (!fits.ok() && s.device_memory_bytes > 0 && plan->peak_bytes > s.device_memory_bytes) {
    return FlagError("device_memory_mib", absl::StrCat(s.device_memory_bytes >> 20), fits);
  }
  return fits;
}

}  // namespace

absl::StatusOr<Settings> SettingsFromFlags(int world_size, int ranks_on_host, int rank,
                                           bool ranks_share_process, int ranks_per_process) {
  const int ranks_here = ranks_share_process ? world_size : ranks_per_process;
  Settings s;
  FSDP_RETURN_IF_ERROR(fsdp::CommTimeoutFromEnv().status());

  // The model: a named config means that config; --layers, --channels, --heads (and
  // --kv_heads for Llama) override it. --model and --config are two names of one flag.
  std::string config_flag = "config", config_name = absl::GetFlag(FLAGS_config);
  if (const std::string m = absl::GetFlag(FLAGS_model); !m.empty()) {
    if (!config_name.empty() && m != config_name) {
      return BadFlag("model", m, absl::StrCat("--config=", config_name, " names another model; "
                                              "give one of the two"));
    }
    config_flag = "model";
    config_name = m;
  }
  if (config_name.empty()) config_name = "nano";
  auto config = ModelConfig::FromName(config_name);
  if (!config.ok()) return FlagError(config_flag, config_name, config.status());
  const int layers = absl::GetFlag(FLAGS_layers), channels = absl::GetFlag(FLAGS_channels),
            heads = absl::GetFlag(FLAGS_heads), kv_heads = absl::GetFlag(FLAGS_kv_heads);
  if (layers < 0) return BadFlag("layers", layers, "allowed: 0 (keep the config's) or more");
  if (channels < 0) return BadFlag("channels", channels, "allowed: 0 (keep the config's) or more");
  if (heads < 0) return BadFlag("heads", heads, "allowed: 0 (keep the config's) or more");
  if (kv_heads < 0) return BadFlag("kv_heads", kv_heads, "allowed: 0 (keep the config's) or more");
  if (config->is_gpt()) {
    if (kv_heads > 0) {
      return BadFlag("kv_heads", kv_heads,
                     absl::StrCat("only Llama models have key/value heads, not --", config_flag,
                                  "=", config_name));
    }
    fsdp::nn::GptConfig c = config->gpt();
    if (layers > 0) c.num_layers = layers;
    if (channels > 0) c.channels = channels;
    if (heads > 0) c.num_heads = heads;
    s.config = c;
  } else {
    fsdp::nn::LlamaConfig c = config->llama();
    if (layers > 0) c.num_layers = layers;
    if (channels > 0) c.channels = channels;
    if (heads > 0) c.num_heads = heads;
    if (kv_heads > 0) c.num_kv_heads = kv_heads;
    s.config = c;
  }
  if (absl::Status v = s.config.Validate(); !v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", config_flag, "=", config_name, " with --layers=", layers, " --channels=", channels,
        " --heads=", heads, config->is_llama() ? absl::StrCat(" --kv_heads=", kv_heads) : "",
        ": ", v.message()));
  }

  // Ranks and sharding.
  if (ranks_share_process && (world_size < 1 || world_size > 1024)) {
    return BadFlag("ranks", world_size, "allowed: 1 to 1024 ranks as threads of this process");
  }
  const std::string strategy = absl::GetFlag(FLAGS_strategy);
  auto parsed = fsdp::ParseStrategy(strategy);
  if (!parsed.ok()) return FlagError("strategy", strategy, parsed.status());
  s.model.sharding.strategy = *parsed;
  const bool hybrid = *parsed == fsdp::ShardingStrategy::kHybridShard ||
                      *parsed == fsdp::ShardingStrategy::kHybridShardGradOp;
  const int hybrid_shard = absl::GetFlag(FLAGS_hybrid_shard);
  if (!hybrid && hybrid_shard != 0) {
    return BadFlag("hybrid_shard", hybrid_shard,
                   absl::StrCat("only the HYBRID_SHARD and HYBRID_SHARD_GRAD_OP strategies use "
                                "it, not --strategy=", std::string(fsdp::StrategyName(*parsed)),
                                "; leave it out or choose a HYBRID strategy"));
  }
  if (hybrid && (hybrid_shard < 0 || hybrid_shard > world_size ||
                 (hybrid_shard > 0 && world_size % hybrid_shard != 0))) {
    return BadFlag("hybrid_shard", hybrid_shard,
                   absl::StrCat("--strategy=", std::string(fsdp::StrategyName(*parsed)),
                                " needs the ranks per shard group: a divisor of the ", world_size,
                                " ranks, or 0 for the ranks of one host"));
  }
  s.model.sharding.hybrid_shard_size = hybrid_shard;
  const int secondary = absl::GetFlag(FLAGS_secondary_shard);
  if (secondary != 0) {
    fsdp::ShardingOptions probe = s.model.sharding;
    probe.secondary_shard_size = secondary;
    // Against the shard group's size when the flags decide it; with each host a shard group
    // (known at start-up) only the strategy and the range here, the runtime checks the rest.
    const int shard = hybrid ? hybrid_shard : world_size;
    if (absl::Status c = fsdp::CheckSecondaryShard(probe, shard); !c.ok()) {
      return BadFlag("secondary_shard", secondary, std::string(c.message()));
    }
  }
  s.model.sharding.secondary_shard_size = secondary;
  s.model.sharding.forward_prefetch = s.model.sharding.backward_prefetch =
      absl::GetFlag(FLAGS_prefetch);
  const int prefetch_units = absl::GetFlag(FLAGS_prefetch_units);
  if (prefetch_units < 1 || prefetch_units > 64) {
    return BadFlag("prefetch_units", prefetch_units,
                   "allowed: 1 to 64 units (--noprefetch turns prefetching off)");
  }
  if (!absl::GetFlag(FLAGS_prefetch) && prefetch_units != 1) {
    return BadFlag("prefetch_units", prefetch_units,
                   "sets how far --prefetch looks ahead, and --noprefetch turns prefetching "
                   "off; leave one of the two out");
  }
  s.model.sharding.max_prefetch_units = prefetch_units;

  // Batch and sequence.
  const int batch = absl::GetFlag(FLAGS_batch);
  s.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  if (s.micro_batches < 1) return BadFlag("micro_batches", s.micro_batches, "allowed: 1 or more");
  if (const std::string a = absl::GetFlag(FLAGS_accumulate); a == "auto") {
    const fsdp::ShardingStrategy st = s.model.sharding.strategy;
    s.accumulation = st == fsdp::ShardingStrategy::kHybridShard ||
                             st == fsdp::ShardingStrategy::kHybridShardGradOp
                         ? fsdp::Accumulation::kSharded
                         : fsdp::Accumulation::kNoSync;
  } else {
    absl::StatusOr<fsdp::Accumulation> acc = fsdp::ParseAccumulation(a);
    if (!acc.ok()) return BadFlag("accumulate", a, "allowed: auto, no_sync, sharded or every");
    s.accumulation = *acc;
  }
  const int rows = world_size * s.micro_batches;
  if (batch < 1 || batch % rows != 0) {
    return BadFlag("batch", batch,
                   absl::StrCat("allowed: a positive multiple of ", rows, " (", world_size,
                                " ranks x ", s.micro_batches, " micro-batches)"));
  }
  s.model.batch_size = batch / rows;
  s.model.seq_len = absl::GetFlag(FLAGS_seq);
  if (s.model.seq_len < 1 || s.model.seq_len > s.config.block_size()) {
    return BadFlag("seq", s.model.seq_len,
                   absl::StrCat("allowed: 1 to the block size of --model=", s.config.name(),
                                ", ", s.config.block_size()));
  }

  // Optimizer and schedule (MODEL_SPEC.md's AdamW defaults).
  const double lr = absl::GetFlag(FLAGS_lr), beta1 = absl::GetFlag(FLAGS_beta1),
               beta2 = absl::GetFlag(FLAGS_beta2), eps = absl::GetFlag(FLAGS_eps),
               wd = absl::GetFlag(FLAGS_weight_decay), clip = absl::GetFlag(FLAGS_clip);
  constexpr char kF32[] = " that an f32 holds (about 1.2e-38 to 3.4e+38)";
  if (!FiniteAsFloat(lr) || lr <= 0) {
    return BadFlag("lr", lr, absl::StrCat("allowed: a learning rate > 0", kF32));
  }
  if (!Finite(beta1) || beta1 < 0 || beta1 >= 1) return BadFlag("beta1", beta1, "allowed: [0, 1)");
  if (!Finite(beta2) || beta2 < 0 || beta2 >= 1) return BadFlag("beta2", beta2, "allowed: [0, 1)");
  if (!FiniteAsFloat(eps) || eps <= 0) {
    return BadFlag("eps", eps, absl::StrCat("allowed: a number > 0", kF32));
  }
  if (!FiniteAsFloat(wd) || wd < 0) {
    return BadFlag("weight_decay", wd, absl::StrCat("allowed: 0 or more", kF32));
  }
  if (!FiniteAsFloat(clip) || clip < 0) {
    return BadFlag("clip", clip, absl::StrCat("allowed: 0 (off) or a norm > 0", kF32));
  }
  s.max_lr = static_cast<float>(lr);
  s.model.sharding.adamw = {.lr = s.max_lr,
                            .beta1 = static_cast<float>(beta1),
                            .beta2 = static_cast<float>(beta2),
                            .eps = static_cast<float>(eps),
                            .weight_decay = static_cast<float>(wd)};
  s.model.sharding.max_grad_norm = static_cast<float>(clip);
  const std::string schedule = absl::GetFlag(FLAGS_schedule);
  if (schedule == "cosine") {
    s.schedule = Schedule::kCosine;
  } else if (schedule == "constant") {
    s.schedule = Schedule::kConstant;
  } else {
    return BadFlag("schedule", schedule, "allowed: cosine or constant");
  }
  s.warmup = absl::GetFlag(FLAGS_warmup);
  if (s.warmup < 0) return BadFlag("warmup", s.warmup, "allowed: 0 (no warmup) or more steps");

  // Mixed precision and activation checkpointing.
  fsdp::MixedPrecision& mp = s.model.sharding.mixed_precision;
  FSDP_ASSIGN_OR_RETURN(mp.param_dtype,
                        FloatDTypeFlag("param_dtype", absl::GetFlag(FLAGS_param_dtype)));
  FSDP_ASSIGN_OR_RETURN(mp.reduce_dtype,
                        FloatDTypeFlag("reduce_dtype", absl::GetFlag(FLAGS_reduce_dtype)));
  fsdp::CommunicationOptions& comm = s.model.sharding.communication;
  {
    const std::string f = absl::GetFlag(FLAGS_all_gather_format);
    absl::StatusOr<fsdp::WireFormat> format = fsdp::ParseWireFormat(f);
    if (!format.ok()) return BadFlag("all_gather_format", f, "allowed: dtype, int8 or fp8");
    comm.all_gather = *format;
    const std::string r = absl::GetFlag(FLAGS_reduction_format);
    format = fsdp::ParseWireFormat(r);
    if (!format.ok()) return BadFlag("reduction_format", r, "allowed: dtype, int8 or fp8");
    comm.reduction = *format;
    if (comm.reduction != fsdp::WireFormat::kDType && mp.reduce_dtype != fsdp::DType::kF32) {
      return BadFlag("reduction_format", r,
                     absl::StrCat("a quantized reduction adds in f32 from the f32 gradient: it "
                                  "needs --reduce_dtype f32, not ",
                                  std::string(fsdp::DTypeName(mp.reduce_dtype))));
    }
    comm.block_size = absl::GetFlag(FLAGS_quant_block);
    if (!fsdp::CheckCommunicationOptions(comm).ok()) {
      return BadFlag("quant_block", comm.block_size, "allowed: a power of two from 16 to 65536");
    }
  }
  const double loss_scaling = absl::GetFlag(FLAGS_loss_scaling);
  if (!Finite(loss_scaling) || loss_scaling < 0 || loss_scaling > 3e38) {
    return BadFlag("loss_scaling", loss_scaling,
                   "allowed: 0 (off) or the initial scale of dynamic loss scaling, e.g. 65536");
  }
  mp.dynamic_loss_scale = loss_scaling > 0;
  if (mp.dynamic_loss_scale) mp.initial_loss_scale = static_cast<float>(loss_scaling);
  if (mp.dynamic_loss_scale && comm.reduction != fsdp::WireFormat::kDType) {
    return BadFlag("loss_scaling", loss_scaling,
                   absl::StrCat("allowed: 0 (off) with --reduction_format ",
                                std::string(fsdp::WireFormatName(comm.reduction)),
                                ": block codes round the small gradients loss scaling keeps to "
                                "zero; train in bf16 without loss scaling, or reduce in dtype"));
  }
  if (mp.param_dtype == fsdp::DType::kF16 && !mp.dynamic_loss_scale) {
    s.warnings.push_back(
        "--param_dtype=f16 without --loss_scaling: small gradients may underflow to zero in "
        "f16; consider --loss_scaling 65536");
  }
  s.model.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every_blocks);
  if (s.model.checkpoint_every < 0 || s.model.checkpoint_every > s.config.num_layers()) {
    return BadFlag("checkpoint_every_blocks", s.model.checkpoint_every,
                   absl::StrCat("allowed: 0 (off) to the number of layers, ", s.config.num_layers()));
  }

  const std::string nonfinite = absl::GetFlag(FLAGS_nonfinite);
  if (nonfinite == "error") {
    s.model.sharding.nonfinite = fsdp::NonFinitePolicy::kError;
  } else if (nonfinite == "skip") {
    s.model.sharding.nonfinite = fsdp::NonFinitePolicy::kSkip;
  } else {
    return BadFlag("nonfinite", nonfinite, "allowed: error or skip");
  }
  const int64_t device_mib = absl::GetFlag(FLAGS_device_memory_mib);
  if (device_mib < 0 || device_mib > (int64_t{1} << 30)) {
    return BadFlag("device_memory_mib", device_mib, "allowed: 0 (no limit) or a size in MiB");
  }
  s.device_memory_bytes = device_mib << 20;
  {
    const std::string what = absl::GetFlag(FLAGS_offload);
    absl::StatusOr<fsdp::OffloadKind> kind = fsdp::ParseOffload(what);
    if (!kind.ok()) return BadFlag("offload", what, "allowed: none, optimizer or all");
    s.model.sharding.offload.what = *kind;
    const int64_t budget = absl::GetFlag(FLAGS_offload_budget_mib);
    if (budget < -1 || budget > (int64_t{1} << 30)) {
      return BadFlag("offload_budget_mib", budget,
                     "allowed: -1 (every unit) or the host MiB per rank the offload may take");
    }
    if (budget != -1 && *kind == fsdp::OffloadKind::kNone) {
      return BadFlag("offload_budget_mib", budget, "needs --offload optimizer or all");
    }
    s.model.sharding.offload.budget_bytes = budget < 0 ? -1 : budget << 20;
    const int64_t host = fsdp::HostPhysicalMemoryBytes();
    if (budget > 0 && host > 0 && (budget << 20) * ranks_on_host > host) {
      return BadFlag("offload_budget_mib", budget,
                     absl::StrCat("the ", ranks_on_host, " rank(s) on this host would take ",
                                  (budget * ranks_on_host) >> 10, " GiB of its ", host >> 30,
                                  " GiB of memory; give at most ", (host >> 20) / ranks_on_host,
                                  " MiB per rank"));
    }
  }

  // The run.
  s.steps = absl::GetFlag(FLAGS_steps);
  if (s.steps < 1) return BadFlag("steps", s.steps, "allowed: 1 or more optimizer steps");
  if (s.warmup >= s.steps) {
    s.warnings.push_back(absl::StrCat("--warmup=", s.warmup, " is not below --steps=", s.steps,
                                      ": the learning rate never reaches --lr"));
  }
  s.log_every = absl::GetFlag(FLAGS_log_every);
  if (s.log_every < 1) return BadFlag("log_every", s.log_every, "allowed: 1 or more steps");
  s.eval_every = absl::GetFlag(FLAGS_eval_every);
  if (s.eval_every < 0) {
    return BadFlag("eval_every", s.eval_every, "allowed: 0 (only at the end) or more steps");
  }
  s.sample_tokens = absl::GetFlag(FLAGS_sample_tokens);
  if (s.sample_tokens < 0) return BadFlag("sample_tokens", s.sample_tokens, "allowed: 0 or more");
  const double temperature = absl::GetFlag(FLAGS_temperature);
  if (!FiniteAsFloat(temperature) || temperature < 0) {
    return BadFlag("temperature", temperature, "allowed: 0 (greedy) or a temperature > 0");
  }
  s.temperature = static_cast<float>(temperature);
  s.prompt = absl::GetFlag(FLAGS_prompt);
  s.seed = absl::GetFlag(FLAGS_seed);
  s.model.seed = s.seed;

  // Threads per rank: never more than this process may use.
  const int hw = fsdp::HardwareThreads();
  s.threads = absl::GetFlag(FLAGS_threads);
  if (s.threads < 0 || s.threads > hw) {
    return BadFlag("threads", s.threads,
                   absl::StrCat("allowed: 0 (automatic) to the ", hw,
                                " hardware threads this process may use"));
  }
  s.ranks_on_host = ranks_on_host;
  const int per_rank = s.threads > 0 ? s.threads : std::max(1, hw / ranks_on_host);
  if (ranks_share_process && per_rank * ranks_on_host > hw) {
    s.warnings.push_back(absl::StrCat(
        ranks_on_host, " ranks x ", per_rank, " threads = ", per_rank * ranks_on_host,
        " threads on ", hw, " hardware threads: the ranks compete for the cores and every "
        "step is slower",
        s.threads > 0 ? "; use --threads 0 (automatic)" : "; use fewer --ranks"));
  }

  // The backend, from the registry: it exists in this build, can run here, and gives each
  // rank of this process one (a PJRT plugin's devices).
  s.backend = absl::GetFlag(FLAGS_backend);
  const std::string plugin = absl::GetFlag(FLAGS_pjrt_plugin);
  if (!plugin.empty() && s.backend != "pjrt") {
    return BadFlag("pjrt_plugin", plugin, "only with --backend pjrt");
  }
  if (s.device_memory_bytes > 0) {
    s.backend_options["memory_limit_bytes"] = absl::StrCat(s.device_memory_bytes);
  }
  const double host_gbps = absl::GetFlag(FLAGS_sim_host_gbps);
  if (!(host_gbps >= 0 && std::isfinite(host_gbps)) || (host_gbps > 0 && s.backend != "sim")) {
    return BadFlag("sim_host_gbps", host_gbps,
                   "allowed: 0 (unlimited) or a rate in GB/s, with --backend sim only");
  }
  if (host_gbps > 0) s.backend_options["host_bytes_per_second"] = absl::StrCat(host_gbps * 1e9);
  // Offload all keeps the gradient shards on the host, where the sharded accumulation of the
  // HYBRID strategies cannot fold them: auto takes every instead, and an explicit sharded is
  // refused here rather than at the first backward.
  if (s.model.sharding.offload.what == fsdp::OffloadKind::kAll && hybrid &&
      s.micro_batches > 1 && s.accumulation == fsdp::Accumulation::kSharded) {
    if (absl::GetFlag(FLAGS_accumulate) != "auto") {
      return BadFlag("accumulate", "sharded",
                     "with --offload all the gradient shards live on the host, where the "
                     "sharded accumulation cannot fold them; use every or no_sync, or "
                     "--offload optimizer");
    }
    s.accumulation = fsdp::Accumulation::kEvery;
  }
  // (train_gpt always trains with AdamW, which offload needs.)
  if (s.model.sharding.offload.what != fsdp::OffloadKind::kNone && s.backend == "cpu") {
    return BadFlag("offload", std::string(fsdp::OffloadName(s.model.sharding.offload.what)),
                   "the cpu backend's device memory is the host's: there is nowhere to "
                   "offload to; use --backend sim or cuda, or --offload none");
  }
  if (s.backend == "cpu" || s.backend == "sim") {
    s.backend_options["threads"] = absl::StrCat(s.threads);
    s.backend_options["ranks_sharing_cores"] = absl::StrCat(ranks_on_host);
  }
  if (s.backend == "pjrt") {
    if (!plugin.empty()) s.backend_options["plugin"] = plugin;
    // The XLA CPU plugin makes as many devices as it is asked for; an accelerator has its chips.
    const char* env = std::getenv("FSDP_PJRT_PLUGIN");
    const std::string path = !plugin.empty() ? plugin : env != nullptr ? env : "";
    if (absl::StrContains(std::filesystem::path(path).filename().string(), "cpu")) {
      s.backend_options["devices"] = absl::StrCat(std::max(1, ranks_here));
    }
  }
  if (absl::Status ok = fsdp::CheckBackend(s.backend, s.backend_options, ranks_here,
                                           ranks_share_process);
      !ok.ok()) {
    const bool about_plugin = s.backend == "pjrt" && !plugin.empty() &&
                              absl::StrContains(ok.message(), "plugin");
    return absl::Status(ok.code(), absl::StrCat("--", about_plugin ? "pjrt_plugin" : "backend", "=",
                                                about_plugin ? plugin : s.backend, ": ",
                                                ok.message()));
  }

  // The data: read once, both splits large enough for one sequence.
  const std::string path = absl::GetFlag(FLAGS_data);
  const int64_t max_bytes = absl::GetFlag(FLAGS_max_data_bytes);
  if (max_bytes < 1) return BadFlag("max_data_bytes", max_bytes, "allowed: 1 or more bytes");
  fsdp::nn::TokenDataset data;
  if (path.empty()) {
    data = fsdp::nn::TokenDataset::FromText(fsdp::nn::EmbeddedCorpus());
    s.data_name = "the embedded corpus";
  } else {
    auto read = fsdp::nn::TokenDataset::FromFile(path, s.config.vocab_size(),
                                                  static_cast<uint64_t>(max_bytes));
    if (!read.ok()) {
      if (absl::IsResourceExhausted(read.status())) {
        return FlagError("data", path,
                         absl::Status(read.status().code(),
                                      absl::StrCat(read.status().message(),
                                                   "; raise --max_data_bytes to read it")));
      }
      return FlagError("data", path, read.status());
    }
    data = std::move(*read);
    s.data_name = absl::StrCat("--data=", path);
  }
  constexpr double kValFraction = 0.1;
  FSDP_ASSIGN_OR_RETURN(fsdp::nn::TrainValSplit split, fsdp::nn::SplitTrainVal(data, kValFraction));
  const int64_t need = s.model.seq_len + 1;
  for (const auto& [name, part] : {std::pair<const char*, const fsdp::nn::TokenDataset*>{
                                       "training split (the first 90%", &split.train},
                                   {"validation split (the last 10%", &split.val}}) {
    if (part->size() < need) {
      return absl::InvalidArgumentError(absl::StrCat(
          s.data_name, ": the ", name, " of its ", data.size(), " tokens) has ", part->size(),
          " tokens, fewer than the T+1 = ", need, " that one sequence of --seq=",
          s.model.seq_len, " needs: give at least ", SmallestCorpus(need, kValFraction),
          " tokens of data, or a smaller --seq"));
    }
  }
  s.data = std::make_shared<const fsdp::nn::TrainValSplit>(std::move(split));

  // Files and directories: usable now, not found out after training.
  s.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  s.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  if (s.checkpoint_every < 0) {
    return BadFlag("checkpoint_every", s.checkpoint_every, "allowed: 0 (at the end) or more steps");
  }
  if (s.checkpoint_every > 0 && s.checkpoint_dir.empty()) {
    return BadFlag("checkpoint_every", s.checkpoint_every, "needs --checkpoint_dir");
  }
  s.checkpoint_fallback = absl::GetFlag(FLAGS_checkpoint_fallback);
  s.checkpoint_async = absl::GetFlag(FLAGS_checkpoint_async);
  if (s.checkpoint_async && s.checkpoint_dir.empty()) {
    return BadFlag("checkpoint_async", "true", "needs --checkpoint_dir");
  }
  s.checkpoint_async_max_mib = absl::GetFlag(FLAGS_checkpoint_async_max_mib);
  if (s.checkpoint_async_max_mib < 0 || s.checkpoint_async_max_mib > (int64_t{1} << 30)) {
    return BadFlag("checkpoint_async_max_mib", s.checkpoint_async_max_mib,
                   "allowed: 0 (no bound) to 2^30 MiB");
  }
  if (s.checkpoint_async_max_mib > 0 && !s.checkpoint_async) {
    return BadFlag("checkpoint_async_max_mib", s.checkpoint_async_max_mib,
                   "needs --checkpoint_async");
  }
  if (!s.checkpoint_dir.empty()) {
    if (absl::Status w = fsdp::CheckCheckpointDirWritable(s.checkpoint_dir); !w.ok()) {
      return FlagError("checkpoint_dir", s.checkpoint_dir, w);
    }
  }
  s.init_safetensors = absl::GetFlag(FLAGS_init_safetensors);
  if (!s.init_safetensors.empty()) {
    // A file or an index, or a directory in the Hugging Face layout (ImportSafetensors).
    std::error_code ec;
    if (!std::filesystem::is_directory(s.init_safetensors, ec)) {
      FSDP_RETURN_IF_ERROR(CheckReadableFile("init_safetensors", s.init_safetensors));
    }
  }
  s.allow_model_change = absl::GetFlag(FLAGS_allow_model_change);
  s.export_path = absl::GetFlag(FLAGS_export_safetensors);
  s.export_hf_dir = absl::GetFlag(FLAGS_export_hf_dir);
  s.export_max_file_mb = absl::GetFlag(FLAGS_export_max_file_mb);
  if (!(s.export_max_file_mb >= 0.001 && s.export_max_file_mb <= 1e9)) {
    return BadFlag("export_max_file_mb", s.export_max_file_mb,
                   "allowed: 0.001 (1 KB) to 10^9 MB");
  }
  if (s.export_max_file_mb != 5000 && s.export_hf_dir.empty()) {
    return BadFlag("export_max_file_mb", s.export_max_file_mb, "needs --export_hf_dir");
  }
  if (rank == 0) {  // rank 0 holds the lock, cleans up, saves the metadata and exports
    FSDP_RETURN_IF_ERROR(PrepareOutputs(s, world_size, path));
  }
  FSDP_RETURN_IF_ERROR(CheckFitsMemory(s, world_size, s.backend));
  return s;
}

int RanksFlag() { return absl::GetFlag(FLAGS_ranks); }
int RanksPerProcessFlag() { return absl::GetFlag(FLAGS_ranks_per_process); }

}  // namespace train_gpt
