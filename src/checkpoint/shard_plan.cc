// Tensor pieces of a shard.
#include "src/checkpoint/shard_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::checkpoint {

std::vector<SlotPiece> ShardSlotPieces(const std::vector<TensorSlot>& slots, int64_t shard_numel,
                                       int k) {
  const int64_t lo = k * shard_numel, hi = lo + shard_numel;
  std::vector<SlotPiece> out;
  for (size_t i = 0; i < slots.size(); ++i) {
    const TensorSlot& t = slots[i];
    const int64_t b = std::max(lo, t.offset), e = std::min(hi, t.offset + t.numel);
    if (b >= e) continue;
    out.push_back({static_cast<int>(i), b - t.offset, e - t.offset, b - lo});
  }
  std::sort(out.begin(), out.end(),
            [](const SlotPiece& a, const SlotPiece& b) { return a.shard_offset < b.shard_offset; });
  return out;
}

int64_t ShardDataNumel(int64_t unit_numel, int64_t shard_numel, int k) {
  return std::clamp<int64_t>(unit_numel - k * shard_numel, 0, shard_numel);
}

absl::StatusOr<std::vector<std::string>> RuntimeStateNames(ShardingRuntime& runtime) {
  std::vector<std::string> names;
  for (int u = 0; u < runtime.num_units(); ++u) {
    std::vector<std::string> here;
    for (const OptimizerState& s : runtime.optimizer(u).state()) here.emplace_back(s.name);
    if (u == 0) {
      names = here;
    } else if (here != names) {
      return absl::FailedPreconditionError(
          absl::StrCat("units 0 and ", u,
                       " have different optimizer states; checkpoints need one optimizer "
                       "kind for every unit"));
    }
  }
  return names;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace fsdp::checkpoint
