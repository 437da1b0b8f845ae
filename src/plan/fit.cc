// CheckPlanFits: a run the memory planner says cannot fit is refused before it allocates.
#include <unistd.h>

#include "absl/strings/str_format.h"
#include "fsdp/plan.h"

namespace fsdp {

int64_t HostPhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<int64_t>(pages) * static_cast<int64_t>(page);
}

absl::Status CheckPlanFits(const MemoryPlan& plan, int64_t device_memory_bytes,
                           int ranks_on_host, bool device_is_host, bool can_offload) {
  constexpr double kMiB = 1024.0 * 1024;
  const double p = static_cast<double>(plan.num_parameters);
  const std::string what = absl::StrFormat(
      "the memory planner puts a rank's peak at %.1f MiB (%s parameters: shards %.1f MiB, "
      "gathered units %.1f MiB, gradient buffers %.1f MiB, activations %.1f MiB)",
      plan.peak_bytes / kMiB,
      p >= 1e9 ? absl::StrFormat("%.2f B", p / 1e9) : absl::StrFormat("%.2f M", p / 1e6),
      plan.persistent_bytes() / kMiB, plan.gathered_param_peak_bytes / kMiB,
      plan.grad_buffer_peak_bytes / kMiB, plan.activation_peak_bytes / kMiB);
  const char* fix = can_offload && plan.offloaded_units < plan.num_units
                        ? "use fewer layers, a smaller batch or sequence, activation "
                          "checkpointing, more ranks, or offload the optimizer state of more "
                          "units to the host (offload optimizer, a larger offload budget)"
                        : "use fewer layers, a smaller batch or sequence, activation "
                          "checkpointing, or more ranks";
  if (device_memory_bytes > 0 && plan.peak_bytes > device_memory_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s %s on %d rank(s): %s, more than the device's %.1f MiB; %s", plan.model,
        std::string(StrategyName(plan.strategy)), plan.world_size, what,
        device_memory_bytes / kMiB, fix));
  }
  const int64_t host = HostPhysicalMemoryBytes();
  if ((!device_is_host && plan.host_offload_bytes == 0) || host <= 0 || ranks_on_host < 1) {
    return absl::OkStatus();
  }
  // In doubles: a plan of absurd size times the ranks must not wrap. A background save's
  // snapshot and the offloaded state are host memory too.
  const double need = (static_cast<double>(device_is_host ? plan.peak_bytes : 0) +
                       static_cast<double>(plan.checkpoint_snapshot_bytes) +
                       static_cast<double>(plan.host_offload_bytes)) *
                      ranks_on_host;
  if (need <= static_cast<double>(host)) return absl::OkStatus();
  if (plan.host_offload_bytes > 0) {
    constexpr double kGiB = 1024.0 * kMiB;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s %s on %d rank(s): the offload holds %.1f MiB of host memory per rank (%d of %d "
        "units)%s; the %d rank(s) on this host need %.1f GiB and it has %.1f GiB; give a "
        "smaller offload budget (offload fewer units) or more hosts",
        plan.model, std::string(StrategyName(plan.strategy)), plan.world_size,
        plan.host_offload_bytes / kMiB, plan.offloaded_units, plan.num_units,
        device_is_host ? ", besides the device's memory, which is the host's too" : "",
        ranks_on_host, need / kGiB, host / kGiB));
  }
  constexpr double kGiB = 1024.0 * kMiB;
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%s %s on %d rank(s): %s; the %d rank(s) on this host need %.1f GiB and it has %.1f GiB "
      "of memory; %s",
      plan.model, std::string(StrategyName(plan.strategy)), plan.world_size, what, ranks_on_host,
      need / kGiB, host / kGiB, fix));
}

}  // namespace fsdp
