// Rank agreement checks over the communicator (64-bit values through collectives/control.h).
#include "src/fsdp/rank_agreement.h"

#include "absl/strings/str_cat.h"
#include "collectives/control.h"

namespace fsdp::internal {
absl::Status CheckUnitsAgree(Communicator& comm, const std::vector<uint64_t>& units,
                             const std::vector<std::string>& names) {
  FSDP_ASSIGN_OR_RETURN(std::vector<uint64_t> counts, AllGatherU64(comm, {units.size()}));
  const int n = comm.size();
  for (int r = 1; r < n; ++r) {
    if (counts[r] != counts[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ranks registered different units: rank 0 registered ", counts[0], " units, rank ",
          r, " registered ", counts[r], "; every rank must register the same units"));
    }
  }
  FSDP_ASSIGN_OR_RETURN(std::vector<uint64_t> all, AllGatherU64(comm, units));
  const size_t k = units.size();
  for (int r = 1; r < n; ++r) {
    for (size_t i = 0; i < k; ++i) {
      if (all[r * k + i] != all[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ranks registered different units: unit ", i, " ('", names[i], "' on rank ",
            comm.rank(), ") differs between rank 0 and rank ", r,
            " in its name, parameter names, shapes or flags; every rank must register the "
            "same units in the same order"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp::internal
