// fsdp_plan: how much device memory one rank of a sharded training run needs, by category,
// before anything is allocated (fsdp/plan.h; docs/planning.md). E.g.
//
//   fsdp_plan --model llama2-7b --world 16 --ranks_per_host 8 --strategy HYBRID_SHARD
//             --param_dtype bf16 --seq 4096 --checkpoint all --device_memory 80GiB
//   fsdp_plan --model llama2-70b --table --ranks_per_host 8 --nodes 1,2,4,8,16
//             --strategies FULL_SHARD,HYBRID_SHARD --param_dtype bf16 --seq 4096
//             --device_memory 80GiB
//
// Exit codes: 0 planned (whether or not it fits; the output says), 2 bad usage (one line on
// stderr saying what to fix).
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/plan.h"
#include "tools/command_line.h"

ABSL_FLAG(std::string, model, "nano",
          "the model: nano, mini, gpt2, gpt2-medium, gpt2-xl, llama-nano, llama-mini, "
          "llama2-7b, llama2-13b or llama2-70b. The size flags below change its shape "
          "(explicit sizes: start from the family's model and override)");
ABSL_FLAG(int, layers, 0, "explicit size: number of blocks L, at most 10000 (0 = the model's)");
ABSL_FLAG(int, channels, 0, "explicit size: width C (0 = the model's)");
ABSL_FLAG(int, heads, 0, "explicit size: attention (query) heads H (0 = the model's)");
ABSL_FLAG(int, kv_heads, 0, "explicit size, Llama: key/value heads (0 = the model's)");
ABSL_FLAG(int, mlp_hidden, 0, "explicit size, Llama: MLP hidden width F (0 = the model's)");
ABSL_FLAG(int, vocab, 0, "explicit size: vocabulary size V (0 = the model's)");
ABSL_FLAG(int, block_size, 0, "explicit size: longest sequence the model takes (0 = the model's)");
ABSL_FLAG(int, world, 1, "data-parallel ranks (devices) in all, at most 1048576 (1 << 20)");
ABSL_FLAG(int, ranks_per_host, 0,
          "ranks (devices) per host; must divide --world (0 = all on one host). The default "
          "shard group of the HYBRID strategies is one host");
ABSL_FLAG(std::string, strategy, "FULL_SHARD",
          "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_GRAD_OP");
ABSL_FLAG(int, hybrid_shard_size, 0,
          "HYBRID strategies: ranks per shard group; must divide --world (0 = --ranks_per_host)");
ABSL_FLAG(std::string, param_dtype, "f32",
          "f32, bf16 or f16: the dtype parameters are gathered in and the Linear layers use "
          "(the master shards and the optimizer stay f32)");
ABSL_FLAG(std::string, reduce_dtype, "f32", "f32, bf16 or f16: the dtype gradients are reduced in");
ABSL_FLAG(std::string, optimizer, "adamw",
          "adamw (two f32 states per element), sgd (none) or sgd_momentum (one)");
ABSL_FLAG(std::string, checkpoint, "off",
          "activation checkpointing: off, all (every block), or k (blocks 0, k, 2k, ...)");
ABSL_FLAG(int, batch, 1, "micro-batch size B: sequences per rank and micro-batch");
ABSL_FLAG(int, seq, 0, "sequence length T (0 = the model's block size)");
ABSL_FLAG(int, micro_batches, 1, "micro-batches per step (gradient accumulation), 1 to 1024");
ABSL_FLAG(std::string, accumulate, "no_sync",
          "how micro-batches accumulate: no_sync (whole gradients held until the last), "
          "sharded (reduce-scattered every micro-batch; HYBRID all-reduces in the last) or "
          "every");
ABSL_FLAG(std::string, all_gather_format, "dtype",
          "what the parameter all-gather carries: dtype (param_dtype), int8 or fp8 (codes and "
          "an f32 scale per --quant_block elements, kept beside each parameter shard)");
ABSL_FLAG(std::string, reduction_format, "dtype",
          "what the gradient reduction carries: dtype (reduce_dtype), int8 or fp8 (each rank's "
          "codes for every rank, the codes received and one decoded chunk, while a unit's "
          "gradient is reduced); needs --reduce_dtype f32");
ABSL_FLAG(int, secondary_shard, 0,
          "FULL_SHARD and HYBRID_SHARD: a secondary shard over N ranks of a host (ZeRO++'s hpZ): "
          "each unit's 1/N of its parameters, in param_dtype, kept from its forward to its "
          "backward; N divides the shard group and --ranks_per_host (0 = off)");
ABSL_FLAG(int, quant_block, 256,
          "elements per scale of a quantized all-gather or reduction (16 to 65536)");
ABSL_FLAG(int, prefetch, 1,
          "units gathered ahead of their use at most (max_prefetch_units); 0 = no prefetch");
ABSL_FLAG(std::string, device_memory, "",
          "device memory per rank, e.g. 80GiB, 80GB, 40960MiB (empty = unknown: no fit check)");
ABSL_FLAG(std::string, offload, "none",
          "none, optimizer: the AdamW state of the units --offload_budget takes lives in host "
          "memory and is updated there (16 host bytes per shard element, 8 fewer on the device), "
          "or all: their parameter and gradient shards too (20 host bytes, 16 fewer)");
ABSL_FLAG(std::string, offload_budget, "",
          "--offload optimizer|all: host memory per rank the offload may take, e.g. 20GiB; units are "
          "taken largest first while they fit (empty = every unit)");
ABSL_FLAG(bool, async_checkpoint, false,
          "checkpoints saved in the background (train_gpt --checkpoint_async): plan the "
          "snapshot's host memory");
ABSL_FLAG(bool, table, false,
          "print a table over strategies x world sizes instead of one plan (--strategies, "
          "--worlds or --nodes)");
ABSL_FLAG(std::string, strategies, "FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,HYBRID_SHARD",
          "--table: comma-separated strategies");
ABSL_FLAG(std::string, worlds, "",
          "--table: comma-separated world sizes (default 1,2,4,8 ranks, or --nodes)");
ABSL_FLAG(bool, markdown, false, "--table: print the table in Markdown");
ABSL_FLAG(std::string, nodes, "",
          "--table: comma-separated numbers of hosts of --ranks_per_host ranks each, instead of "
          "--worlds");

namespace {

constexpr int kExitUsage = 2;

absl::Status BadFlag(absl::string_view flag, absl::string_view value, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", what));
}

// A flag naming a float dtype (f32, bf16 or f16).
absl::StatusOr<fsdp::DType> FloatDTypeFlag(absl::string_view flag, const std::string& value) {
  const std::optional<fsdp::DType> d = fsdp::ParseDType(value);
  if (d.has_value() && fsdp::IsFloat16Or32(*d)) return *d;
  return BadFlag(flag, value, "allowed: f32, bf16 or f16");
}

// A comma-separated list of integers from 1 to `max`.
absl::StatusOr<std::vector<int>> ParseInts(absl::string_view flag, const std::string& value,
                                           int max) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(value, ',', absl::SkipWhitespace())) {
    int v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &v) || v < 1 || v > max) {
      return BadFlag(flag, value,
                     absl::StrCat("allowed: a comma-separated list of integers from 1 to ", max));
    }
    out.push_back(v);
  }
  if (out.empty()) return BadFlag(flag, value, "give at least one positive integer");
  return out;
}

// The model's config with the size flags applied.
absl::StatusOr<fsdp::nn::ModelConfig> ConfigFromFlags() {
  const std::string name = absl::GetFlag(FLAGS_model);
  absl::StatusOr<fsdp::nn::ModelConfig> c = fsdp::nn::ModelConfig::FromName(name);
  if (!c.ok()) return BadFlag("model", name, c.status().message());
  struct Size {
    const char* flag;
    int value;
    int max;  // the bounds of fsdp/nn/model.h
  };
  constexpr int kAny = std::numeric_limits<int>::max();
  const Size sizes[] = {{"layers", absl::GetFlag(FLAGS_layers), fsdp::nn::kMaxLayers},
                        {"channels", absl::GetFlag(FLAGS_channels), fsdp::nn::kMaxChannels},
                        {"heads", absl::GetFlag(FLAGS_heads), fsdp::nn::kMaxChannels},
                        {"kv_heads", absl::GetFlag(FLAGS_kv_heads), fsdp::nn::kMaxChannels},
                        {"mlp_hidden", absl::GetFlag(FLAGS_mlp_hidden), fsdp::nn::kMaxMlpHidden},
                        {"vocab", absl::GetFlag(FLAGS_vocab), 65536},
                        {"block_size", absl::GetFlag(FLAGS_block_size), kAny}};
  for (const Size& s : sizes) {
    if (s.value < 0 || s.value > s.max) {
      return BadFlag(s.flag, absl::StrCat(s.value),
                     s.max == kAny ? std::string("allowed: 0 (the model's) or a positive size")
                                   : absl::StrCat("allowed: 0 (the model's) or 1 to ", s.max));
    }
  }
  auto set = [](int v, int& field) {
    if (v > 0) field = v;
  };
  bool explicit_sizes = false;
  for (const Size& s : sizes) explicit_sizes |= s.value > 0;
  if (c->is_gpt()) {
    for (const char* f : {"kv_heads", "mlp_hidden"}) {
      for (const Size& s : sizes) {
        if (s.value > 0 && std::string_view(s.flag) == f) {
          return BadFlag(f, absl::StrCat(s.value),
                         "only Llama models have this size; use a llama model with it");
        }
      }
    }
    fsdp::nn::GptConfig g = c->gpt();
    set(absl::GetFlag(FLAGS_layers), g.num_layers);
    set(absl::GetFlag(FLAGS_channels), g.channels);
    set(absl::GetFlag(FLAGS_heads), g.num_heads);
    set(absl::GetFlag(FLAGS_vocab), g.vocab_size);
    set(absl::GetFlag(FLAGS_block_size), g.block_size);
    if (explicit_sizes) g.name = absl::StrCat(g.name, " (resized)");
    c = fsdp::nn::ModelConfig(g);
  } else {
    fsdp::nn::LlamaConfig l = c->llama();
    set(absl::GetFlag(FLAGS_layers), l.num_layers);
    set(absl::GetFlag(FLAGS_channels), l.channels);
    set(absl::GetFlag(FLAGS_heads), l.num_heads);
    set(absl::GetFlag(FLAGS_kv_heads), l.num_kv_heads);
    set(absl::GetFlag(FLAGS_mlp_hidden), l.mlp_hidden);
    set(absl::GetFlag(FLAGS_vocab), l.vocab_size);
    set(absl::GetFlag(FLAGS_block_size), l.block_size);
    if (explicit_sizes) l.name = absl::StrCat(l.name, " (resized)");
    c = fsdp::nn::ModelConfig(l);
  }
  if (absl::Status s = c->Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model's sizes are not valid: ", s.message(),
                     "; change --layers/--channels/--heads/--kv_heads/--mlp_hidden/--vocab"));
  }
  return c;
}

absl::StatusOr<fsdp::PlanRequest> RequestFromFlags() {
  fsdp::PlanRequest r;
  FSDP_ASSIGN_OR_RETURN(fsdp::nn::ModelConfig config, ConfigFromFlags());
  r.model = config.name();
  r.config = config;
  r.world_size = absl::GetFlag(FLAGS_world);
  if (r.world_size < 1 || r.world_size > fsdp::kMaxPlanWorldSize) {
    return BadFlag("world", absl::StrCat(r.world_size),
                   absl::StrCat("allowed: 1 to ", fsdp::kMaxPlanWorldSize, " ranks"));
  }
  r.ranks_per_host = absl::GetFlag(FLAGS_ranks_per_host);
  if (r.ranks_per_host < 0 || r.ranks_per_host > fsdp::kMaxPlanWorldSize) {
    return BadFlag("ranks_per_host", absl::StrCat(r.ranks_per_host),
                   absl::StrCat("allowed: 0 (one host) or the devices of one host, e.g. 8 (at "
                                "most ", fsdp::kMaxPlanWorldSize, ")"));
  }
  const std::string strategy = absl::GetFlag(FLAGS_strategy);
  absl::StatusOr<fsdp::ShardingStrategy> s = fsdp::ParseStrategy(strategy);
  if (!s.ok()) return BadFlag("strategy", strategy, s.status().message());
  r.strategy = *s;
  r.hybrid_shard_size = absl::GetFlag(FLAGS_hybrid_shard_size);
  if (r.hybrid_shard_size < 0 || r.hybrid_shard_size > fsdp::kMaxPlanWorldSize) {
    return BadFlag("hybrid_shard_size", absl::StrCat(r.hybrid_shard_size),
                   absl::StrCat("allowed: 0 (= --ranks_per_host) or the ranks of a shard group "
                                "(at most ", fsdp::kMaxPlanWorldSize, ")"));
  }
  FSDP_ASSIGN_OR_RETURN(r.param_dtype,
                        FloatDTypeFlag("param_dtype", absl::GetFlag(FLAGS_param_dtype)));
  FSDP_ASSIGN_OR_RETURN(r.reduce_dtype,
                        FloatDTypeFlag("reduce_dtype", absl::GetFlag(FLAGS_reduce_dtype)));
  const std::string opt = absl::AsciiStrToLower(absl::GetFlag(FLAGS_optimizer));
  if (opt == "adamw") {
    r.optimizer = fsdp::OptimizerKind::kAdamW;
  } else if (opt == "sgd" || opt == "sgd_momentum") {
    r.optimizer = fsdp::OptimizerKind::kSgd;
    r.sgd_momentum = opt == "sgd_momentum";
  } else {
    return BadFlag("optimizer", opt, "allowed: adamw, sgd or sgd_momentum");
  }
  const std::string ckpt = absl::AsciiStrToLower(absl::GetFlag(FLAGS_checkpoint));
  const int L = config.num_layers();
  if (ckpt == "off" || ckpt == "0" || ckpt == "none") {
    r.checkpoint_every = 0;
  } else if (ckpt == "all") {
    r.checkpoint_every = 1;
  } else if (!absl::SimpleAtoi(ckpt, &r.checkpoint_every) || r.checkpoint_every < 1 ||
             r.checkpoint_every > L) {
    return BadFlag("checkpoint", ckpt,
                   absl::StrCat("allowed: off, all, or k from 1 to the number of blocks (", L,
                                ") to checkpoint blocks 0, k, 2k, ..."));
  }
  r.batch_size = absl::GetFlag(FLAGS_batch);
  if (r.batch_size < 1) {
    return BadFlag("batch", absl::StrCat(r.batch_size), "allowed: 1 or more sequences");
  }
  r.seq_len = absl::GetFlag(FLAGS_seq);
  if (r.seq_len < 0 || r.seq_len > config.block_size()) {
    return BadFlag("seq", absl::StrCat(r.seq_len),
                   absl::StrCat("allowed: 1 to ", config.name(), "'s block size ",
                                config.block_size(), " (0 = the block size); --block_size "
                                "changes the model's"));
  }
  r.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  if (r.micro_batches < 1 || r.micro_batches > fsdp::kMaxPlanMicroBatches) {
    return BadFlag("micro_batches", absl::StrCat(r.micro_batches),
                   absl::StrCat("allowed: 1 to ", fsdp::kMaxPlanMicroBatches));
  }
  {
    const std::string a = absl::GetFlag(FLAGS_accumulate);
    absl::StatusOr<fsdp::Accumulation> acc = fsdp::ParseAccumulation(a);
    if (!acc.ok()) return BadFlag("accumulate", a, "allowed: no_sync, sharded or every");
    r.accumulation = *acc;
  }
  {
    const std::string f = absl::GetFlag(FLAGS_all_gather_format);
    absl::StatusOr<fsdp::WireFormat> format = fsdp::ParseWireFormat(f);
    if (!format.ok()) return BadFlag("all_gather_format", f, "allowed: dtype, int8 or fp8");
    r.communication.all_gather = *format;
    const std::string g = absl::GetFlag(FLAGS_reduction_format);
    format = fsdp::ParseWireFormat(g);
    if (!format.ok()) return BadFlag("reduction_format", g, "allowed: dtype, int8 or fp8");
    r.communication.reduction = *format;
    r.communication.block_size = absl::GetFlag(FLAGS_quant_block);
    if (!fsdp::CheckCommunicationOptions(r.communication).ok()) {
      return BadFlag("quant_block", absl::StrCat(r.communication.block_size),
                     "allowed: a power of two from 16 to 65536");
    }
  }
  r.secondary_shard_size = absl::GetFlag(FLAGS_secondary_shard);
  r.async_checkpoint = absl::GetFlag(FLAGS_async_checkpoint);
  r.max_prefetch_units = absl::GetFlag(FLAGS_prefetch);
  if (r.max_prefetch_units < 0) {
    return BadFlag("prefetch", absl::StrCat(r.max_prefetch_units),
                   "allowed: 0 (no prefetch) or the units gathered ahead at most, e.g. 1");
  }
  r.forward_prefetch = r.backward_prefetch = r.max_prefetch_units > 0;
  const std::string mem = absl::GetFlag(FLAGS_device_memory);
  if (!mem.empty()) {
    absl::StatusOr<int64_t> bytes = fsdp::ParseByteSize(mem);
    if (!bytes.ok()) return BadFlag("device_memory", mem, bytes.status().message());
    if (*bytes <= 0) return BadFlag("device_memory", mem, "give a size above 0, e.g. 80GiB");
    r.device_memory_bytes = *bytes;
  }
  {
    const std::string what = absl::GetFlag(FLAGS_offload);
    absl::StatusOr<fsdp::OffloadKind> kind = fsdp::ParseOffload(what);
    if (!kind.ok()) return BadFlag("offload", what, "allowed: none, optimizer or all");
    r.offload.what = *kind;
    const std::string budget = absl::GetFlag(FLAGS_offload_budget);
    if (!budget.empty()) {
      if (r.offload.what == fsdp::OffloadKind::kNone) {
        return BadFlag("offload_budget", budget, "needs --offload optimizer or all");
      }
      absl::StatusOr<int64_t> bytes = fsdp::ParseByteSize(budget);
      if (!bytes.ok()) return BadFlag("offload_budget", budget, bytes.status().message());
      r.offload.budget_bytes = *bytes;
    }
    if (r.offload.what != fsdp::OffloadKind::kNone && r.optimizer != fsdp::OptimizerKind::kAdamW) {
      return BadFlag("offload", what, "needs --optimizer adamw (the host runs the AdamW update)");
    }
  }
  // The activations of B x T must come to int64 bytes or less: the plan's figures are exact.
  if (absl::StatusOr<fsdp::PlanModel> m = fsdp::PlanModelFor(config, r); !m.ok()) {
    return BadFlag("batch", absl::StrCat(r.batch_size), m.status().message());
  }
  return r;
}

absl::Status RunPlan(const fsdp::PlanRequest& r) {
  FSDP_ASSIGN_OR_RETURN(fsdp::MemoryPlan plan, fsdp::PlanMemory(r));
  std::fputs(fsdp::FormatMemoryPlan(plan).c_str(), stdout);
  if (r.device_memory_bytes > 0) {
    FSDP_ASSIGN_OR_RETURN(int largest, fsdp::LargestMicroBatch(r));
    if (largest == 0) {
      std::printf("largest micro-batch that fits: none (B = 1 needs %.3f GiB)\n",
                  static_cast<double>(plan.peak_bytes) / (1 << 30));
    } else {
      fsdp::PlanRequest next = r;
      next.batch_size = largest + 1;
      absl::StatusOr<fsdp::MemoryPlan> over = fsdp::PlanMemory(next);
      std::printf("largest micro-batch that fits: B = %d", largest);
      if (over.ok()) {
        std::printf(" (B = %d needs %.3f GiB)", largest + 1,
                    static_cast<double>(over->peak_bytes) / (1 << 30));
      }
      std::printf("\n");
    }
    // The deepest model of this shape (the same blocks, more or fewer of them) that fits at B:
    // with --offload, what offloading buys.
    auto with_layers = [&](int layers) -> absl::StatusOr<fsdp::MemoryPlan> {
      fsdp::PlanRequest q = r;
      fsdp::nn::ModelConfig c = *r.config;
      if (c.is_gpt()) {
        fsdp::nn::GptConfig g = c.gpt();
        g.num_layers = layers;
        c = g;
      } else {
        fsdp::nn::LlamaConfig l = c.llama();
        l.num_layers = layers;
        c = l;
      }
      q.config = c;
      q.checkpoint_blocks.clear();
      if (q.checkpoint_every > layers) q.checkpoint_every = layers;
      return fsdp::PlanMemory(q);
    };
    int lo = 0, hi = fsdp::nn::kMaxLayers;  // fits(lo) (or lo = 0), !fits(hi + 1)
    while (lo < hi) {
      const int mid = lo + (hi - lo + 1) / 2;
      absl::StatusOr<fsdp::MemoryPlan> p = with_layers(mid);
      if (p.ok() && p->fits) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    if (lo == 0) {
      std::printf("deepest model of this shape that fits at B = %d: none\n", r.batch_size);
    } else {
      absl::StatusOr<fsdp::MemoryPlan> p = with_layers(lo);
      std::printf("deepest model of this shape that fits at B = %d: %d blocks (%.2f B "
                  "parameters)%s\n",
                  r.batch_size, lo, p.ok() ? static_cast<double>(p->num_parameters) / 1e9 : 0.0,
                  r.offload.what != fsdp::OffloadKind::kNone
                      ? absl::StrFormat(", host offload %.1f GiB per rank",
                                        p.ok() ? static_cast<double>(p->host_offload_bytes) /
                                                     (1 << 30)
                                               : 0.0)
                            .c_str()
                      : "");
    }
  }
  return absl::OkStatus();
}

absl::Status RunTable(const fsdp::PlanRequest& r) {
  std::vector<fsdp::ShardingStrategy> strategies;
  const std::string names = absl::GetFlag(FLAGS_strategies);
  for (absl::string_view n : absl::StrSplit(names, ',', absl::SkipWhitespace())) {
    absl::StatusOr<fsdp::ShardingStrategy> s =
        fsdp::ParseStrategy(std::string(absl::StripAsciiWhitespace(n)));
    if (!s.ok()) return BadFlag("strategies", names, s.status().message());
    strategies.push_back(*s);
  }
  if (strategies.empty()) return BadFlag("strategies", names, "give at least one strategy");
  std::vector<int> worlds;
  const std::string w = absl::GetFlag(FLAGS_worlds), nodes = absl::GetFlag(FLAGS_nodes);
  if (!w.empty() && !nodes.empty()) {
    return BadFlag("nodes", nodes, "give --worlds or --nodes, not both");
  }
  if (!nodes.empty()) {
    if (r.ranks_per_host < 1) {
      return BadFlag("nodes", nodes, "needs --ranks_per_host (the devices of one host)");
    }
    // Hosts x ranks per host within the planner's world (so the product fits an int, too).
    const int max_hosts = fsdp::kMaxPlanWorldSize / r.ranks_per_host;
    absl::StatusOr<std::vector<int>> n = ParseInts("nodes", nodes, max_hosts);
    if (!n.ok()) {
      return BadFlag("nodes", nodes,
                     absl::StrCat("allowed: a comma-separated list of 1 to ", max_hosts,
                                  " hosts (", fsdp::kMaxPlanWorldSize, " ranks in all at most, "
                                  "at --ranks_per_host=", r.ranks_per_host, ")"));
    }
    for (int x : *n) worlds.push_back(x * r.ranks_per_host);
  } else if (!w.empty()) {
    FSDP_ASSIGN_OR_RETURN(worlds, ParseInts("worlds", w, fsdp::kMaxPlanWorldSize));
  } else {
    const int h = r.ranks_per_host > 0 ? r.ranks_per_host : 1;
    worlds = {h, 2 * h, 4 * h, 8 * h};
  }
  FSDP_ASSIGN_OR_RETURN(std::vector<fsdp::PlanTableCell> cells,
                        fsdp::PlanTable(r, strategies, worlds));
  const fsdp::MemoryPlan* any = nullptr;
  for (const auto& c : cells) {
    if (c.status.ok()) {
      any = &c.plan;
      break;
    }
  }
  if (any != nullptr) {
    std::printf("%s (%.3f B parameters), param %s, reduce %s, B=%d T=%d, %s, prefetch %d%s\n",
                any->model.c_str(), static_cast<double>(any->num_parameters) / 1e9,
                std::string(fsdp::DTypeName(any->param_dtype)).c_str(),
                std::string(fsdp::DTypeName(any->reduce_dtype)).c_str(), any->batch_size,
                any->seq_len,
                any->checkpointed_blocks == 0
                    ? "no activation checkpointing"
                    : absl::StrCat("checkpointing ", any->checkpointed_blocks, " of ",
                                   any->num_blocks, " blocks")
                          .c_str(),
                any->max_prefetch_units,
                r.device_memory_bytes > 0
                    ? absl::StrFormat(", device %.1f GiB per rank",
                                      static_cast<double>(r.device_memory_bytes) / (1 << 30))
                          .c_str()
                    : "");
  }
  std::fputs(fsdp::FormatPlanTable(cells, absl::GetFlag(FLAGS_markdown)).c_str(), stdout);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Plans the device memory of one rank of a sharded training run (libfsdp's runtime and "
      "bundled models) without allocating the model: parameter, gradient and optimizer "
      "shards, gathered parameters and unsharded gradient buffers at peak, activations with "
      "and without checkpointing, the peak against --device_memory, the largest micro-batch "
      "that fits, or (--table) all of it over strategies x world sizes. docs/planning.md "
      "explains every figure.\n\n"
      "  fsdp_plan --model llama2-7b --world 16 --ranks_per_host 8 --strategy HYBRID_SHARD "
      "--param_dtype bf16 --seq 4096 --checkpoint all --device_memory 80GiB\n\n"
      "Exit codes: 0 planned (fitting or not), 2 bad usage.");
  const std::vector<char*> rest = fsdp::cli::ParseCommandLine(argc, argv);
  auto usage_error = [](const absl::Status& s) {
    std::fprintf(stderr, "fsdp_plan: %s\n", std::string(s.message()).c_str());
    return kExitUsage;
  };
  if (rest.size() > 1) {
    return usage_error(absl::InvalidArgumentError(
        absl::StrCat("unexpected argument '", rest[1], "': flags start with -- (see --help)")));
  }
  absl::StatusOr<fsdp::PlanRequest> r = RequestFromFlags();
  if (!r.ok()) return usage_error(r.status());
  const absl::Status s = absl::GetFlag(FLAGS_table) ? RunTable(*r) : RunPlan(*r);
  if (!s.ok()) return usage_error(s);
  return 0;
}
