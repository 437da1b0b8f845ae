// String, integer and status exchange over a Communicator, through exact f32 encodings.
#include "src/checkpoint/rank_sync.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fsdp::checkpoint {

absl::StatusOr<std::string> BroadcastString(Communicator& comm, const std::string& s, int root,
                                            size_t max_bytes) {
  // [length, byte 0, byte 1, ...]: every value below 2^24 is exact in f32.
  // A string that does not fit is an error on every rank (length -1), never a truncation.
  std::vector<float> buf(max_bytes + 1, 0.0f);
  if (comm.rank() == root) {
    buf[0] = s.size() > max_bytes ? -1.0f : static_cast<float>(s.size());
    for (size_t i = 0; i < s.size() && i < max_bytes; ++i) {
      buf[i + 1] = static_cast<float>(static_cast<unsigned char>(s[i]));
    }
  }
  FSDP_RETURN_IF_ERROR(
      comm.Broadcast(buf.data(), static_cast<int64_t>(buf.size()), DType::kF32, root));
  if (buf[0] < 0 || buf[0] > static_cast<float>(max_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a string of rank ", root, " is longer than the ", max_bytes, " bytes it may have"));
  }
  const auto n = static_cast<size_t>(buf[0]);
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>(static_cast<unsigned char>(buf[i + 1]));
  return out;
}

absl::StatusOr<std::vector<uint64_t>> AllGatherU64(Communicator& comm,
                                                   const std::vector<uint64_t>& mine) {
  const size_t k = mine.size() * 4;
  std::vector<float> send(k), recv(k * comm.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    for (int c = 0; c < 4; ++c)
      send[i * 4 + c] = static_cast<float>((mine[i] >> (16 * c)) & 0xffff);
  }
  FSDP_RETURN_IF_ERROR(
      comm.AllGather(send.data(), recv.data(), static_cast<int64_t>(k), DType::kF32));
  std::vector<uint64_t> out(mine.size() * comm.size(), 0);
  for (size_t i = 0; i < out.size(); ++i) {
    for (int c = 0; c < 4; ++c) {
      out[i] |= static_cast<uint64_t>(recv[i * 4 + c]) << (16 * c);
    }
  }
  return out;
}

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
  absl::StatusOr<std::string> got = BroadcastString(comm, encoded, root, 2000);
  if (!got.ok() || got->empty()) return local.ok() ? got.status() : local;
  const auto code = static_cast<absl::StatusCode>(static_cast<unsigned char>((*got)[0]));
  return absl::Status(code == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : code,
                      got->substr(1));
}

}  // namespace fsdp::checkpoint
