// The data planes of the cuda backend (CreateCudaDataPlane, cuda_internal.h).
//
// Choosing. CreateCudaDataPlane gathers over the group's host communicator, from every rank:
// a process identity (a random per-process nonce, the pid, the hostname) and its GPU (UUID,
// PCI address, ordinal). All ranks threads of one process on one GPU -> the shared-GPU plane
// (this also covers a group of one rank); every rank on a GPU of its own (distinct (host, GPU))
// -> NCCL; anything else (two processes on one GPU, some ranks sharing a GPU and others not)
// -> FailedPrecondition saying which ranks share which GPU and what to do. Every rank decides
// from the same gathered data, so all ranks make the same choice or fail together.
//
//
// The planes: nccl_data_plane.cc and shared_gpu_data_plane.cc.
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "backends/cuda/cuda_data_plane_common.h"
#include "backends/cuda/cuda_internal.h"
#include "collectives/control.h"
#include "kernels/cuda/kernels.h"
namespace fsdp::cuda_internal {
namespace {

// ---------------------------------------------------------------------------------- choosing

// Distinguishes this process from any other (a pid alone repeats across hosts and pid
// namespaces; the nonce, pid and hostname together do not).
uint64_t ProcessNonce() {
  static const uint64_t nonce = [] {
    std::random_device rd;
    uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    v ^= static_cast<uint64_t>(Clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
    return v == 0 ? 1 : v;
  }();
  return nonce;
}

constexpr size_t kHostWords = 8;  // hostname: 64 bytes
constexpr size_t kFields = 8 + kHostWords;

struct RankInfo {
  bool ok = false;
  uint64_t nonce = 0, pid = 0, backend = 0, uuid_lo = 0, uuid_hi = 0, pci = 0;
  int64_t ordinal = -1;
  std::string host;

  bool SameProcess(const RankInfo& o) const {
    return nonce == o.nonce && pid == o.pid && host == o.host;
  }
  bool HasUuid() const { return uuid_lo != 0 || uuid_hi != 0; }
  bool SameDevice(const RankInfo& o) const {
    if (host != o.host) return false;
    if (HasUuid() && o.HasUuid()) return uuid_lo == o.uuid_lo && uuid_hi == o.uuid_hi;
    return pci == o.pci;
  }
  std::string Device() const {
    return absl::StrFormat("GPU %04x:%02x:%02x.0 (device %d) on host '%s'",
                           static_cast<unsigned>(pci >> 32),
                           static_cast<unsigned>((pci >> 8) & 0xffffff),
                           static_cast<unsigned>(pci & 0xff), ordinal, host);
  }
};

absl::Status ReadLocalInfo(CudaBackend& b, RankInfo* info) {
  info->nonce = ProcessNonce();
  info->pid = static_cast<uint64_t>(getpid());
  info->backend = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&b));
  char host[kHostWords * 8 + 1] = {};
  if (gethostname(host, kHostWords * 8) != 0) std::strcpy(host, "?");
  host[kHostWords * 8] = '\0';
  info->host = host;
  FSDP_RETURN_IF_ERROR(UseDevice(b));
  cudaDeviceProp prop;
  std::memset(&prop, 0, sizeof(prop));
  FSDP_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, b.device()),
                                  absl::StrCat("cudaGetDeviceProperties(", b.device(), ")")));
  std::memcpy(&info->uuid_lo, prop.uuid.bytes, 8);
  std::memcpy(&info->uuid_hi, prop.uuid.bytes + 8, 8);
  info->pci = (static_cast<uint64_t>(static_cast<uint32_t>(prop.pciDomainID)) << 32) |
              (static_cast<uint64_t>(static_cast<uint32_t>(prop.pciBusID) & 0xffffff) << 8) |
              (static_cast<uint64_t>(static_cast<uint32_t>(prop.pciDeviceID)) & 0xff);
  info->ordinal = b.device();
  info->ok = true;
  return absl::OkStatus();
}

std::vector<uint64_t> Pack(const RankInfo& i) {
  std::vector<uint64_t> v = {i.ok ? uint64_t{1} : uint64_t{0}, i.nonce, i.pid, i.backend,
                             i.uuid_lo, i.uuid_hi, i.pci, static_cast<uint64_t>(i.ordinal)};
  char host[kHostWords * 8] = {};
  std::memcpy(host, i.host.data(), std::min(i.host.size(), sizeof(host)));
  for (size_t w = 0; w < kHostWords; ++w) {
    uint64_t x = 0;
    std::memcpy(&x, host + 8 * w, 8);
    v.push_back(x);
  }
  return v;
}

RankInfo Unpack(const uint64_t* d) {
  RankInfo i;
  i.ok = d[0] != 0;
  i.nonce = d[1];
  i.pid = d[2];
  i.backend = d[3];
  i.uuid_lo = d[4];
  i.uuid_hi = d[5];
  i.pci = d[6];
  i.ordinal = static_cast<int64_t>(d[7]);
  char host[kHostWords * 8 + 1] = {};
  std::memcpy(host, d + 8, kHostWords * 8);
  i.host = host;
  return i;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> CreateCudaDataPlane(CudaBackend& b,
                                                               Communicator& group) {
  const std::string name = group.name();
  const int n = group.size();
  RankInfo mine;
  const absl::Status local = ReadLocalInfo(b, &mine);
  absl::StatusOr<std::vector<uint64_t>> all = internal::AllGatherU64(group, Pack(mine));
  if (!local.ok()) {
    return absl::Status(local.code(),
                        absl::StrFormat("cuda data plane of group '%s': rank %d could not read "
                                        "its CUDA device: %s",
                                        name, group.rank(), std::string(local.message())));
  }
  if (!all.ok()) {
    return absl::Status(all.status().code(),
                        absl::StrFormat("cuda data plane of group '%s': gathering the ranks' "
                                        "processes and GPUs failed: %s",
                                        name, std::string(all.status().message())));
  }
  if (all->size() != kFields * static_cast<size_t>(n)) {
    return absl::InternalError(absl::StrFormat(
        "cuda data plane of group '%s': gathered %d values, expected %d", name, all->size(),
        kFields * static_cast<size_t>(n)));
  }
  std::vector<RankInfo> infos;
  std::vector<int> unreadable;
  for (int r = 0; r < n; ++r) {
    infos.push_back(Unpack(all->data() + kFields * static_cast<size_t>(r)));
    if (!infos.back().ok) unreadable.push_back(r);
  }
  if (!unreadable.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda data plane of group '%s': ranks [%s] could not read their CUDA device (their own "
        "errors say why); no data plane was made",
        name, absl::StrJoin(unreadable, ", ")));
  }

  bool one_process_one_gpu = true;
  for (const RankInfo& i : infos) {
    one_process_one_gpu = one_process_one_gpu && i.SameProcess(infos[0]) && i.SameDevice(infos[0]);
  }
  if (one_process_one_gpu) {
    std::vector<uint64_t> ids;
    for (const RankInfo& i : infos) ids.push_back(i.backend);
    return CreateSharedPlane(b, group, infos[0].Device(), ids);
  }

  // Ranks by device, in order of first rank.
  std::vector<std::vector<int>> by_device;
  for (int r = 0; r < n; ++r) {
    auto it = std::find_if(by_device.begin(), by_device.end(),
                           [&](const std::vector<int>& d) { return infos[d[0]].SameDevice(infos[r]); });
    if (it == by_device.end()) {
      by_device.push_back({r});
    } else {
      it->push_back(r);
    }
  }
  if (by_device.size() == static_cast<size_t>(n)) return CreateNcclPlane(b, group);

  std::vector<std::string> shared;
  for (const std::vector<int>& d : by_device) {
    if (d.size() < 2) continue;
    std::vector<std::string> users;
    for (int r : d) users.push_back(absl::StrFormat("%d (process %d)", r, infos[r].pid));
    shared.push_back(absl::StrFormat("%s is used by ranks %s", infos[d[0]].Device(),
                                     absl::StrJoin(users, ", ")));
  }
  return absl::FailedPreconditionError(absl::StrFormat(
      "cuda data plane of group '%s' (%d ranks): %s. The NCCL data plane needs one GPU per rank, "
      "and the shared-GPU data plane needs every rank to be a thread of one process on one GPU; "
      "give each rank its own GPU (CudaBackendOptions::device, or CUDA_VISIBLE_DEVICES per "
      "process), or run all the ranks as threads of one process on one GPU",
      name, n, absl::StrJoin(shared, "; ")));
}

}  // namespace fsdp::cuda_internal
