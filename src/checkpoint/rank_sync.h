// The checkpoint code's names for the control-plane exchanges of collectives/control.h and
// fsdp/agreement.h.
#pragma once

#include "collectives/control.h"
#include "fsdp/agreement.h"

namespace fsdp::checkpoint {

using ::fsdp::AgreeOnStatus;
using ::fsdp::internal::AllGatherU64;
using ::fsdp::internal::BroadcastString;

}  // namespace fsdp::checkpoint
