// CpuBackend: creation errors, aligned allocation with byte accounting, Buffer ownership,
// host copies, the op table, and per-thread OpenMP binding.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/ops.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

std::unique_ptr<CpuBackend> MakeBackend(CpuBackendOptions options = {}) {
  auto b = CpuBackend::Create(options);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(b).value();
}

TEST(CpuBackend, CreateRejectsBadOptions) {
  auto neg = CpuBackend::Create({.num_threads = -1});
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(neg.status().message().find("num_threads"), std::string_view::npos);

  auto ranks = CpuBackend::Create({.num_threads = 0, .ranks_sharing_cores = 0});
  ASSERT_FALSE(ranks.ok());
  EXPECT_EQ(ranks.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackend, ThreadCount) {
  EXPECT_EQ(MakeBackend({.num_threads = 3})->num_threads(), 3);
  EXPECT_EQ(MakeBackend()->num_threads(), HardwareThreads());
  // Ranks sharing the cores split them, but every rank gets at least one thread.
  EXPECT_EQ(MakeBackend({.ranks_sharing_cores = HardwareThreads() * 4})->num_threads(), 1);
  EXPECT_EQ(MakeBackend()->name(), "cpu");
}

TEST(CpuBackend, AllocateIsAlignedAndAccounted) {
  auto be = MakeBackend();
  auto zero = be->Allocate(0);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(zero->address, nullptr);
  EXPECT_EQ(be->memory_stats().bytes_in_use, 0);

  std::vector<Allocation> ptrs;
  int64_t expected = 0;
  for (size_t bytes : {1u, 3u, 64u, 100u, 4096u, 12345u}) {
    auto p = be->Allocate(bytes);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_NE(p->address, nullptr);
    EXPECT_EQ(p->address, p->storage);  // host memory: the address is the bytes
    EXPECT_EQ(p->bytes, bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p->address) % 64, 0u) << bytes << " bytes";
    std::memset(p->address, 0xab, bytes);  // the whole requested size is usable (ASan checks this)
    ptrs.push_back(*p);
    expected += static_cast<int64_t>(bytes);
    EXPECT_EQ(be->memory_stats().bytes_in_use, expected);
  }
  MemoryStats s = be->memory_stats();
  EXPECT_EQ(s.peak_bytes, expected);
  EXPECT_EQ(s.num_allocs, 6);

  be->Free(ptrs.back());  // 12345 bytes
  ptrs.pop_back();
  s = be->memory_stats();
  EXPECT_EQ(s.bytes_in_use, expected - 12345);
  EXPECT_EQ(s.peak_bytes, expected);  // the peak remembers
  be->ResetPeak();
  EXPECT_EQ(be->memory_stats().peak_bytes, expected - 12345);
  for (const Allocation& p : ptrs) be->Free(p);
  be->Free(Allocation{});  // allowed, no effect
  s = be->memory_stats();
  EXPECT_EQ(s.bytes_in_use, 0);
  EXPECT_EQ(s.num_allocs, 6);
}

TEST(Buffer, RaiiAndMove) {
  auto be = MakeBackend();
  {
    auto a = Buffer::Create(be.get(), 1000);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->bytes(), 1000u);
    EXPECT_EQ(a->backend(), be.get());
    EXPECT_EQ(be->memory_stats().bytes_in_use, 1000);

    Buffer moved = std::move(*a);
    EXPECT_EQ(a->data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_EQ(moved.bytes(), 1000u);
    EXPECT_EQ(be->memory_stats().bytes_in_use, 1000);

    auto b = Buffer::Create(be.get(), 24);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(be->memory_stats().bytes_in_use, 1024);
    moved = std::move(*b);  // frees the 1000-byte allocation it held
    EXPECT_EQ(be->memory_stats().bytes_in_use, 24);
    EXPECT_EQ(moved.bytes(), 24u);

    moved.Reset();
    EXPECT_EQ(moved.data(), nullptr);
    EXPECT_EQ(be->memory_stats().bytes_in_use, 0);
    auto c = Buffer::Create(be.get(), 8);
    ASSERT_TRUE(c.ok());
  }
  EXPECT_EQ(be->memory_stats().bytes_in_use, 0);  // c freed by its destructor

  auto null_backend = Buffer::Create(nullptr, 8);
  EXPECT_EQ(null_backend.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackend, CopiesAndMemset) {
  auto be = MakeBackend();
  auto buf = Buffer::Create(be.get(), 16 * sizeof(float));
  ASSERT_TRUE(buf.ok());
  std::vector<float> src(16), dst(16, -1.0f);
  for (int i = 0; i < 16; ++i) src[i] = 0.5f * static_cast<float>(i);
  const int64_t syncs = be->host_syncs();
  ASSERT_TRUE(be->CopyFromHost(buf->view(), src.data()).ok());
  ASSERT_TRUE(be->CopyToHost(dst.data(), buf->view()).ok());
  EXPECT_EQ(src, dst);
  ASSERT_TRUE(be->Memset(buf->view().Slice(0, 8), 0).ok());
  ASSERT_TRUE(be->CopyToHost(dst.data(), buf->view()).ok());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(dst[i], i < 8 ? 0.0f : src[i]);
  // A view addresses (buffer, byte offset): elements 4..7 seen as bytes, then as f32 again.
  const View v = buf->view().Slice(4, 4);
  EXPECT_EQ(v.offset, 16);
  EXPECT_EQ(v.As(DType::kU8).count, 16);
  EXPECT_EQ(v.host_as<float>(), buf->as<float>() + 4);
  ASSERT_TRUE(be->Copy(buf->view().Slice(0, 4), buf->view().Slice(12, 4)).ok());
  ASSERT_TRUE(be->CopyToHost(dst.data(), buf->view()).ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(dst[i], src[12 + i]);
  // Zero-element copies accept empty views and null pointers.
  EXPECT_TRUE(be->CopyToHost(nullptr, View{}).ok());
  EXPECT_TRUE(be->CopyFromHost(View{}, nullptr).ok());
  EXPECT_TRUE(be->Synchronize().ok());
  EXPECT_EQ(be->host_syncs() - syncs, 5);  // 4 CopyToHost and one Synchronize
}

TEST(CpuBackend, OpsRunTheKernelsAndReduceIntoDeviceScalars) {
  auto be = MakeBackend();
  Ops& ops = be->ops();
  std::vector<float> a = {1, 2, 3, 4}, b = {10, 20, 30, 40}, out(4);
  const View va = *WrapHostMemory(be.get(), a.data(), 4, DType::kF32);
  const View vb = *WrapHostMemory(be.get(), b.data(), 4, DType::kF32);
  const View vo = *WrapHostMemory(be.get(), out.data(), 4, DType::kF32);
  ops.Add(Stream::kCompute, vo, va, vb);
  EXPECT_EQ(out[3], 44.0f);
  // Sums of squares accumulate into a device f64; nothing returns to the host.
  double sq = 1.0;
  const View vsq = *WrapHostMemory(be.get(), &sq, 1, DType::kF64);
  ops.SumSquares(Stream::kCompute, vsq, va);
  EXPECT_DOUBLE_EQ(sq, 31.0);
  float split[2];
  ops.SplitF64(Stream::kCompute, *WrapHostMemory(be.get(), split, 2, DType::kF32), vsq);
  EXPECT_EQ(static_cast<double>(split[0]) + split[1], 31.0);
}

TEST(CpuBackend, TimesEachOpByNameOnlyWhenAsked) {
  std::vector<float> a = {1, 2, 3, 4}, out(4);
  {
    auto quiet = MakeBackend();
    const View va = *WrapHostMemory(quiet.get(), a.data(), 4, DType::kF32);
    const View vo = *WrapHostMemory(quiet.get(), out.data(), 4, DType::kF32);
    quiet->ops().Add(Stream::kCompute, vo, va, va);
    EXPECT_TRUE(quiet->op_times().empty());
  }
  auto be = MakeBackend({.time_ops = true});
  const View va = *WrapHostMemory(be.get(), a.data(), 4, DType::kF32);
  const View vo = *WrapHostMemory(be.get(), out.data(), 4, DType::kF32);
  for (int i = 0; i < 3; ++i) be->ops().Add(Stream::kCompute, vo, va, va);
  be->ops().Scale(Stream::kCompute, vo, 0.5f);
  EXPECT_EQ(out[3], 4.0f);  // timed ops still run
  std::vector<CpuOpTime> times = be->op_times();
  ASSERT_EQ(times.size(), 2u);
  EXPECT_EQ(times[0].op, "Add");
  EXPECT_EQ(times[0].calls, 3);
  EXPECT_EQ(times[1].op, "Scale");
  EXPECT_EQ(times[1].calls, 1);
  for (const CpuOpTime& t : times) EXPECT_GE(t.seconds, 0.0) << t.op;
  be->ResetOpTimes();
  EXPECT_TRUE(be->op_times().empty());
}

TEST(CpuBackend, WrapHostMemory) {
  auto be = MakeBackend();
  std::vector<int32_t> ids = {3, 1, 4};
  auto v = WrapHostMemory(be.get(), ids.data(), 3, DType::kI32);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->host_as<int32_t>(), ids.data());
  EXPECT_EQ(v->bytes(), 12);
  EXPECT_EQ(WrapHostMemory(be.get(), nullptr, 3, DType::kI32).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WrapHostMemory(nullptr, ids.data(), 3, DType::kI32).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(CpuBackend, BindCurrentThreadIsPerThread) {
  const int before = omp_get_max_threads();
  const int wanted = before + 3;  // differs from the default whatever the machine
  auto be = MakeBackend({.num_threads = wanted});
  int seen_in_thread = 0, seen_in_sibling = 0;
  std::thread t([&] {
    be->BindCurrentThread();
    seen_in_thread = omp_get_max_threads();
  });
  t.join();
  std::thread sibling([&] { seen_in_sibling = omp_get_max_threads(); });
  sibling.join();
  EXPECT_EQ(seen_in_thread, wanted);
  EXPECT_EQ(seen_in_sibling, before);          // other threads keep the default
  EXPECT_EQ(omp_get_max_threads(), before);  // the calling thread is untouched
}

}  // namespace
}  // namespace fsdp
