// Strings, 64-bit integers, statuses and settings between ranks: the control plane, on the host
// communicator, as bytes (u8) and 64-bit integers (i64).
#include "collectives/control.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "fsdp/agreement.h"

namespace fsdp {
namespace internal {

absl::StatusOr<std::string> BroadcastString(Communicator& comm, const std::string& s, int root,
                                            size_t max_bytes) {
  // The length (i64; -1: too long), then the bytes. A string that does not fit is an error on
  // every rank, never a truncation.
  int64_t length = 0;
  if (comm.rank() == root) {
    length = s.size() > max_bytes ? -1 : static_cast<int64_t>(s.size());
  }
  FSDP_RETURN_IF_ERROR(comm.Broadcast(&length, 1, DType::kI64, root));
  if (length < 0 || static_cast<size_t>(length) > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a string of rank ", root, " is longer than the ", max_bytes, " bytes it may have"));
  }
  std::string out = comm.rank() == root ? s : std::string(static_cast<size_t>(length), '\0');
  FSDP_RETURN_IF_ERROR(comm.Broadcast(out.data(), length, DType::kU8, root));
  return out;
}

absl::StatusOr<std::vector<uint64_t>> AllGatherU64(Communicator& comm,
                                                   const std::vector<uint64_t>& mine) {
  std::vector<uint64_t> out(mine.size() * comm.size(), 0);
  FSDP_RETURN_IF_ERROR(comm.AllGather(mine.data(), out.data(), static_cast<int64_t>(mine.size()),
                                      DType::kI64));
  return out;
}

}  // namespace internal

absl::Status AgreeOnStatus(Communicator& comm, const absl::Status& local) {
  // The lowest failing rank r reports size - r, so the maximum names it.
  const float mine = local.ok() ? 0.0f : static_cast<float>(comm.size() - comm.rank());
  float worst = 0;
  absl::Status s = comm.AllReduce(&mine, &worst, 1, DType::kF32, ReduceOp::kMax);
  if (!s.ok()) return local.ok() ? s : local;
  if (worst == 0) return absl::OkStatus();
  const int root = comm.size() - static_cast<int>(worst);
  std::string encoded;
  if (comm.rank() == root) {
    encoded = absl::StrCat(std::string(1, static_cast<char>(local.code())), "rank ", root, ": ",
                           std::string(local.message()));
  }
  absl::StatusOr<std::string> got = internal::BroadcastString(comm, encoded, root, 2000);
  if (!got.ok() || got->empty()) return local.ok() ? got.status() : local;
  const auto code = static_cast<absl::StatusCode>(static_cast<unsigned char>((*got)[0]));
  return absl::Status(code == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : code,
                      got->substr(1));
}

absl::Status CheckSameSettings(Communicator& comm, const std::vector<Setting>& settings,
                               std::string_view context_in) {
  const std::string context = context_in.empty() ? std::string() : absl::StrCat(
      std::string(context_in), ": ");
  // One 64-bit fingerprint per setting (name and value), the count first.
  std::vector<uint64_t> mine = {settings.size()};
  for (const Setting& s : settings) {
    mine.push_back(std::hash<std::string>{}(absl::StrCat(s.name, "=", s.value)));
  }
  // Ranks with fewer settings pad, so that the exchange itself has the same shape everywhere.
  FSDP_ASSIGN_OR_RETURN(std::vector<uint64_t> counts, internal::AllGatherU64(comm, {mine[0]}));
  const uint64_t most = *std::max_element(counts.begin(), counts.end());
  mine.resize(most + 1, 0);
  FSDP_ASSIGN_OR_RETURN(std::vector<uint64_t> all, internal::AllGatherU64(comm, mine));
  const size_t k = mine.size();
  // Every rank sees the same fingerprints, so every rank takes the same path (and the same
  // broadcasts) below. Per rank, the first setting that differs among those both ranks have
  // is named, so that a setting which brings others with it (a flag that adds settings) is
  // named itself rather than reported as a difference in the number of settings.
  for (int r = 1; r < comm.size(); ++r) {
    const size_t common = static_cast<size_t>(std::min(counts[0], counts[r]));
    for (size_t j = 0; j < common; ++j) {
      if (all[r * k + 1 + j] == all[1 + j]) continue;
      // Fetch the two values to say what differs.
      const std::string name = j < settings.size() ? settings[j].name : "";
      const std::string value = j < settings.size() ? settings[j].value : "";
      FSDP_ASSIGN_OR_RETURN(std::string name0, internal::BroadcastString(comm, name, 0, 256));
      FSDP_ASSIGN_OR_RETURN(std::string v0, internal::BroadcastString(comm, value, 0, 1024));
      FSDP_ASSIGN_OR_RETURN(std::string name_r, internal::BroadcastString(comm, name, r, 256));
      FSDP_ASSIGN_OR_RETURN(std::string v_r, internal::BroadcastString(comm, value, r, 1024));
      if (name0 != name_r) {
        return absl::InvalidArgumentError(absl::StrCat(
            context, "ranks were launched with different settings: setting ", j, " is '",
            name_r, "' on rank ", r, " but '", name0, "' on rank 0; every rank must run the "
            "same program"));
      }
      return absl::InvalidArgumentError(absl::StrCat(
          context, "ranks were launched with different settings: ", name0, " is ", v_r,
          " on rank ", r, " but ", v0, " on rank 0; every rank must be given the same settings"));
    }
    if (counts[r] != counts[0]) {
      // The same settings as far as both go: name the first one that only the longer has.
      const int longer = counts[r] > counts[0] ? r : 0;
      const std::string extra = common < settings.size() ? settings[common].name : "";
      FSDP_ASSIGN_OR_RETURN(std::string name, internal::BroadcastString(comm, extra, longer, 256));
      return absl::InvalidArgumentError(absl::StrCat(
          context, "ranks were launched with different settings: rank 0 has ", counts[0],
          " settings, rank ", r, " has ", counts[r], " (the first that only rank ", longer,
          " has is '", name, "'); every rank must run the same program"));
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp
