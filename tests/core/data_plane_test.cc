// DataPlane's public calls check their arguments once for every backend (fsdp/data_plane.h):
// each bad argument is an InvalidArgument that names the plane, the collective, the rank and
// what is wrong, and reaches no backend's Enqueue*; a plane may post a rejected call to its
// peers (Rejected). Checked with a recording plane on the CPU backend.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fsdp/cpu_backend.h"
#include "fsdp/data_plane.h"

namespace fsdp {
namespace {

class RecordingPlane final : public DataPlane {
 public:
  RecordingPlane(const Backend* backend, int size, bool post_rejects)
      : DataPlane(backend, "recording"), size_(size), post_rejects_(post_rejects) {}
  int rank() const override { return 1; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  void Abort(const absl::Status&) override {}

  std::vector<std::string> enqueued, rejected;

 private:
  absl::StatusOr<Event> EnqueueAllGather(View, View, Stream) override {
    enqueued.push_back("all_gather");
    return Event();
  }
  absl::StatusOr<Event> EnqueueReduceScatter(View, View, ReduceOp, Stream) override {
    enqueued.push_back("reduce_scatter");
    return Event();
  }
  absl::StatusOr<Event> EnqueueAllReduce(View, View, ReduceOp, Stream) override {
    enqueued.push_back("all_reduce");
    return Event();
  }
  absl::StatusOr<Event> EnqueueAllToAll(View, View, Stream) override {
    enqueued.push_back("all_to_all");
    return Event();
  }
  absl::StatusOr<Event> Rejected(CollectiveKind kind, View send, View recv, ReduceOp op,
                                 Stream after, absl::Status why) override {
    if (!post_rejects_) return DataPlane::Rejected(kind, send, recv, op, after, std::move(why));
    rejected.push_back(std::string(why.message()));
    return Event();
  }

  int size_;
  bool post_rejects_;
  std::string name_ = "g";
};

TEST(DataPlaneTest, ChecksTheArgumentsOnceBeforeTheBackendSeesThem) {
  auto cpu = std::move(CpuBackend::Create({.num_threads = 1})).value();
  auto other = std::move(CpuBackend::Create({.num_threads = 1})).value();
  Buffer a = std::move(Buffer::Create(cpu.get(), 64 * 4)).value();
  Buffer b = std::move(Buffer::Create(cpu.get(), 64 * 4)).value();
  Buffer foreign = std::move(Buffer::Create(other.get(), 64 * 4)).value();
  RecordingPlane plane(cpu.get(), 4, /*post_rejects=*/false);

  // Valid calls reach the backend.
  ASSERT_TRUE(plane.AllGather(a.view().Slice(0, 16), b.view()).ok());
  ASSERT_TRUE(plane.ReduceScatter(a.view(), b.view().Slice(0, 16), ReduceOp::kAvg).ok());
  ASSERT_TRUE(plane.AllReduce(a.view(), a.view(), ReduceOp::kSum).ok());
  ASSERT_TRUE(plane.AllGather(a.view().As(DType::kU8).Slice(0, 4), b.view().As(DType::kU8).Slice(0, 16)).ok());
  ASSERT_TRUE(plane.AllToAll(a.view().As(DType::kU8), b.view().As(DType::kU8)).ok());
  EXPECT_EQ(plane.enqueued, (std::vector<std::string>{"all_gather", "reduce_scatter", "all_reduce",
                                                      "all_gather", "all_to_all"}));
  plane.enqueued.clear();

  View past = a.view();
  past.count = 65;
  View negative = a.view();
  negative.count = -1;
  View unknown = a.view();
  unknown.dtype = static_cast<DType>(99);
  const struct {
    absl::StatusOr<Event> got;
    const char* says;
  } cases[] = {
      {plane.AllGather(foreign.view().Slice(0, 16), b.view()),
       "all_gather on rank 1: the send view is not memory of this rank's recording backend"},
      {plane.AllReduce(a.view(), foreign.view(), ReduceOp::kSum),
       "all_reduce(sum) on rank 1: the recv view is not memory"},
      {plane.AllReduce(past, past, ReduceOp::kSum), "does not fit in its allocation of 256 bytes"},
      {plane.AllReduce(negative, a.view(), ReduceOp::kSum), "the send view has count -1"},
      {plane.AllReduce(unknown, a.view(), ReduceOp::kSum), "unknown dtype"},
      {plane.AllReduce(a.view(), a.view(), static_cast<ReduceOp>(7)), "unknown reduce op 7"},
      {plane.AllReduce(a.view(), a.view().As(DType::kBF16).Slice(0, 64), ReduceOp::kSum),
       "send is f32 but recv is bf16"},
      {plane.AllReduce(a.view().As(DType::kI32), b.view().As(DType::kI32), ReduceOp::kMax),
       "reductions take f32, bf16 or f16, not i32"},
      {plane.AllGather(a.view().Slice(0, 16), b.view().Slice(0, 60)),
       "recv holds 60 elements but must hold group size 4 x send 16 = 64"},
      {plane.ReduceScatter(a.view().Slice(0, 62), b.view().Slice(0, 15), ReduceOp::kSum),
       "send holds 62 elements, not a multiple of the group size 4"},
      {plane.ReduceScatter(a.view(), b.view().Slice(0, 15), ReduceOp::kSum),
       "recv holds 15 elements but must hold send 64 / group size 4 = 16"},
      {plane.AllReduce(a.view(), b.view().Slice(0, 63), ReduceOp::kSum),
       "send holds 64 elements but recv holds 63"},
      {plane.AllToAll(a.view().Slice(0, 62), b.view().Slice(0, 62)),
       "all_to_all on rank 1: send holds 62 elements, not a multiple of the group size 4"},
      {plane.AllToAll(a.view(), b.view().Slice(0, 60)), "send holds 64 elements but recv holds 60"},
      {plane.AllToAll(a.view().Slice(0, 32), a.view().Slice(16, 32)),
       "send and recv overlap; all_to_all is not in place"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(c.got.status().code(), absl::StatusCode::kInvalidArgument) << c.says;
    EXPECT_NE(c.got.status().message().find("recording data plane 'g' "), std::string::npos)
        << c.got.status();
    EXPECT_NE(c.got.status().message().find(c.says), std::string::npos) << c.got.status();
  }
  EXPECT_TRUE(plane.enqueued.empty()) << "a rejected call reached the backend";

  // A plane that tells its peers gets the rejected call with the reason.
  RecordingPlane posting(cpu.get(), 4, /*post_rejects=*/true);
  EXPECT_TRUE(posting.AllReduce(a.view(), b.view().Slice(0, 63), ReduceOp::kSum).ok());
  ASSERT_EQ(posting.rejected.size(), 1u);
  EXPECT_NE(posting.rejected[0].find("send holds 64 elements but recv holds 63"),
            std::string::npos);
  EXPECT_TRUE(posting.enqueued.empty());
}

}  // namespace
}  // namespace fsdp
