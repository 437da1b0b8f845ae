// The sharding runtime's checks that all ranks agree, on the control plane: the units they
// registered (by fingerprint), and the options they were given (by name, with
// fsdp/agreement.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/agreement.h"
#include "fsdp/communicator.h"
#include "fsdp/sharding.h"

namespace fsdp::internal {

// Collective: OK when every rank passed the same fingerprints (one per unit); otherwise the
// same error on every rank, naming the first rank and unit that differ from rank 0.
absl::Status CheckUnitsAgree(Communicator& comm, const std::vector<uint64_t>& fingerprints,
                             const std::vector<std::string>& names);

// The options that decide which collectives run and what the step computes, by name, as
// ShardingRuntime::Create compares them across ranks (ranks that disagree on any of them would
// diverge or deadlock). Every field of ShardingOptions is here, except those the options make
// unused: the loss scaler's figures without dynamic loss scaling, and the settings of the
// optimizer not chosen. (tests/fsdp/agreement_test.cc checks that no field is missing.)
std::vector<Setting> ShardingOptionSettings(const ShardingOptions& options);

}  // namespace fsdp::internal
