// The sharding runtime's pre-flight agreement on its options, field by field: every field of
// ShardingOptions is compared across ranks (a static list here, checked against the fields the
// struct has and the names the runtime emits), and ranks that differ in any one of them, at the
// first, a middle or the last rank, all fail at once in ShardingRuntime::Create naming it. An
// option that is invalid on one rank fails every rank at once too, never at a deadline.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/local_world.h"
#include "fsdp/sharding.h"
#include "fsdp/sim_backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/fsdp/rank_agreement.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

// The number of fields of an aggregate: the most initializers T{...} accepts (a member that is
// itself a struct counts once).
struct AnyField {
  template <class T>
  constexpr operator T() const;  // NOLINT: only ever named in unevaluated operands
};
template <class T, class... Fields>
constexpr size_t FieldCount() {
  if constexpr (requires { T{Fields{}..., AnyField{}}; }) {
    return FieldCount<T, Fields..., AnyField>();
  } else {
    return sizeof...(Fields);
  }
}

// Options under which a field is compared (the loss scaler's figures only with dynamic loss
// scaling, an optimizer's hyper-parameters only with that optimizer).
void Defaults(ShardingOptions&) {}
void Hybrid(ShardingOptions& o) {
  o.strategy = ShardingStrategy::kHybridShard;
  o.hybrid_shard_size = 2;
}
void Dynamic(ShardingOptions& o) { o.mixed_precision.dynamic_loss_scale = true; }
void Int8(ShardingOptions& o) { o.communication.all_gather = WireFormat::kInt8; }
void Offload(ShardingOptions& o) { o.offload.what = OffloadKind::kOptimizer; }
void Sgd(ShardingOptions& o) {
  o.optimizer = OptimizerKind::kSgd;
  o.sgd.momentum = 0.9f;
}

// Every field of ShardingOptions and of the structs inside it: the name the agreement gives
// it, the options under which it counts, and another valid value for one rank.
struct OptionField {
  const char* name;
  const char* owner;  // the struct that holds it
  void (*base)(ShardingOptions&);
  void (*differ)(ShardingOptions&);
};
const OptionField kFields[] = {
    {"strategy", "ShardingOptions", Defaults,
     [](ShardingOptions& o) { o.strategy = ShardingStrategy::kNoShard; }},
    {"hybrid_shard_size", "ShardingOptions", Hybrid,
     [](ShardingOptions& o) { o.hybrid_shard_size = 4; }},
    {"optimizer", "ShardingOptions", Defaults,
     [](ShardingOptions& o) { o.optimizer = OptimizerKind::kSgd; }},
    {"max_grad_norm", "ShardingOptions", Defaults, [](ShardingOptions& o) { o.max_grad_norm = 1; }},
    {"forward_prefetch", "ShardingOptions", Defaults,
     [](ShardingOptions& o) { o.forward_prefetch = false; }},
    {"backward_prefetch", "ShardingOptions", Defaults,
     [](ShardingOptions& o) { o.backward_prefetch = false; }},
    {"secondary_shard_size", "ShardingOptions", Defaults,
     [](ShardingOptions& o) { o.secondary_shard_size = 2; }},
    {"max_prefetch_units", "ShardingOptions", Defaults,
     [](ShardingOptions& o) { o.max_prefetch_units = 2; }},
    {"nonfinite", "ShardingOptions", Defaults,
     [](ShardingOptions& o) { o.nonfinite = NonFinitePolicy::kSkip; }},
    {"param_dtype", "MixedPrecision", Defaults,
     [](ShardingOptions& o) { o.mixed_precision.param_dtype = DType::kBF16; }},
    {"reduce_dtype", "MixedPrecision", Defaults,
     [](ShardingOptions& o) { o.mixed_precision.reduce_dtype = DType::kF16; }},
    {"dynamic_loss_scale", "MixedPrecision", Defaults,
     [](ShardingOptions& o) { o.mixed_precision.dynamic_loss_scale = true; }},
    {"initial_loss_scale", "MixedPrecision", Dynamic,
     [](ShardingOptions& o) { o.mixed_precision.initial_loss_scale = 1024; }},
    {"growth_factor", "MixedPrecision", Dynamic,
     [](ShardingOptions& o) { o.mixed_precision.growth_factor = 4; }},
    {"backoff_factor", "MixedPrecision", Dynamic,
     [](ShardingOptions& o) { o.mixed_precision.backoff_factor = 0.25f; }},
    {"growth_interval", "MixedPrecision", Dynamic,
     [](ShardingOptions& o) { o.mixed_precision.growth_interval = 100; }},
    {"communication.all_gather", "CommunicationOptions", Defaults,
     [](ShardingOptions& o) { o.communication.all_gather = WireFormat::kFp8E4M3; }},
    {"communication.reduction", "CommunicationOptions", Defaults,
     [](ShardingOptions& o) { o.communication.reduction = WireFormat::kInt8; }},
    {"communication.block_size", "CommunicationOptions", Int8,
     [](ShardingOptions& o) { o.communication.block_size = 64; }},
    {"offload", "OffloadOptions", Defaults,
     [](ShardingOptions& o) { o.offload.what = OffloadKind::kOptimizer; }},
    {"offload.units", "OffloadOptions", Offload,
     [](ShardingOptions& o) { o.offload.units = {"block0"}; }},
    {"offload.budget_bytes", "OffloadOptions", Offload,
     [](ShardingOptions& o) { o.offload.budget_bytes = 1 << 20; }},
    {"adamw.lr", "AdamWOptions", Defaults, [](ShardingOptions& o) { o.adamw.lr = 1e-3f; }},
    {"adamw.beta1", "AdamWOptions", Defaults, [](ShardingOptions& o) { o.adamw.beta1 = 0.8f; }},
    {"adamw.beta2", "AdamWOptions", Defaults, [](ShardingOptions& o) { o.adamw.beta2 = 0.99f; }},
    {"adamw.eps", "AdamWOptions", Defaults, [](ShardingOptions& o) { o.adamw.eps = 1e-6f; }},
    {"adamw.weight_decay", "AdamWOptions", Defaults,
     [](ShardingOptions& o) { o.adamw.weight_decay = 0; }},
    {"sgd.lr", "SgdOptions", Sgd, [](ShardingOptions& o) { o.sgd.lr = 0.1f; }},
    {"sgd.momentum", "SgdOptions", Sgd, [](ShardingOptions& o) { o.sgd.momentum = 0.5f; }},
    {"sgd.dampening", "SgdOptions", Sgd, [](ShardingOptions& o) { o.sgd.dampening = 0.1f; }},
    {"sgd.weight_decay", "SgdOptions", Sgd, [](ShardingOptions& o) { o.sgd.weight_decay = 0.01f; }},
    {"sgd.nesterov", "SgdOptions", Sgd, [](ShardingOptions& o) { o.sgd.nesterov = true; }},
};

size_t FieldsOf(std::string_view owner) {
  size_t n = 0;
  for (const OptionField& f : kFields) n += owner == f.owner ? 1 : 0;
  return n;
}

std::set<std::string> Names(const ShardingOptions& o) {
  std::set<std::string> names;
  for (const Setting& s : internal::ShardingOptionSettings(o)) names.insert(s.name);
  return names;
}

// A field added to ShardingOptions (or to a struct inside it) must be added to kFields, and so
// to the settings the runtime compares: otherwise ranks that differ in it train on.
TEST(ShardingOptionsAgreementTest, EveryFieldIsInTheComparedSettings) {
  const char* add = "a field was added: compare it in internal::ShardingOptionSettings "
                    "(src/fsdp/rank_agreement.cc) and add it to kFields here";
  // The plain fields, and the five structs inside: adamw, sgd, mixed_precision, communication,
  // offload.
  EXPECT_EQ(FieldCount<ShardingOptions>(), FieldsOf("ShardingOptions") + 5) << add;
  EXPECT_EQ(FieldCount<OffloadOptions>(), FieldsOf("OffloadOptions")) << add;
  EXPECT_EQ(FieldCount<MixedPrecision>(), FieldsOf("MixedPrecision")) << add;
  EXPECT_EQ(FieldCount<CommunicationOptions>(), FieldsOf("CommunicationOptions")) << add;
  EXPECT_EQ(FieldCount<AdamWOptions>(), FieldsOf("AdamWOptions")) << add;
  EXPECT_EQ(FieldCount<SgdOptions>(), FieldsOf("SgdOptions")) << add;
  // The names the runtime emits, over the options that bring every field into play, are the
  // list's; and each field's value on one rank changes its setting.
  std::set<std::string> emitted, listed;
  for (const OptionField& f : kFields) {
    listed.insert(f.name);
    ShardingOptions base;
    f.base(base);
    const std::set<std::string> names = Names(base);
    emitted.insert(names.begin(), names.end());
    EXPECT_TRUE(names.count(f.name)) << f.name << " is not compared under its base options";
    ShardingOptions other = base;
    f.differ(other);
    const std::vector<Setting> a = internal::ShardingOptionSettings(base);
    const std::vector<Setting> b = internal::ShardingOptionSettings(other);
    bool changed = false;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      if (a[i].name == f.name) changed = a[i].value != b[i].value;
    }
    EXPECT_TRUE(changed) << f.name << ": the test's other value does not change the setting";
  }
  EXPECT_EQ(emitted, listed);
}

// Short: every failure below must come at once, far before it.
constexpr absl::Duration kDeadline = absl::Seconds(4);

struct RankResult {
  absl::Status status;
  double seconds = 0;
};

// Creates the runtime on a world of `n` ranks, rank r with options_of(r).
std::vector<RankResult> CreateOnRanks(int n, const std::function<ShardingOptions(int)>& options_of) {
  std::vector<RankResult> out(n);
  CommOptions co;
  co.timeout = kDeadline;
  const absl::Status run = LocalWorld::Run(n, co, [&](Communicator& comm) -> absl::Status {
    // Offload needs a device whose memory is not the host's (the cpu backend refuses it).
    bool offload = false;
    for (int r = 0; r < n; ++r) offload = offload || options_of(r).offload.what != OffloadKind::kNone;
    std::unique_ptr<Backend> backend;
    if (offload) {
      FSDP_ASSIGN_OR_RETURN(backend, SimBackend::Create({.num_threads = 1}));
    } else {
      FSDP_ASSIGN_OR_RETURN(backend, CpuBackend::Create({.num_threads = 1}));
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto rt = ShardingRuntime::Create(backend.get(), comm, options_of(comm.rank()));
    RankResult& mine = out[comm.rank()];
    mine.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    mine.status = rt.status();
    return absl::OkStatus();
  });
  EXPECT_TRUE(run.ok()) << run;
  return out;
}

TEST(ShardingOptionsAgreementTest, RanksThatDifferInAnyOneOptionAllFailNamingIt) {
  constexpr int kRanks = 4;
  for (const OptionField& f : kFields) {
    for (int odd : {0, kRanks / 2, kRanks - 1}) {
      SCOPED_TRACE(absl::StrCat(f.name, " differs on rank ", odd));
      const std::vector<RankResult> got = CreateOnRanks(kRanks, [&](int r) {
        ShardingOptions o;
        f.base(o);
        if (r == odd) f.differ(o);
        return o;
      });
      const int named = odd == 0 ? 1 : odd;  // the first rank that differs from rank 0
      for (int r = 0; r < kRanks; ++r) {
        const absl::Status& s = got[r].status;
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << s;
        EXPECT_THAT(s.message(), HasSubstr(absl::StrCat(
                                     "sharding options: ranks were launched with different "
                                     "settings: ", f.name, " is ")))
            << "rank " << r;
        EXPECT_THAT(s.message(), HasSubstr(absl::StrCat(" on rank ", named, " but ")))
            << "rank " << r;
        EXPECT_EQ(s, got[0].status) << "rank " << r << " says something else";
        EXPECT_LT(got[r].seconds, absl::ToDoubleSeconds(kDeadline) / 2)
            << "rank " << r << " waited for a deadline";
      }
    }
  }
  // The same options on every rank: no error.
  for (const RankResult& r : CreateOnRanks(kRanks, [](int) { return ShardingOptions{}; })) {
    EXPECT_TRUE(r.status.ok()) << r.status;
  }
}

// Before the runtime checked options on every rank at once, a rank with an invalid one
// returned alone and the others waited at the mesh's first collective until the deadline.
TEST(ShardingOptionsAgreementTest, AnOptionInvalidOnOneRankFailsEveryRankAtOnce) {
  constexpr int kRanks = 4;
  struct Invalid {
    void (*apply)(ShardingOptions&);
    const char* says;
  };
  const Invalid kInvalid[] = {
      {[](ShardingOptions& o) { o.max_grad_norm = -1; }, "max_grad_norm must be >= 0"},
      {[](ShardingOptions& o) { o.max_prefetch_units = -1; }, "max_prefetch_units must be >= 0"},
      {[](ShardingOptions& o) { o.mixed_precision.param_dtype = DType::kI64; },
       "mixed precision dtypes must be f32, bf16 or f16"},
      {[](ShardingOptions& o) {
         o.strategy = ShardingStrategy::kHybridShard;
         o.hybrid_shard_size = 3;  // a mesh that does not fit the world
       },
       "hybrid_shard_size (3) must be >= 1 and divide the world size (4)"},
  };
  for (const Invalid& bad : kInvalid) {
    for (int odd : {0, kRanks / 2, kRanks - 1}) {
      SCOPED_TRACE(absl::StrCat("'", bad.says, "' on rank ", odd));
      const std::vector<RankResult> got = CreateOnRanks(kRanks, [&](int r) {
        ShardingOptions o;
        if (r == odd) bad.apply(o);
        return o;
      });
      for (int r = 0; r < kRanks; ++r) {
        const absl::Status& s = got[r].status;
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << s;
        EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("rank ", odd, ": ")))
            << "rank " << r;
        EXPECT_THAT(s.message(), HasSubstr(bad.says)) << "rank " << r;
        EXPECT_LT(got[r].seconds, absl::ToDoubleSeconds(kDeadline) / 2)
            << "rank " << r << " waited for a deadline: " << s;
      }
    }
  }
}

}  // namespace
}  // namespace fsdp
