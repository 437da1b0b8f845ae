// Tensor pieces of a shard.
#include "src/checkpoint/shard_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::checkpoint {

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
