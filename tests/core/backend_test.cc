// CpuBackend: creation errors, aligned allocation with byte accounting, Buffer ownership,
// host copies, the op table, and per-thread OpenMP binding.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/backend.h"
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
  EXPECT_EQ(*zero, nullptr);
  EXPECT_EQ(be->memory_stats().bytes_in_use, 0);

  std::vector<void*> ptrs;
  int64_t expected = 0;
  for (size_t bytes : {1u, 3u, 64u, 100u, 4096u, 12345u}) {
    auto p = be->Allocate(bytes);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_NE(*p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % 64, 0u) << bytes << " bytes";
    std::memset(*p, 0xab, bytes);  // the whole requested size is usable (ASan checks this)
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
  for (void* p : ptrs) be->Free(p);
  be->Free(nullptr);  // allowed, no effect
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
  ASSERT_TRUE(be->CopyFromHost(buf->data(), src.data(), 16 * sizeof(float)).ok());
  ASSERT_TRUE(be->CopyToHost(dst.data(), buf->data(), 16 * sizeof(float)).ok());
  EXPECT_EQ(src, dst);
  ASSERT_TRUE(be->Memset(buf->data(), 0, 8 * sizeof(float)).ok());
  ASSERT_TRUE(be->CopyToHost(dst.data(), buf->data(), 16 * sizeof(float)).ok());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(dst[i], i < 8 ? 0.0f : src[i]);
  // Zero-byte copies accept null pointers.
  EXPECT_TRUE(be->CopyToHost(nullptr, nullptr, 0).ok());
  EXPECT_TRUE(be->CopyFromHost(nullptr, nullptr, 0).ok());
  EXPECT_TRUE(be->Synchronize().ok());
}

TEST(CpuBackend, OpsTableIsComplete) {
  auto be = MakeBackend();
  const Ops& ops = be->ops();
  // Every entry is a function pointer; view the struct as an array of them.
  static_assert(sizeof(Ops) % sizeof(void (*)()) == 0);
  const auto* entries = reinterpret_cast<const unsigned char*>(&ops);
  for (size_t i = 0; i < sizeof(Ops) / sizeof(void (*)()); ++i) {
    void (*fn)() = nullptr;
    std::memcpy(&fn, entries + i * sizeof(fn), sizeof(fn));
    EXPECT_NE(fn, nullptr) << "entry " << i;
  }
  EXPECT_EQ(ops.matmul_forward, &kernels::cpu::matmul_forward);
  EXPECT_EQ(ops.all_finite, &kernels::cpu::all_finite);

  // Calling through the table runs the kernel.
  const float a[4] = {1, 2, 3, 4};
  const float b[4] = {10, 20, 30, 40};
  float out[4];
  ops.residual_forward(out, a, b, 4);
  EXPECT_EQ(out[3], 44.0f);
  EXPECT_DOUBLE_EQ(ops.sum_squares(a, 4), 30.0);
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
