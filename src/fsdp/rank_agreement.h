// Collective checks and exact scalar reductions the sharding runtime needs beyond the
// communicator's f32/bf16/f16 data path: that all ranks registered the same units, and sums
// of doubles (squared gradient norms) without losing precision to f32. (The options are
// compared by name with fsdp/agreement.h.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/communicator.h"

namespace fsdp::internal {

// Collective: OK when every rank passed the same fingerprints (one per unit); otherwise the
// same error on every rank, naming the first rank and unit that differ from rank 0.
absl::Status CheckUnitsAgree(Communicator& comm, const std::vector<uint64_t>& fingerprints,
                             const std::vector<std::string>& names);

// Collective: the sum over the group's ranks of `value`, added in rank order in double, so
// every rank gets the bit-identical result.
absl::StatusOr<double> SumAcrossRanks(Communicator& comm, double value);

}  // namespace fsdp::internal
