// Pre-flight agreement between the ranks of a group: that every rank was given the same
// settings, and that an error on one rank becomes the same error on every rank. A job whose
// ranks were launched differently (another learning rate, batch or data file on one rank) or
// whose set-up failed on one rank stops at once, on every rank, saying where and why, rather
// than training to the end with diverging results or waiting for a deadline.
#pragma once

#include <string>
#include <vector>

#include "fsdp/communicator.h"

namespace fsdp {

// A named value as text ("lr" = "0.0003"); compare what every rank must agree on.
struct Setting {
  std::string name;
  std::string value;
};

// Collective. OK when every rank passed the same settings (names and values, in order).
// Otherwise InvalidArgument on every rank, naming the first setting that differs (among those
// both ranks have; else the first that only one of them has), the first rank that differs from
// rank 0 and both values, e.g. "train_gpt: ranks were launched with
// different settings: lr is 0.001 on rank 1 but 0.0003 on rank 0; every rank must be given
// the same settings". `context` (if not empty) starts the message.
absl::Status CheckSameSettings(Communicator& comm, const std::vector<Setting>& settings,
                               std::string_view context);

// Collective: OK on every rank when every rank passed OK; otherwise, on every rank, the error
// of the lowest failing rank with its code, prefixed with "rank R: " (message cut to 2000
// bytes).
absl::Status AgreeOnStatus(Communicator& comm, const absl::Status& local);

}  // namespace fsdp
