// The PJRT backend on the XLA CPU plugin ($FSDP_PJRT_PLUGIN; skipped with the reason when it is
// absent): plugin loading and its errors, devices, host <-> device copies of several dtypes,
// views, streams and events, the compile cache, and the data plane's collectives on 1 to 4
// devices with ranks as threads, against results computed on the host.
#include "fsdp/pjrt_backend.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <fstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/pjrt/stablehlo.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/data_plane.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/local_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/ops.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

std::string PluginPath() {
  const char* p = std::getenv(pjrt::kPluginEnv);
  return p == nullptr ? "" : p;
}

#define SKIP_WITHOUT_PLUGIN()                                                 \
  do {                                                                        \
    if (PluginPath().empty() || !std::filesystem::exists(PluginPath())) {     \
      GTEST_SKIP() << "no PJRT plugin at $FSDP_PJRT_PLUGIN='" << PluginPath() \
                   << "': run scripts/fetch_pjrt_plugin.sh <build dir>/pjrt"  \
                   << " or point the variable at a plugin";                   \
    }                                                                         \
  } while (0)

absl::StatusOr<std::shared_ptr<pjrt::Client>> CpuClient(int devices) {
  pjrt::PjrtClientOptions o;
  o.create_options["cpu_device_count"] = int64_t{devices};
  return pjrt::Client::Create(o);
}

// The backend of the only device of a fresh one-device client (the backend keeps the client).
absl::StatusOr<std::unique_ptr<PjrtBackend>> OneDeviceBackend() {
  FSDP_ASSIGN_OR_RETURN(std::shared_ptr<pjrt::Client> c, CpuClient(1));
  return PjrtBackend::Create(std::move(c), 0);
}

// The quantization programs give the CPU kernels' codes, scales and decoded values bit for bit
// (int8 and fp8; a shard whose last block is short, an all-zero block, a block with a NaN, a
// block of subnormal fp8 codes; f32 and bf16 outputs).
TEST(PjrtOps, BlockQuantizationIsTheCpuKernelsBitForBit) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::unique_ptr<PjrtBackend>> b = OneDeviceBackend();
  ASSERT_TRUE(b.ok()) << b.status();
  constexpr int64_t kN = 300, kBlock = 64;
  const int64_t blocks = (kN + kBlock - 1) / kBlock;
  std::vector<float> x(kN);
  for (int64_t i = 0; i < kN; ++i) {
    x[i] = std::ldexp(std::sin(0.37f * static_cast<float>(i) + 0.1f), static_cast<int>(i / 16) % 9 - 4);
  }
  for (int64_t i = 64; i < 128; ++i) x[i] = 0.0f;                  // block 1: zeros
  x[150] = std::nanf("");                                          // block 2: poisoned
  x[192] = 1000.0f;                                                // block 3: tiny values subnormal in fp8
  for (WireFormat format : {WireFormat::kInt8, WireFormat::kFp8E4M3}) {
    for (DType out_dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(absl::StrCat(std::string(WireFormatName(format)), " ",
                                std::string(DTypeName(out_dtype))));
      std::vector<uint8_t> want_codes(kN);
      std::vector<float> want_scales(blocks);
      kernels::cpu::quantize_blocks(want_codes.data(), want_scales.data(), x.data(), kN, kBlock,
                                    format);
      std::vector<uint16_t> want_out(kN * 2);
      kernels::cpu::dequantize_blocks(want_out.data(), out_dtype, want_codes.data(),
                                      want_scales.data(), kN, kBlock, format);
      auto in = Buffer::Create(b->get(), kN * 4);
      auto codes = Buffer::Create(b->get(), kN);
      auto scales = Buffer::Create(b->get(), blocks * 4);
      auto out = Buffer::Create(b->get(), kN * 4);
      ASSERT_TRUE(in.ok() && codes.ok() && scales.ok() && out.ok());
      ASSERT_TRUE((*b)->CopyFromHost(in->view(), x.data()).ok());
      RuntimeOps& ops = (*b)->runtime_ops();
      ASSERT_TRUE(ops.supports_wire_format(format));
      ops.QuantizeBlocks(Stream::kCompute, codes->view(DType::kU8), scales->view(), in->view(),
                         kBlock, format);
      const View o = out->view(out_dtype).Slice(0, kN);
      ops.DequantizeBlocks(Stream::kCompute, o, codes->view(DType::kU8), scales->view(), kBlock,
                           format);
      std::vector<uint8_t> got_codes(kN);
      std::vector<float> got_scales(blocks);
      std::vector<uint16_t> got_out(kN * 2);
      ASSERT_TRUE((*b)->CopyToHost(got_codes.data(), codes->view(DType::kU8)).ok());
      ASSERT_TRUE((*b)->CopyToHost(got_scales.data(), scales->view()).ok());
      ASSERT_TRUE((*b)->CopyToHost(got_out.data(), o).ok());
      for (int64_t i = 0; i < kN; ++i) {
        ASSERT_EQ(got_codes[i], want_codes[i]) << "code " << i << " of x = " << x[i];
      }
      for (int64_t k = 0; k < blocks; ++k) {
        EXPECT_EQ(std::memcmp(&got_scales[k], &want_scales[k], 4), 0)
            << "scale " << k << ": " << got_scales[k] << " vs " << want_scales[k];
      }
      const size_t bytes = static_cast<size_t>(kN) * DTypeSize(out_dtype);
      for (size_t i = 0; i < bytes; i += DTypeSize(out_dtype)) {
        const bool nan_block = i / DTypeSize(out_dtype) / kBlock == 2;
        if (nan_block) continue;  // NaN payloads may differ; NaN-ness is checked below
        ASSERT_EQ(std::memcmp(reinterpret_cast<char*>(got_out.data()) + i,
                              reinterpret_cast<char*>(want_out.data()) + i, DTypeSize(out_dtype)),
                  0)
            << "decoded " << i / DTypeSize(out_dtype);
      }
      if (out_dtype == DType::kF32) {
        const float* f = reinterpret_cast<const float*>(got_out.data());
        for (int64_t i = 128; i < 192; ++i) EXPECT_TRUE(std::isnan(f[i])) << i;
      }
    }
  }
}

TEST(PjrtPlugin, MissingPathIsAClearError) {
  pjrt::PjrtClientOptions o;
  o.plugin_path = "/nonexistent/dir/libnot_there.so";
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = pjrt::Client::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("/nonexistent/dir/libnot_there.so"));
  EXPECT_THAT(c.status().message(), HasSubstr("FSDP_PJRT_PLUGIN"));
}

TEST(PjrtPlugin, NoPluginGivenIsAClearError) {
  const std::string saved = PluginPath();
  unsetenv(pjrt::kPluginEnv);
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = pjrt::Client::Create({});
  if (!saved.empty()) setenv(pjrt::kPluginEnv, saved.c_str(), 1);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("FSDP_PJRT_PLUGIN"));
}

TEST(PjrtPlugin, FileThatIsNotALibraryIsAClearError) {
  const std::string path = ::testing::TempDir() + "/not_a_plugin.so";
  std::ofstream(path) << "this is not a shared library\n";
  pjrt::PjrtClientOptions o;
  o.plugin_path = path;
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = pjrt::Client::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(), HasSubstr("could not load PJRT plugin"));
  EXPECT_THAT(c.status().message(), HasSubstr(path));
}

TEST(PjrtPlugin, LibraryWithoutGetPjrtApiIsAClearError) {
  std::string libm;
  for (const char* p : {"/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6",
                        "/lib64/libm.so.6", "/usr/lib64/libm.so.6"}) {
    if (std::filesystem::exists(p)) libm = p;
  }
  if (libm.empty())
    GTEST_SKIP() << "no libm.so.6 found to stand in for a library that is not a plugin";
  pjrt::PjrtClientOptions o;
  o.plugin_path = libm;
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = pjrt::Client::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("not a PJRT plugin"));
}

TEST(PjrtPlugin, CpuPluginMakesTheDevicesAskedFor) {
  SKIP_WITHOUT_PLUGIN();
  for (int n = 1; n <= 4; ++n) {
    absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(n);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ((*c)->num_devices(), n);
    EXPECT_EQ((*c)->platform_name(), "cpu");
    EXPECT_EQ((*c)->plugin().major_version(), 0);
    for (int d = 0; d < n; ++d) EXPECT_EQ((*c)->device_id(d), d) << (*c)->device_description(d);
  }
}

TEST(PjrtPlugin, PluginErrorsBecomeStatus) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(1);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<const pjrt::Executable*> e =
      (*c)->Compile("broken", "module @broken { this is not MLIR }", pjrt::CompileOptions({0}));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().code(), absl::StatusCode::kOk);
  EXPECT_THAT(e.status().message(), HasSubstr("compile of 'broken'"));
  // Empty options would abort inside some plugins: refused before the plugin sees them.
  e = (*c)->Compile("add", pjrt::SliceProgram(8, 4), "");
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(), HasSubstr("empty compile options"));
  // A bad device index.
  absl::StatusOr<std::unique_ptr<PjrtBackend>> b = PjrtBackend::Create(*c, 3);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(b.status().message(), HasSubstr("device 3 does not exist"));
}

TEST(PjrtCompile, SameProgramCompiledOnce) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(2);
  ASSERT_TRUE(c.ok()) << c.status();
  pjrt::Client& client = **c;
  const int64_t before = client.compile_count();
  absl::StatusOr<const pjrt::Executable*> a =
      client.Compile("slice", pjrt::SliceProgram(64, 16), pjrt::CompileOptions({0}));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<const pjrt::Executable*> b =
      client.Compile("slice", pjrt::SliceProgram(64, 16), pjrt::CompileOptions({0}));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(client.compile_count(), before + 1);
  // Another shape, or another device, is another program.
  ASSERT_TRUE(client.Compile("slice", pjrt::SliceProgram(64, 8), pjrt::CompileOptions({0})).ok());
  ASSERT_TRUE(client.Compile("slice", pjrt::SliceProgram(64, 16), pjrt::CompileOptions({1})).ok());
  EXPECT_EQ(client.compile_count(), before + 3);

  // Through the backend: reading the same slice again compiles nothing.
  absl::StatusOr<std::unique_ptr<PjrtBackend>> be = PjrtBackend::Create(*c, 0);
  ASSERT_TRUE(be.ok()) << be.status();
  absl::StatusOr<Buffer> buf = Buffer::Create(be->get(), 256);
  ASSERT_TRUE(buf.ok()) << buf.status();
  float out[8];
  ASSERT_TRUE((*be)->CopyToHost(out, buf->view().Slice(4, 8)).ok());
  const int64_t after_first = client.compile_count();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*be)->CopyToHost(out, buf->view().Slice(8 + i, 8)).ok());
  EXPECT_EQ(client.compile_count(), after_first);
  std::printf("compiles: %lld programs in %.3f s\n", static_cast<long long>(client.compile_count()),
              client.compile_seconds());
}

template <typename T>
std::vector<char> AsBytes(const std::vector<T>& v) {
  std::vector<char> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST(PjrtBuffers, RoundTripOfSeveralDtypes) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::unique_ptr<PjrtBackend>> be = OneDeviceBackend();
  ASSERT_TRUE(be.ok()) << be.status();
  Backend& b = **be;
  EXPECT_FALSE(b.is_host());
  EXPECT_EQ(b.name(), "pjrt");
  const int64_t n = 37;
  std::vector<float> f32(n);
  std::vector<uint16_t> bf16(n), f16(n);
  std::vector<int32_t> i32(n);
  std::vector<int64_t> i64(n);
  std::vector<double> f64(n);
  std::vector<uint8_t> u8(n);
  for (int64_t i = 0; i < n; ++i) {
    f32[i] = 0.25f * static_cast<float>(i) - 3.0f;
    bf16[i] = FloatToBf16(f32[i]);
    f16[i] = FloatToF16(f32[i]);
    i32[i] = static_cast<int32_t>(i * 1000003 - 7);
    i64[i] = (int64_t{1} << 40) + i;
    f64[i] = 1.0 / (static_cast<double>(i) + 1.0);
    u8[i] = static_cast<uint8_t>(i * 7);
  }
  const std::vector<std::pair<DType, std::vector<char>>> cases = {
      {DType::kF32, AsBytes(f32)}, {DType::kBF16, AsBytes(bf16)}, {DType::kF16, AsBytes(f16)},
      {DType::kI32, AsBytes(i32)}, {DType::kI64, AsBytes(i64)},   {DType::kF64, AsBytes(f64)},
      {DType::kU8, AsBytes(u8)}};
  for (const auto& [dtype, host] : cases) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    absl::StatusOr<Buffer> buf = Buffer::Create(&b, host.size());
    ASSERT_TRUE(buf.ok()) << buf.status();
    View v = buf->view(dtype);
    ASSERT_EQ(v.count, n);
    ASSERT_TRUE(b.CopyFromHost(v, host.data()).ok());
    std::vector<char> back(host.size(), 0);
    ASSERT_TRUE(b.CopyToHost(back.data(), v).ok());
    EXPECT_EQ(back, host);
    // A window: elements [5, 17) written elsewhere, read back alone and in the whole.
    std::vector<char> window(host.begin() + 0, host.begin() + 12 * DTypeSize(dtype));
    ASSERT_TRUE(b.CopyFromHost(v.Slice(5, 12), window.data()).ok());
    std::vector<char> part(window.size());
    ASSERT_TRUE(b.CopyToHost(part.data(), v.Slice(5, 12)).ok());
    EXPECT_EQ(part, window);
    std::vector<char> want = host;
    std::copy(window.begin(), window.end(), want.begin() + 5 * DTypeSize(dtype));
    ASSERT_TRUE(b.CopyToHost(back.data(), v).ok());
    EXPECT_EQ(back, want);
  }
}

// An allocation is an array of the dtype of the first view that reaches it (f32 here). Views
// of another dtype read and write the same bytes: of the same width (i32) as a bitcast slice,
// of another width or off an element's start (u8, bf16 at 2 mod 4) through the array's bytes
// inside the program; copies and memsets too. No program takes the allocation as bytes.
TEST(PjrtBuffers, ViewsOfAnotherDtypeReadAndWriteTheSameBytes) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::unique_ptr<PjrtBackend>> be = OneDeviceBackend();
  ASSERT_TRUE(be.ok()) << be.status();
  PjrtBackend& b = **be;
  const int64_t n = 16;  // f32 elements
  std::vector<float> f(n);
  for (int64_t i = 0; i < n; ++i) f[i] = 1.5f * static_cast<float>(i) - 7.25f;
  std::vector<uint8_t> model(n * 4);  // what the allocation's bytes must be
  std::memcpy(model.data(), f.data(), model.size());
  absl::StatusOr<Buffer> buf = Buffer::Create(&b, n * 4);
  absl::StatusOr<Buffer> other = Buffer::Create(&b, 8 * 4);
  ASSERT_TRUE(buf.ok() && other.ok());
  const View v = buf->view(DType::kF32);
  ASSERT_TRUE(b.CopyFromHost(v, f.data()).ok());  // typed f32 from here on
  const View bytes = buf->view(DType::kU8);
  auto read = [&](const View& w) {
    std::vector<uint8_t> out(static_cast<size_t>(w.bytes()));
    absl::Status s = b.CopyToHost(out.data(), w);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  };
  auto expect = [&](const View& w, const char* what) {
    SCOPED_TRACE(what);
    const std::vector<uint8_t> want(model.begin() + w.offset, model.begin() + w.offset + w.bytes());
    EXPECT_EQ(read(w), want);
  };
  expect(bytes.Slice(3, 13), "u8 at 3");
  expect(bytes.Slice(6, 10).As(DType::kBF16), "bf16 at 6");
  expect(bytes.Slice(8, 12).As(DType::kI32), "i32 at 8");
  // Writes: bytes at an odd offset, i32 elements, a memset of bytes and one of zeros.
  const std::vector<uint8_t> w8 = {1, 2, 3, 4, 5, 6, 7};
  ASSERT_TRUE(b.CopyFromHost(bytes.Slice(5, 7), w8.data()).ok());
  std::copy(w8.begin(), w8.end(), model.begin() + 5);
  const int32_t wi[2] = {-123456789, 987654321};
  ASSERT_TRUE(b.CopyFromHost(bytes.Slice(24, 8).As(DType::kI32), wi).ok());
  std::memcpy(model.data() + 24, wi, 8);
  ASSERT_TRUE(b.Memset(bytes.Slice(33, 5), 0xAB).ok());
  std::fill(model.begin() + 33, model.begin() + 38, 0xAB);
  ASSERT_TRUE(b.Memset(v.Slice(12, 2), 0).ok());
  std::fill(model.begin() + 48, model.begin() + 56, 0);
  // Copies: f32 elements into another allocation typed i32 (bytes of two dtypes), and back
  // within the first at a 2-byte shift (u8 views).
  const View oi = other->view(DType::kI32);
  ASSERT_TRUE(b.Memset(oi, 0).ok());  // typed i32
  ASSERT_TRUE(b.Copy(oi.Slice(2, 4), v.Slice(1, 4)).ok());
  std::vector<uint8_t> other_model(32, 0);
  std::copy(model.begin() + 4, model.begin() + 20, other_model.begin() + 8);
  ASSERT_TRUE(b.Copy(bytes.Slice(58, 6), bytes.Slice(2, 6)).ok());
  std::copy(model.begin() + 2, model.begin() + 8, model.begin() + 58);
  EXPECT_EQ(read(bytes), model);
  EXPECT_EQ(read(other->view(DType::kU8)), other_model);
  ASSERT_TRUE(b.Record(Stream::kCompute).Wait().ok());
  ASSERT_TRUE(b.Record(Stream::kComm).Wait().ok());
  const PjrtLaunchStats st = b.launch_stats();
  std::string names;
  for (const auto& [name, k] : st.byte_programs) absl::StrAppend(&names, name, " x", k, "; ");
  EXPECT_TRUE(st.byte_programs.empty()) << names;
  // An allocation first reached as bytes is bytes: and says so.
  absl::StatusOr<Buffer> raw = Buffer::Create(&b, 12);
  ASSERT_TRUE(raw.ok());
  ASSERT_TRUE(b.Memset(raw->view(DType::kU8).Slice(1, 3), 7).ok());
  ASSERT_TRUE(b.Record(Stream::kCompute).Wait().ok());
  const PjrtLaunchStats st2 = b.launch_stats();
  ASSERT_EQ(st2.byte_programs.size(), 1u);
  EXPECT_THAT(st2.byte_programs.begin()->first, HasSubstr("ui8[12]"));
}

// Every program of a training step takes typed arrays (f32, bf16, i32, f64), no allocation as
// bytes: GPT and Llama, f32 and bf16 parameters, FULL_SHARD on 2 ranks and HYBRID_SHARD 2 x 2
// with bf16 reductions, gradient clipping on.
TEST(PjrtTypedStorage, NoProgramOfATrainingStepTakesBytes) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::shared_ptr<pjrt::Client>> client = CpuClient(4);
  ASSERT_TRUE(client.ok()) << client.status();
  const auto data = nn::TokenDataset::FromText(nn::EmbeddedCorpus());
  struct Case {
    const char* model;
    ShardingStrategy strategy;
    int ranks, hybrid;
    DType param, reduce;
  };
  const Case cases[] = {
      {"nano", ShardingStrategy::kFullShard, 2, 0, DType::kF32, DType::kF32},
      {"nano", ShardingStrategy::kFullShard, 2, 0, DType::kBF16, DType::kF32},
      {"llama-nano", ShardingStrategy::kFullShard, 2, 0, DType::kF32, DType::kF32},
      {"llama-nano", ShardingStrategy::kFullShard, 2, 0, DType::kBF16, DType::kF32},
      {"llama-nano", ShardingStrategy::kHybridShard, 4, 2, DType::kBF16, DType::kBF16}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.model, " ranks ", c.ranks, " hybrid ", c.hybrid, " param ",
                              std::string(DTypeName(c.param)), " reduce ",
                              std::string(DTypeName(c.reduce))));
    absl::StatusOr<nn::ModelConfig> config = nn::ModelConfig::FromName(c.model);
    ASSERT_TRUE(config.ok()) << config.status();
    PjrtLaunchStats stats;
    float loss = 0;
    absl::Status run = LocalWorld::Run(c.ranks, {}, [&](Communicator& world) -> absl::Status {
      FSDP_ASSIGN_OR_RETURN(std::unique_ptr<PjrtBackend> backend,
                            PjrtBackend::Create(*client, world.rank()));
      nn::ShardedModelOptions o;
      o.sharding.strategy = c.strategy;
      o.sharding.hybrid_shard_size = c.hybrid;
      o.sharding.mixed_precision.param_dtype = c.param;
      o.sharding.mixed_precision.reduce_dtype = c.reduce;
      o.batch_size = 2;
      o.seq_len = 16;
      FSDP_ASSIGN_OR_RETURN(auto m, nn::ShardedModel::Create(*config, backend.get(), world, o));
      FSDP_ASSIGN_OR_RETURN(auto loader,
                            nn::DataLoader::Create(&data, {.batch_size = 2, .seq_len = 16,
                                                           .rank = world.rank(),
                                                           .world_size = world.size()}));
      FSDP_RETURN_IF_ERROR(backend->Record(Stream::kCompute).Wait());
      FSDP_RETURN_IF_ERROR(backend->Record(Stream::kComm).Wait());
      const PjrtLaunchStats before = backend->launch_stats();
      for (int step = 0; step < 2; ++step) {
        const nn::Batch batch = loader.Next();
        FSDP_ASSIGN_OR_RETURN(float l, m->ForwardBackward(batch.inputs.data(),
                                                          batch.targets.data()));
        FSDP_RETURN_IF_ERROR(m->Step(1e-3f).status());
        if (world.rank() == 0) loss = l;
      }
      FSDP_RETURN_IF_ERROR(backend->Record(Stream::kCompute).Wait());
      FSDP_RETURN_IF_ERROR(backend->Record(Stream::kComm).Wait());
      if (world.rank() == 0) {
        stats = backend->launch_stats();
        stats.programs -= before.programs;
        for (const auto& [name, k] : before.byte_programs) {
          if ((stats.byte_programs[name] -= k) == 0) stats.byte_programs.erase(name);
        }
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(run.ok()) << run;
    EXPECT_TRUE(std::isfinite(loss));
    EXPECT_GT(stats.programs, 10);
    std::string names;
    for (const auto& [name, k] : stats.byte_programs) absl::StrAppend(&names, name, " x", k, "; ");
    EXPECT_TRUE(stats.byte_programs.empty()) << "programs with byte-array arguments: " << names;
  }
}

TEST(PjrtBuffers, CopyMemsetStatsAndStreams) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::unique_ptr<PjrtBackend>> be = OneDeviceBackend();
  ASSERT_TRUE(be.ok()) << be.status();
  Backend& b = **be;
  const MemoryStats before = b.memory_stats();
  {
    absl::StatusOr<Buffer> x = Buffer::Create(&b, 16 * sizeof(float));
    absl::StatusOr<Buffer> y = Buffer::Create(&b, 16 * sizeof(float));
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_EQ(b.memory_stats().bytes_in_use, before.bytes_in_use + 128);
    EXPECT_EQ(b.memory_stats().num_allocs, before.num_allocs + 2);
    std::vector<float> h(16);
    for (int i = 0; i < 16; ++i) h[i] = static_cast<float>(i + 1);
    // Fresh memory reads as zeros.
    std::vector<float> z(16, -1.0f);
    ASSERT_TRUE(b.CopyToHost(z.data(), y->view()).ok());
    EXPECT_THAT(z, ::testing::Each(0.0f));
    // Compute stream: write x; comm stream: waits for it, then copies x[0:8] to y[8:16] and
    // x[8:16] to x[0:8] (a copy inside one allocation).
    ASSERT_TRUE(b.CopyFromHost(x->view(), h.data(), Stream::kCompute).ok());
    ASSERT_TRUE(b.Wait(Stream::kComm, b.Record(Stream::kCompute)).ok());
    ASSERT_TRUE(b.Copy(y->view().Slice(8, 8), x->view().Slice(0, 8), Stream::kComm).ok());
    ASSERT_TRUE(b.Copy(x->view().Slice(0, 8), x->view().Slice(8, 8), Stream::kComm).ok());
    ASSERT_TRUE(b.Memset(y->view().Slice(0, 4), 0xff, Stream::kComm).ok());
    ASSERT_TRUE(b.Sync(b.Record(Stream::kComm)).ok());
    std::vector<float> gx(16), gy(16);
    ASSERT_TRUE(b.CopyToHost(gx.data(), x->view(), Stream::kComm).ok());
    ASSERT_TRUE(b.CopyToHost(gy.data(), y->view(), Stream::kComm).ok());
    for (int i = 0; i < 8; ++i) EXPECT_EQ(gx[i], h[8 + i]) << i;
    for (int i = 8; i < 16; ++i) EXPECT_EQ(gx[i], h[i]) << i;
    for (int i = 0; i < 4; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &gy[i], 4);
      EXPECT_EQ(bits, 0xffffffffu) << i;
    }
    for (int i = 4; i < 8; ++i) EXPECT_EQ(gy[i], 0.0f) << i;
    for (int i = 8; i < 16; ++i) EXPECT_EQ(gy[i], h[i - 8]) << i;
    EXPECT_GE(b.host_syncs(), 3);
  }
  EXPECT_EQ(b.memory_stats().bytes_in_use, before.bytes_in_use);
  EXPECT_GE(b.memory_stats().peak_bytes, 128);
  // A view that does not fit is refused.
  absl::StatusOr<Buffer> x = Buffer::Create(&b, 16);
  ASSERT_TRUE(x.ok());
  float h[8] = {};
  View bad = x->view();
  bad.count = 8;
  EXPECT_EQ(b.CopyFromHost(bad, h).code(), absl::StatusCode::kInvalidArgument);
}

// A bad view fails the op's stream with an error naming the op and the view; the ops queued
// after it on that stream do not run; the other stream is unaffected.
TEST(PjrtOps, BadViewsFailTheirStreamNamingTheOp) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(1);
  ASSERT_TRUE(c.ok()) << c.status();
  auto cpu = std::move(CpuBackend::Create({.num_threads = 1})).value();
  for (int bad = 0; bad < 2; ++bad) {
    absl::StatusOr<std::unique_ptr<PjrtBackend>> be = PjrtBackend::Create(*c, 0);
    ASSERT_TRUE(be.ok()) << be.status();
    Backend& b = **be;
    absl::StatusOr<Buffer> x = Buffer::Create(&b, 64);
    absl::StatusOr<Buffer> host = Buffer::Create(cpu.get(), 64);
    ASSERT_TRUE(x.ok() && host.ok());
    const std::vector<float> ones(16, 1.0f);
    ASSERT_TRUE(b.CopyFromHost(x->view(), ones.data()).ok());
    View out = x->view();
    if (bad == 0) {
      out = host->view();  // memory of another backend
    } else {
      out.count = 32;  // past the end of its allocation
    }
    b.ops().GeluForward(Stream::kCompute, out, x->view());
    b.ops().Scale(Stream::kCompute, x->view(), 2.0f);  // must not run
    absl::Status s = b.Sync(b.Record(Stream::kCompute));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("gelu_forward"));
    EXPECT_THAT(s.message(), HasSubstr(bad == 0 ? "not memory of this backend" : "does not fit"));
    EXPECT_TRUE(b.Sync(b.Record(Stream::kComm)).ok());  // the other stream is unaffected
    std::vector<float> got(16);
    ASSERT_TRUE(b.CopyToHost(got.data(), x->view(), Stream::kComm).ok());
    EXPECT_EQ(got, ones) << "an op after the failure ran";
  }
}

// The ops issued on a stream between two other items of it run as one program (fuse_ops, the
// default), at most max_fused_ops each; with fuse_ops = false, a program per op. Same values
// either way; device-to-device copies and memsets join the program.
TEST(PjrtOps, OpsBetweenEventsRunAsOneProgram) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(1);
  ASSERT_TRUE(c.ok()) << c.status();
  struct Case {
    bool fuse;
    int max_ops;
    int64_t programs;  // op programs expected
  };
  constexpr int kScales = 10;  // then a copy and a memset: 12 ops
  for (const Case& k : {Case{true, 512, 1}, Case{true, 5, 3}, Case{false, 512, 12}}) {
    SCOPED_TRACE(absl::StrCat("fuse_ops ", k.fuse, ", max_fused_ops ", k.max_ops));
    PjrtBackendOptions o;
    o.fuse_ops = k.fuse;
    o.max_fused_ops = k.max_ops;
    absl::StatusOr<std::unique_ptr<PjrtBackend>> be = PjrtBackend::Create(*c, 0, o);
    ASSERT_TRUE(be.ok()) << be.status();
    PjrtBackend& b = **be;
    absl::StatusOr<Buffer> x = Buffer::Create(&b, 16 * sizeof(float));
    absl::StatusOr<Buffer> y = Buffer::Create(&b, 32 * sizeof(float));
    ASSERT_TRUE(x.ok() && y.ok());
    std::vector<float> v(16);
    for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(i) - 4.5f;
    ASSERT_TRUE(b.CopyFromHost(x->view(), v.data()).ok());
    ASSERT_TRUE(b.Sync(b.Record(Stream::kCompute)).ok());
    const PjrtLaunchStats before = b.launch_stats();
    for (int i = 0; i < kScales; ++i) b.ops().Scale(Stream::kCompute, x->view(), 1.5f);
    ASSERT_TRUE(b.Copy(y->view().Slice(8, 16), x->view()).ok());
    ASSERT_TRUE(b.Memset(y->view().Slice(0, 8), 0).ok());
    EXPECT_EQ(b.launch_stats().op_programs, before.op_programs)
        << "ops ran before anything else was issued on the stream";
    ASSERT_TRUE(b.Sync(b.Record(Stream::kCompute)).ok());
    const PjrtLaunchStats after = b.launch_stats();
    EXPECT_EQ(after.op_programs - before.op_programs, k.programs);
    EXPECT_EQ(after.ops - before.ops, kScales + 2);
    EXPECT_EQ(after.programs - before.programs, k.programs);
    std::vector<float> got(32);
    ASSERT_TRUE(b.CopyToHost(got.data(), y->view()).ok());
    for (int i = 0; i < 16; ++i) {
      float want = v[i];
      for (int r = 0; r < kScales; ++r) want *= 1.5f;
      EXPECT_EQ(got[8 + i], want) << i;
    }
    for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i], 0.0f) << i;
    for (int i = 24; i < 32; ++i) EXPECT_EQ(got[i], 0.0f) << i;
  }
  PjrtBackendOptions bad;
  bad.max_fused_ops = 0;
  absl::StatusOr<std::unique_ptr<PjrtBackend>> refused = PjrtBackend::Create(*c, 0, bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("max_fused_ops"));
}

// PjrtBackendOptions::profile: every launch of each program is counted and timed, fused or
// not; without it nothing is recorded.
TEST(PjrtOps, ProfileTimesEachProgram) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(1);
  ASSERT_TRUE(c.ok()) << c.status();
  struct Case {
    bool profile, fuse;
    std::map<std::string, int64_t> launches;  // expected
  };
  for (const Case& k : {Case{true, false, {{"scale", 3}, {"memset", 1}}},
                        Case{true, true, {{"ops_scale_memset", 1}}}, Case{false, false, {}}}) {
    SCOPED_TRACE(absl::StrCat("profile ", k.profile, ", fuse_ops ", k.fuse));
    PjrtBackendOptions o;
    o.profile = k.profile;
    o.fuse_ops = k.fuse;
    absl::StatusOr<std::unique_ptr<PjrtBackend>> be = PjrtBackend::Create(*c, 0, o);
    ASSERT_TRUE(be.ok()) << be.status();
    PjrtBackend& b = **be;
    absl::StatusOr<Buffer> x = Buffer::Create(&b, 1024 * sizeof(float));
    ASSERT_TRUE(x.ok());
    ASSERT_TRUE(b.Sync(b.Record(Stream::kCompute)).ok());
    const PjrtLaunchStats before = b.launch_stats();
    for (int i = 0; i < 3; ++i) b.ops().Scale(Stream::kCompute, x->view(), 2.0f);
    ASSERT_TRUE(b.Memset(x->view().Slice(0, 8), 0).ok());
    ASSERT_TRUE(b.Sync(b.Record(Stream::kCompute)).ok());
    const PjrtLaunchStats after = b.launch_stats();
    std::map<std::string, int64_t> got;
    for (const auto& [name, t] : after.program_time) {
      const auto it = before.program_time.find(name);
      const int64_t n = t.launches - (it == before.program_time.end() ? 0 : it->second.launches);
      if (n == 0) continue;
      got[name] = n;
      EXPECT_GT(t.seconds, 0.0) << name;
    }
    EXPECT_EQ(got, k.launches);
  }
}

// An optimizer's stream: AdamW of each "tensor" (a slice of the unit's flat parameter,
// gradient and moment arrays), then the gradient zeroed whole, as the runtime issues them. XLA
// updates the arrays in place: the program needs no temporary memory the size of an array (a
// copy of one). Fused into one program and a program per op (also without the CPU plugin's
// region-analysis copy insertion, which the backend turns on: AdamW's own program then must not
// read the moments it has updated); the values match the CPU backend's.
TEST(PjrtOps, UpdatesInPlaceNeedNoTemporaryCopyOfAnArray) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(1);
  ASSERT_TRUE(c.ok()) << c.status();
  constexpr int64_t kN = 1 << 16, kTensors = 8, kBytes = kN * sizeof(float);
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create({.num_threads = 1});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<std::vector<float>> init(4, std::vector<float>(kN));  // param, grad, m, v
  for (int64_t i = 0; i < kN; ++i) {
    init[0][i] = std::sin(0.01f * static_cast<float>(i));
    init[1][i] = std::cos(0.03f * static_cast<float>(i));
    init[2][i] = 0.01f * std::sin(0.7f * static_cast<float>(i));
    init[3][i] = 0.001f + 0.001f * std::cos(0.2f * static_cast<float>(i));
  }
  const AdamWScalars k = AdamWStepScalars(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 3);
  // Runs the stream on `b`; returns the four arrays after it.
  auto run = [&](Backend& b) -> std::vector<std::vector<float>> {
    std::vector<Buffer> arrays;
    for (int a = 0; a < 4; ++a) {
      absl::StatusOr<Buffer> x = Buffer::Create(&b, kBytes);
      EXPECT_TRUE(x.ok()) << x.status();
      if (!x.ok()) return {};
      EXPECT_TRUE(b.CopyFromHost(x->view(), init[a].data()).ok());
      arrays.push_back(std::move(*x));
    }
    EXPECT_TRUE(b.Sync(b.Record(Stream::kCompute)).ok());
    for (int64_t t = 0; t < kTensors; ++t) {
      auto part = [&](int a) { return arrays[a].view().Slice(t * kN / kTensors, kN / kTensors); };
      b.ops().AdamW(Stream::kCompute, part(0), part(1), part(2), part(3), k);
    }
    EXPECT_TRUE(b.Memset(arrays[1].view(), 0).ok());
    EXPECT_TRUE(b.Sync(b.Record(Stream::kCompute)).ok());
    std::vector<std::vector<float>> out(4, std::vector<float>(kN));
    for (int a = 0; a < 4; ++a) EXPECT_TRUE(b.CopyToHost(out[a].data(), arrays[a].view()).ok());
    return out;
  };
  (*cpu)->BindCurrentThread();
  const std::vector<std::vector<float>> want = run(**cpu);
  struct Case {
    bool fuse, region_analysis;
  };
  for (const Case& cs : {Case{true, true}, Case{false, true}, Case{false, false}}) {
    SCOPED_TRACE(absl::StrCat("fuse_ops ", cs.fuse, ", region analysis ", cs.region_analysis));
    PjrtBackendOptions o;
    o.fuse_ops = cs.fuse;
    if (!cs.region_analysis) o.xla_options = {{"xla_cpu_copy_insertion_use_region_analysis", false}};
    absl::StatusOr<std::unique_ptr<PjrtBackend>> be = PjrtBackend::Create(*c, 0, o);
    ASSERT_TRUE(be.ok()) << be.status();
    const std::vector<std::vector<float>> got = run(**be);
    ASSERT_EQ(got.size(), 4u);
    for (int a = 0; a < 4; ++a) {
      for (int64_t i = 0; i < kN; i += 97) {
        EXPECT_NEAR(got[a][i], want[a][i], 1e-6f + 1e-5f * std::fabs(want[a][i]))
            << "array " << a << " element " << i;
      }
    }
    const PjrtLaunchStats stats = (*be)->launch_stats();
    int checked = 0;
    for (const auto& [name, temp] : stats.temp_bytes) {
      if (name.find("adamw") == std::string::npos) continue;
      ++checked;
      EXPECT_LT(temp, kBytes) << name << " takes " << temp
                              << " bytes of temporary memory: a copy of an array of " << kBytes;
    }
    EXPECT_GT(checked, 0) << "no AdamW program reported its temporary memory";
  }
}

// An XLA option the plugin does not know fails the stream's first program, naming the option.
TEST(PjrtOps, UnknownXlaOptionIsAClearError) {
  SKIP_WITHOUT_PLUGIN();
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(1);
  ASSERT_TRUE(c.ok()) << c.status();
  PjrtBackendOptions o;
  o.xla_options = {{"xla_no_such_option", true}};
  absl::StatusOr<std::unique_ptr<PjrtBackend>> be = PjrtBackend::Create(*c, 0, o);
  ASSERT_TRUE(be.ok()) << be.status();
  absl::StatusOr<Buffer> x = Buffer::Create(be->get(), 64);
  ASSERT_TRUE(x.ok()) << x.status();
  (*be)->ops().Scale(Stream::kCompute, x->view(), 2.0f);
  const absl::Status s = (*be)->Sync((*be)->Record(Stream::kCompute));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("xla_no_such_option"));
}

// ---- the data plane: ranks as threads, one device each ------------------------------------

float Round(float v, DType d) {
  switch (d) {
    case DType::kBF16:
      return Bf16ToFloat(FloatToBf16(v));
    case DType::kF16:
      return F16ToFloat(FloatToF16(v));
    default:
      return v;
  }
}
std::vector<char> Encode(const std::vector<float>& v, DType d) {
  std::vector<char> out(v.size() * DTypeSize(d));
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == DType::kF32) {
      std::memcpy(&out[4 * i], &v[i], 4);
    } else {
      const uint16_t h = d == DType::kBF16 ? FloatToBf16(v[i]) : FloatToF16(v[i]);
      std::memcpy(&out[2 * i], &h, 2);
    }
  }
  return out;
}
std::vector<float> Decode(const std::vector<char>& b, DType d) {
  const size_t n = b.size() / DTypeSize(d);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (d == DType::kF32) {
      std::memcpy(&out[i], &b[4 * i], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &b[2 * i], 2);
      out[i] = d == DType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h);
    }
  }
  return out;
}
// Rank r's input element i: small multiples of 1/4, exact in every dtype, sums exact in f32.
float Input(int r, int64_t i) {
  return 0.25f * static_cast<float>(((i * 7 + r * 3) % 11) - 5) * static_cast<float>(r + 1);
}
float Reduce(int n, int64_t i, ReduceOp op, DType d) {
  float acc = op == ReduceOp::kMax ? Round(Input(0, i), d) : 0.0f;
  for (int r = 0; r < n; ++r) {
    const float v = Round(Input(r, i), d);
    acc = op == ReduceOp::kMax ? std::max(acc, v) : acc + v;
  }
  if (op == ReduceOp::kAvg) acc /= static_cast<float>(n);
  return Round(acc, d);
}

// Sums and maxima are exact (the inputs make every f32 sum exact); an average may differ from
// the host's division by the group size in the last place (the compiler may multiply by the
// reciprocal), so it is held to the relative tolerance of the op conformance suite.
void ExpectReduced(const std::vector<float>& got, const std::vector<float>& want, ReduceOp op,
                   DType d, const std::string& what) {
  if (op != ReduceOp::kAvg) {
    EXPECT_EQ(got, want) << what;
    return;
  }
  const float tol = d == DType::kF32 ? 1e-5f : d == DType::kF16 ? 2e-3f : 1e-2f;
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tol * std::max(1.0f, std::abs(want[i])))
        << what << " [" << i << "]";
  }
}

// Runs fn(rank, backend, plane) on n threads sharing one client of n devices.
void RunRanks(int n, const std::function<void(int, PjrtBackend&, DataPlane&)>& fn,
              PjrtBackendOptions options = {}) {
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(n);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<std::unique_ptr<LocalWorld>> world = LocalWorld::Create(n);
  ASSERT_TRUE(world.ok()) << world.status();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<Communicator>> comm = (*world)->TakeRank(r);
      ASSERT_TRUE(comm.ok()) << comm.status();
      absl::StatusOr<std::unique_ptr<PjrtBackend>> be = PjrtBackend::Create(*c, r, options);
      ASSERT_TRUE(be.ok()) << be.status();
      absl::StatusOr<std::unique_ptr<DataPlane>> plane = (*be)->CreateDataPlane(**comm);
      ASSERT_TRUE(plane.ok()) << plane.status();
      fn(r, **be, **plane);
    });
  }
  for (auto& t : threads) t.join();
  std::printf("%d device(s): %lld programs compiled in %.2f s\n", n,
              static_cast<long long>((*c)->compile_count()), (*c)->compile_seconds());
}

constexpr int64_t kCount = 6;  // elements per rank

class PjrtDataPlaneTest : public ::testing::TestWithParam<int> {};

TEST_P(PjrtDataPlaneTest, CollectivesMatchTheHost) {
  SKIP_WITHOUT_PLUGIN();
  const int n = GetParam();
  RunRanks(n, [n](int r, PjrtBackend& b, DataPlane& plane) {
    EXPECT_EQ(plane.size(), n);
    EXPECT_EQ(plane.rank(), r);
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
      const size_t es = DTypeSize(d);
      auto upload = [&](const std::vector<float>& v) {
        absl::StatusOr<Buffer> buf = Buffer::Create(&b, v.size() * es);
        EXPECT_TRUE(buf.ok()) << buf.status();
        const std::vector<char> bytes = Encode(v, d);
        EXPECT_TRUE(b.CopyFromHost(buf->view(d), bytes.data()).ok());
        return std::move(*buf);
      };
      auto download = [&](const View& v) {
        std::vector<char> bytes(static_cast<size_t>(v.bytes()));
        EXPECT_TRUE(b.CopyToHost(bytes.data(), v).ok());
        return Decode(bytes, d);
      };
      auto wait = [&](absl::StatusOr<Event> e) {
        ASSERT_TRUE(e.ok()) << e.status();
        ASSERT_TRUE(b.Wait(Stream::kCompute, *e).ok());
      };
      for (bool in_place : {false, true}) {
        const std::string where =
            absl::StrCat(std::string(DTypeName(d)), in_place ? " in place" : "");
        // all_gather: kCount per rank -> n * kCount.
        {
          std::vector<float> mine(kCount), want(n * kCount);
          for (int64_t i = 0; i < kCount; ++i) mine[i] = Input(r, i);
          for (int q = 0; q < n; ++q)
            for (int64_t i = 0; i < kCount; ++i) want[q * kCount + i] = Round(Input(q, i), d);
          Buffer recv, send;
          View sv, rv;
          if (in_place) {  // send = recv + rank * count
            std::vector<float> init(n * kCount, 9.0f);
            std::copy(mine.begin(), mine.end(), init.begin() + r * kCount);
            recv = upload(init);
            rv = recv.view(d);
            sv = rv.Slice(r * kCount, kCount);
          } else {
            send = upload(mine);
            recv = upload(std::vector<float>(n * kCount, 9.0f));
            sv = send.view(d);
            rv = recv.view(d);
          }
          wait(plane.AllGather(sv, rv));
          EXPECT_EQ(download(rv), want) << "all_gather " << where;
        }
        // all_to_all (never in place): chunk q of what rank r gets is chunk r of rank q's send;
        // into a window of a larger buffer.
        if (!in_place) {
          std::vector<float> mine(n * kCount), want(n * kCount);
          for (int64_t i = 0; i < n * kCount; ++i) mine[i] = Input(r, i);
          for (int q = 0; q < n; ++q)
            for (int64_t i = 0; i < kCount; ++i)
              want[q * kCount + i] = Round(Input(q, r * kCount + i), d);
          Buffer send = upload(mine), recv = upload(std::vector<float>(n * kCount + 2, 9.0f));
          const View rv = recv.view(d).Slice(1, n * kCount);
          wait(plane.AllToAll(send.view(d), rv));
          EXPECT_EQ(download(rv), want) << "all_to_all " << where;
          const std::vector<float> all = download(recv.view(d));
          EXPECT_EQ(all[0], 9.0f);
          EXPECT_EQ(all[n * kCount + 1], 9.0f) << "all_to_all wrote outside its view";
        }
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          const std::string what = absl::StrCat(std::string(ReduceOpName(op)), " ", where);
          // reduce_scatter: n * kCount -> kCount (this rank's chunk).
          {
            std::vector<float> mine(n * kCount), want(kCount);
            for (int64_t i = 0; i < n * kCount; ++i) mine[i] = Input(r, i);
            for (int64_t i = 0; i < kCount; ++i) want[i] = Reduce(n, r * kCount + i, op, d);
            Buffer send = upload(mine), recv;
            View sv = send.view(d), rv;
            if (in_place) {  // recv = send + rank * count
              rv = sv.Slice(r * kCount, kCount);
            } else {
              recv = upload(std::vector<float>(kCount, 9.0f));
              rv = recv.view(d);
            }
            wait(plane.ReduceScatter(sv, rv, op));
            ExpectReduced(download(rv), want, op, d, "reduce_scatter " + what);
          }
          // all_reduce, on a window of a larger buffer when not in place.
          {
            const int64_t m = 10;
            std::vector<float> mine(m), want(m);
            for (int64_t i = 0; i < m; ++i) {
              mine[i] = Input(r, i);
              want[i] = Reduce(n, i, op, d);
            }
            Buffer send = upload(mine), recv;
            View sv = send.view(d), rv;
            if (in_place) {
              rv = sv;
            } else {
              recv = upload(std::vector<float>(m + 3, 9.0f));
              rv = recv.view(d).Slice(2, m);
            }
            wait(plane.AllReduce(sv, rv, op));
            ExpectReduced(download(rv), want, op, d, "all_reduce " + what);
            if (!in_place) {
              const std::vector<float> all = download(recv.view(d));
              EXPECT_EQ(all[0], 9.0f);
              EXPECT_EQ(all[1], 9.0f);
              EXPECT_EQ(all[m + 2], 9.0f) << "all_reduce wrote outside its view";
            }
          }
        }
      }
    }
  });
}

TEST_P(PjrtDataPlaneTest, EachCollectiveProgramIsCompiledOnceForAllRanks) {
  SKIP_WITHOUT_PLUGIN();
  const int n = GetParam();
  absl::StatusOr<std::shared_ptr<pjrt::Client>> c = CpuClient(n);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<std::unique_ptr<LocalWorld>> world = LocalWorld::Create(n);
  ASSERT_TRUE(world.ok());
  std::vector<double> median_us(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<Communicator>> comm = (*world)->TakeRank(r);
      ASSERT_TRUE(comm.ok());
      absl::StatusOr<std::unique_ptr<PjrtBackend>> be = PjrtBackend::Create(*c, r);
      ASSERT_TRUE(be.ok());
      absl::StatusOr<std::unique_ptr<DataPlane>> plane = (*be)->CreateDataPlane(**comm);
      ASSERT_TRUE(plane.ok());
      absl::StatusOr<Buffer> x = Buffer::Create(be->get(), 1024 * sizeof(float));
      ASSERT_TRUE(x.ok());
      std::vector<double> us;
      for (int it = 0; it < 30; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        absl::StatusOr<Event> e = (*plane)->AllReduce(x->view(), x->view(), ReduceOp::kSum);
        ASSERT_TRUE(e.ok());
        ASSERT_TRUE((*be)->Sync(*e).ok());
        us.push_back(
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count());
      }
      std::sort(us.begin() + 1, us.end());
      median_us[r] = us[1 + (us.size() - 1) / 2];
    });
  }
  for (auto& t : threads) t.join();
  // 30 calls on every rank: one collective program for all of them.
  EXPECT_EQ((*c)->compile_count(), 1);
  std::printf(
      "all_reduce f32[1024] in place on %d device(s): median %.0f us per call "
      "(issue to host sync, after the first)\n",
      n, median_us[0]);
}

TEST_P(PjrtDataPlaneTest, DifferentCallsOnTheRanksFailOnEveryRank) {
  SKIP_WITHOUT_PLUGIN();
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  RunRanks(n, [](int r, PjrtBackend& b, DataPlane& plane) {
    absl::StatusOr<Buffer> x = Buffer::Create(&b, 64 * sizeof(float));
    ASSERT_TRUE(x.ok());
    const int64_t count = r == 0 ? 16 : 32;
    absl::StatusOr<Event> e =
        plane.AllReduce(x->view().Slice(0, count), x->view().Slice(0, count), ReduceOp::kSum);
    ASSERT_TRUE(e.ok());
    absl::Status s = b.Sync(*e);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("schedule mismatch at sequence 0 of group"));
    EXPECT_THAT(s.message(), HasSubstr("ranks [0] called all_reduce(count=16, f32, sum)"));
    // The group has failed: a later, matching call fails too.
    e = plane.AllReduce(x->view(), x->view(), ReduceOp::kSum);
    ASSERT_TRUE(e.ok());
    EXPECT_FALSE(b.Sync(*e).ok());
  });
}

TEST_P(PjrtDataPlaneTest, AMissingRankIsADeadlineErrorNotAHang) {
  SKIP_WITHOUT_PLUGIN();
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  PjrtBackendOptions options;
  options.data_plane.timeout = absl::Milliseconds(500);
  RunRanks(
      n,
      [](int r, PjrtBackend& b, DataPlane& plane) {
        if (r == 1) return;  // never comes
        absl::StatusOr<Buffer> x = Buffer::Create(&b, 16 * sizeof(float));
        ASSERT_TRUE(x.ok());
        absl::StatusOr<Event> e = plane.AllReduce(x->view(), x->view(), ReduceOp::kSum);
        ASSERT_TRUE(e.ok());
        absl::Status s = b.Sync(*e);
        EXPECT_FALSE(s.ok());
        EXPECT_THAT(s.ToString(), ::testing::AnyOf(HasSubstr("DEADLINE_EXCEEDED"),
                                                   HasSubstr("ABORTED"), HasSubstr("rank 1")))
            << s;
        std::printf("rank %d: %s\n", r, s.ToString().c_str());
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Devices, PjrtDataPlaneTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return absl::StrCat(i.param, "dev");
                         });

}  // namespace
}  // namespace fsdp
