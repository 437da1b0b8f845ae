// Checkpoints and exports never hold inf or NaN unless asked to: a model that diverged is not
// saved over the last good state, and a file holding such values is not loaded into training.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "fsdp/status.h"

namespace fsdp::checkpoint {

// OK when the n values are finite; otherwise FailedPrecondition naming `what`, the first bad
// element and `fix` (how to override).
inline absl::Status CheckFinite(const float* v, int64_t n, const std::string& what,
                                const std::string& fix) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " holds ", std::isnan(v[i]) ? "NaN" : "inf", " (element ", i, " of ", n,
          " here): the model has diverged; ", fix));
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp::checkpoint
