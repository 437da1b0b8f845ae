// The kinds of collective and reduction, shared by the core (the op table, the data plane)
// and the collectives layer (the communicators), so that neither includes the other for them.
#pragma once

#include <cstdint>
#include <string_view>

namespace fsdp {

enum class ReduceOp : uint8_t { kSum = 0, kAvg = 1, kMax = 2 };

enum class CollectiveKind : uint8_t {
  kAllGather = 0,
  kReduceScatter = 1,
  kAllReduce = 2,
  kBroadcast = 3,
  kBarrier = 4,
  kSplit = 5,
  kAllToAll = 6,
};
inline constexpr int kNumCollectiveKinds = 7;

constexpr std::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

constexpr std::string_view CollectiveName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kSplit: return "split";
    case CollectiveKind::kAllToAll: return "all_to_all";
  }
  return "?";
}

}  // namespace fsdp
