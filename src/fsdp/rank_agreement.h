// A collective check of the sharding runtime on the control plane: that all ranks registered
// the same units. (The options are compared by name with fsdp/agreement.h.)
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


}  // namespace fsdp::internal
