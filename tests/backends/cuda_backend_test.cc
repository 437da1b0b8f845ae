// The CUDA backend's own contract (fsdp/cuda_backend.h). CudaBackendNoGpu runs
// everywhere: without a device, creating a backend says why. CudaBackendGpu needs a GPU (the
// gpu-labelled entry cuda_backend_test_gpu): copies, streams ordered by events, stream-ordered
// frees, the memory limit, a bad view failing the backend with the op's name, and the data
// plane of ranks as threads sharing the device.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "fsdp/cuda_backend.h"
#include "fsdp/data_plane.h"
#include "fsdp/local_world.h"
#include "fsdp/ops.h"
#include "tests/test_backend.h"

namespace fsdp {
namespace {

TEST(CudaBackendNoGpu, CreateSaysWhyWithoutADevice) {
  const int n = CudaDeviceCount();
  if (n == 0) {
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create();
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
    EXPECT_NE(b.status().message().find("no CUDA device"), std::string::npos) << b.status();
    EXPECT_EQ(CudaUnavailableReason().rfind("no CUDA device", 0), 0u) << CudaUnavailableReason();
  } else {
    EXPECT_EQ(CudaUnavailableReason(), "");
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create({.device = n});
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
    EXPECT_NE(b.status().message().find("does not exist"), std::string::npos) << b.status();
  }
}

class CudaBackendGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = testing::CudaUnavailable();
    if (!why.empty()) GTEST_SKIP() << why;
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create();
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(*b);
  }
  std::unique_ptr<CudaBackend> b_;
};

TEST_F(CudaBackendGpu, CopiesRoundTripAndMemsetSetsBytes) {
  std::vector<float> host(1000);
  std::iota(host.begin(), host.end(), 1.0f);
  auto a = Buffer::Create(b_.get(), host.size() * sizeof(float));
  auto c = Buffer::Create(b_.get(), host.size() * sizeof(float));
  ASSERT_TRUE(a.ok() && c.ok());
  ASSERT_TRUE(b_->CopyFromHost(a->view(), host.data()).ok());
  ASSERT_TRUE(b_->Copy(c->view(), a->view()).ok());
  auto back = testing::ToHost(b_.get(), c->view());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, host);
  ASSERT_TRUE(b_->Memset(c->view().Slice(10, 5), 0).ok());
  back = testing::ToHost(b_.get(), c->view());
  ASSERT_TRUE(back.ok());
  for (int i = 0; i < 1000; ++i) EXPECT_EQ((*back)[i], i >= 10 && i < 15 ? 0.0f : host[i]) << i;
}

TEST_F(CudaBackendGpu, TheCommStreamReadsWhatComputeWroteAfterWaitingForItsEvent) {
  constexpr int64_t n = 1 << 22;
  std::vector<float> ones(n, 1.0f);
  auto x = Buffer::Create(b_.get(), n * sizeof(float));
  auto y = Buffer::Create(b_.get(), n * sizeof(float));
  ASSERT_TRUE(x.ok() && y.ok());
  ASSERT_TRUE(b_->CopyFromHost(x->view(), ones.data()).ok());
  for (int i = 0; i < 20; ++i) b_->ops().Scale(Stream::kCompute, x->view(), 2.0f);
  ASSERT_TRUE(b_->Wait(Stream::kComm, b_->Record(Stream::kCompute)).ok());
  ASSERT_TRUE(b_->Copy(y->view(), x->view(), Stream::kComm).ok());
  std::vector<float> got(n);
  ASSERT_TRUE(b_->CopyToHost(got.data(), y->view(), Stream::kComm).ok());
  EXPECT_EQ(got[0], 1048576.0f);
  EXPECT_EQ(got[n - 1], 1048576.0f);
}

TEST_F(CudaBackendGpu, FreedMemoryIsReusedAndCountedFreeAtOnce) {
  const int64_t before = b_->memory_stats().bytes_in_use;
  for (int i = 0; i < 50; ++i) {
    auto x = Buffer::Create(b_.get(), 8 << 20);
    ASSERT_TRUE(x.ok()) << x.status();
    b_->ops().Scale(Stream::kCompute, x->view(), 0.5f);
    EXPECT_EQ(b_->memory_stats().bytes_in_use, before + (8 << 20));
  }
  EXPECT_EQ(b_->memory_stats().bytes_in_use, before);
  EXPECT_TRUE(b_->Synchronize().ok());
}

TEST_F(CudaBackendGpu, AllocationsPastTheLimitAreResourceExhausted) {
  auto small = CudaBackend::Create({.memory_limit_bytes = 4 << 20});
  ASSERT_TRUE(small.ok());
  auto fits = Buffer::Create(small->get(), 2 << 20);
  ASSERT_TRUE(fits.ok()) << fits.status();
  auto too_big = Buffer::Create(small->get(), 8 << 20);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
}

TEST_F(CudaBackendGpu, ABadViewFailsTheBackendNamingTheOp) {
  auto cpu = testing::MakeTestBackend(1, 0, "cpu");
  ASSERT_TRUE(cpu.ok());
  auto host = Buffer::Create(cpu->get(), 64);
  auto dev = Buffer::Create(b_.get(), 64);
  ASSERT_TRUE(host.ok() && dev.ok());
  b_->ops().GeluForward(Stream::kCompute, dev->view(), host->view());
  const absl::Status s = b_->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("GeluForward"), std::string::npos) << s;
}

TEST_F(CudaBackendGpu, CopyToHostCountsAHostSynchronisation) {
  auto x = Buffer::Create(b_.get(), 16);
  ASSERT_TRUE(x.ok());
  float out[4];
  const int64_t before = b_->host_syncs();
  ASSERT_TRUE(b_->CopyToHost(out, x->view()).ok());
  EXPECT_EQ(b_->host_syncs(), before + 1);
}

TEST_F(CudaBackendGpu, RanksAsThreadsSharingTheDeviceGatherAndReduce) {
  constexpr int kRanks = 3;
  constexpr int64_t kChunk = 1000;
  absl::Status st = LocalWorld::Run(kRanks, CommOptions{.timeout = absl::Seconds(60)}, [&](Communicator& comm) {
    const int r = comm.rank();
    auto b = CudaBackend::Create();
    if (!b.ok()) return b.status();
    auto plane = (*b)->CreateDataPlane(comm);
    if (!plane.ok()) return plane.status();
    std::vector<float> mine(kRanks * kChunk);
    for (int64_t i = 0; i < kRanks * kChunk; ++i) mine[i] = static_cast<float>(r * 100000 + i);
    auto send = Buffer::Create(b->get(), mine.size() * sizeof(float));
    auto recv = Buffer::Create(b->get(), mine.size() * sizeof(float));
    if (!send.ok() || !recv.ok()) return absl::InternalError("allocation");
    FSDP_RETURN_IF_ERROR((*b)->CopyFromHost(send->view(), mine.data()));
    // all_gather of each rank's first chunk
    FSDP_ASSIGN_OR_RETURN(Event e, (*plane)->AllGather(send->view().Slice(0, kChunk), recv->view()));
    FSDP_RETURN_IF_ERROR((*b)->Wait(Stream::kCompute, e));
    FSDP_ASSIGN_OR_RETURN(std::vector<float> got, testing::ToHost(b->get(), recv->view()));
    for (int q = 0; q < kRanks; ++q) {
      for (int64_t i = 0; i < kChunk; ++i) {
        if (got[q * kChunk + i] != static_cast<float>(q * 100000 + i)) {
          return absl::InternalError(absl::StrCat("all_gather: rank ", r, " element ", q * kChunk + i));
        }
      }
    }
    // reduce_scatter (sum)
    FSDP_ASSIGN_OR_RETURN(e, (*plane)->ReduceScatter(send->view(), recv->view().Slice(0, kChunk),
                                                      ReduceOp::kSum));
    FSDP_RETURN_IF_ERROR((*b)->Wait(Stream::kCompute, e));
    FSDP_ASSIGN_OR_RETURN(got, testing::ToHost(b->get(), recv->view().Slice(0, kChunk)));
    for (int64_t i = 0; i < kChunk; ++i) {
      float want = 0;
      for (int q = 0; q < kRanks; ++q) want += static_cast<float>(q * 100000 + r * kChunk + i);
      if (got[i] != want) return absl::InternalError(absl::StrCat("reduce_scatter: rank ", r, " element ", i));
    }
    // all_to_all: chunk q of the output is chunk r of rank q's send
    FSDP_ASSIGN_OR_RETURN(e, (*plane)->AllToAll(send->view(), recv->view()));
    FSDP_RETURN_IF_ERROR((*b)->Wait(Stream::kCompute, e));
    FSDP_ASSIGN_OR_RETURN(got, testing::ToHost(b->get(), recv->view()));
    for (int q = 0; q < kRanks; ++q) {
      for (int64_t i = 0; i < kChunk; ++i) {
        if (got[q * kChunk + i] != static_cast<float>(q * 100000 + r * kChunk + i)) {
          return absl::InternalError(absl::StrCat("all_to_all: rank ", r, " element ", q * kChunk + i));
        }
      }
    }
    // all_reduce in place (avg)
    FSDP_ASSIGN_OR_RETURN(e, (*plane)->AllReduce(send->view(), send->view(), ReduceOp::kAvg));
    FSDP_RETURN_IF_ERROR((*b)->Wait(Stream::kCompute, e));
    FSDP_ASSIGN_OR_RETURN(got, testing::ToHost(b->get(), send->view()));
    for (int64_t i = 0; i < kRanks * kChunk; ++i) {
      float sum = 0;
      for (int q = 0; q < kRanks; ++q) sum += static_cast<float>(q * 100000 + i);
      if (got[i] != sum / kRanks) return absl::InternalError(absl::StrCat("all_reduce: rank ", r, " element ", i));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace fsdp
