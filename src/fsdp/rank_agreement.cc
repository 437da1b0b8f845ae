// Rank agreement checks over the communicator (which moves floating-point data only: 64-bit
// values travel as four 16-bit pieces, each exact in f32).
#include "src/fsdp/rank_agreement.h"

#include "absl/strings/str_cat.h"

namespace fsdp::internal {
namespace {

void Pack(uint64_t v, float* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<float>((v >> (16 * i)) & 0xffff);
}

}  // namespace

absl::Status CheckUnitsAgree(Communicator& comm, const std::vector<uint64_t>& units,
                             const std::vector<std::string>& names, uint64_t options) {
  std::vector<uint64_t> fingerprints = units;
  fingerprints.push_back(options);
  const int n = comm.size();
  const float mine = static_cast<float>(units.size());
  std::vector<float> counts(n);
  FSDP_RETURN_IF_ERROR(comm.AllGather(&mine, counts.data(), 1, DType::kF32));
  for (int r = 1; r < n; ++r) {
    if (counts[r] != counts[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ranks registered different units: rank 0 registered ", counts[0], " units, rank ",
          r, " registered ", counts[r], "; every rank must register the same units"));
    }
  }
  const size_t k = fingerprints.size();
  std::vector<float> packed(4 * k), all(4 * k * n);
  for (size_t i = 0; i < k; ++i) Pack(fingerprints[i], &packed[4 * i]);
  FSDP_RETURN_IF_ERROR(comm.AllGather(packed.data(), all.data(), 4 * k, DType::kF32));
  for (int r = 1; r < n; ++r) {
    for (size_t i = 0; i < k; ++i) {
      for (int j = 0; j < 4; ++j) {
        if (all[(r * k + i) * 4 + j] != all[i * 4 + j]) {
          if (i + 1 == k) {
            return absl::InvalidArgumentError(absl::StrCat(
                "ranks 0 and ", r, " were given different sharding options (strategy, hybrid "
                "shard size, prefetch or optimizer); every rank must use the same options"));
          }
          return absl::InvalidArgumentError(absl::StrCat(
              "ranks registered different units: unit ", i, " ('", names[i], "' on rank ",
              comm.rank(), ") differs between rank 0 and rank ", r,
              " in its name, parameter names, shapes or flags; every rank must register the "
              "same units in the same order"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<double> SumAcrossRanks(Communicator& comm, double value) {
  if (comm.size() == 1) return value;
  const float hi = static_cast<float>(value);
  const float mine[2] = {hi, static_cast<float>(value - hi)};
  std::vector<float> all(2 * comm.size());
  FSDP_RETURN_IF_ERROR(comm.AllGather(mine, all.data(), 2, DType::kF32));
  double sum = 0;
  for (int r = 0; r < comm.size(); ++r) sum += static_cast<double>(all[2 * r]) + all[2 * r + 1];
  return sum;
}

}  // namespace fsdp::internal
