// The C API (include/fsdp/c_api.h) over the C++ one. Every entry point checks its handles
// against the table of live handles before touching them, turns absl::Status into an
// fsdp_error, and catches whatever C++ throws (std::bad_alloc), so nothing crosses the C
// boundary but a return value.
#include "fsdp/c_api.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "fsdp/agreement.h"
#include "fsdp/backend.h"
#include "fsdp/checkpoint.h"
#include "fsdp/local_world.h"
#include "fsdp/mesh.h"
#include "fsdp/mpi_world.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/plan.h"
#include "fsdp/registry.h"
#include "fsdp/sharding.h"

#ifndef FSDP_PROJECT_VERSION
#define FSDP_PROJECT_VERSION "unknown"
#define FSDP_C_API_SOVERSION FSDP_C_API_VERSION_MAJOR
#define FSDP_C_API_SOMINOR FSDP_C_API_VERSION_MINOR
#endif

struct fsdp_error {
  fsdp_code code;
  std::string message;
};

struct fsdp_world {
  std::unique_ptr<fsdp::Communicator> owned;
  fsdp::Communicator* comm = nullptr;
  bool borrowed = false;          // handed to an fsdp_run_threads body: not the caller's
  std::atomic<int> runtimes{0};   // runtimes made over it and alive
  std::atomic<bool> released{false};
};

struct fsdp_backend {
  std::unique_ptr<fsdp::Backend> backend;
  std::atomic<int> runtimes{0};
  std::atomic<bool> released{false};
};

struct fsdp_runtime {
  std::unique_ptr<fsdp::ShardingRuntime> runtime;  // empty when a model owns it
  fsdp::ShardingRuntime* rt = nullptr;
  fsdp_world* world = nullptr;
  fsdp_backend* backend = nullptr;
  bool borrowed = false;  // a model's (fsdp_model_runtime): the model destroys it
};

struct fsdp_model {
  std::unique_ptr<fsdp::nn::ShardedModel> model;
  fsdp_runtime* runtime = nullptr;  // borrowed handle of the model's runtime
  fsdp_world* world = nullptr;
  fsdp_backend* backend = nullptr;
};

struct fsdp_thread_group {
  std::unique_ptr<fsdp::LocalWorld> world;
  // Or this process's ranks of an mpi_threads world (fsdp_mpi_thread_group_create): world rank
  // first + t is mpi_ranks[t], null once taken.
  std::vector<std::unique_ptr<fsdp::Communicator>> mpi_ranks;
  int first = 0;
  std::mutex mu;
};

namespace {

using fsdp::Communicator;

// ---- live handles ---------------------------------------------------------------------------

enum class Kind : int { kWorld, kBackend, kRuntime, kThreadGroup, kModel };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kWorld: return "fsdp_world";
    case Kind::kBackend: return "fsdp_backend";
    case Kind::kRuntime: return "fsdp_runtime";
    case Kind::kThreadGroup: return "fsdp_thread_group";
    case Kind::kModel: return "fsdp_model";
  }
  return "handle";
}

struct Live {
  std::mutex mu;
  std::unordered_map<const void*, Kind> handles;
};
Live& Handles() {
  static Live* live = new Live;  // never destroyed: handles may be checked during exit
  return *live;
}
void AddHandle(const void* p, Kind k) {
  Live& l = Handles();
  std::lock_guard<std::mutex> lock(l.mu);
  l.handles[p] = k;
}
// Removes `p` if it is a live handle of kind `k`; false otherwise.
bool RemoveHandle(const void* p, Kind k) {
  Live& l = Handles();
  std::lock_guard<std::mutex> lock(l.mu);
  auto it = l.handles.find(p);
  if (it == l.handles.end() || it->second != k) return false;
  l.handles.erase(it);
  return true;
}
absl::Status CheckHandle(const void* p, Kind k, const char* fn, const char* arg) {
  if (p == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": ", arg, " is NULL"));
  }
  Live& l = Handles();
  std::lock_guard<std::mutex> lock(l.mu);
  auto it = l.handles.find(p);
  if (it == l.handles.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": ", arg, " is not a live ", KindName(k),
                     " (destroyed, or never made by the library)"));
  }
  if (it->second != k) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": ", arg, " is an ",
                                                   KindName(it->second), ", not an ",
                                                   KindName(k)));
  }
  return absl::OkStatus();
}

// ---- errors ---------------------------------------------------------------------------------

// Returned when even the error cannot be allocated; fsdp_error_destroy leaves it alone.
fsdp_error kOutOfMemory{FSDP_CODE_RESOURCE_EXHAUSTED, "libfsdp: out of host memory"};

fsdp_error* NewError(fsdp_code code, std::string message) {
  auto* e = new (std::nothrow) fsdp_error{code, {}};
  if (e == nullptr) return &kOutOfMemory;
  try {
    e->message = std::move(message);
  } catch (...) {
    delete e;
    return &kOutOfMemory;
  }
  return e;
}

fsdp_error* ToError(const absl::Status& s) {
  if (s.ok()) return nullptr;
  return NewError(static_cast<fsdp_code>(static_cast<int>(s.code())), std::string(s.message()));
}

absl::Status FromError(const fsdp_error* e) {
  if (e == nullptr) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(e->code), e->message);
}

// Takes over an error a callback returned: its status, and the error destroyed.
absl::Status TakeError(fsdp_error* e) {
  absl::Status s = FromError(e);
  if (e != &kOutOfMemory) delete e;
  return s;
}

// Runs `body` (returning absl::Status) and converts; nothing escapes.
template <typename F>
fsdp_error* Guard(const char* fn, F&& body) {
  try {
    return ToError(body());
  } catch (const std::bad_alloc&) {
    return &kOutOfMemory;
  } catch (const std::exception& e) {
    return NewError(FSDP_CODE_INTERNAL, absl::StrCat(fn, ": ", e.what()));
  } catch (...) {
    return NewError(FSDP_CODE_INTERNAL, absl::StrCat(fn, ": unknown C++ exception"));
  }
}

#define FSDP_CHECK_HANDLE(p, kind, arg) FSDP_RETURN_IF_ERROR(CheckHandle(p, kind, fn, arg))
#define FSDP_CHECK_OUT(p, arg)                                                             \
  do {                                                                                     \
    if ((p) == nullptr) {                                                                  \
      return absl::InvalidArgumentError(absl::StrCat(fn, ": ", arg, " is NULL"));          \
    }                                                                                      \
  } while (0)

// ---- structs that grow ------------------------------------------------------------------------

// The caller's struct of `struct_size` bytes over the defaults `init` sets: fields beyond it
// (added after the caller was compiled) keep their defaults, bytes beyond ours are ignored.
template <typename T>
absl::StatusOr<T> ReadStruct(const T* in, void (*init)(T*), const char* fn, const char* what) {
  T out;
  init(&out);
  if (in == nullptr) return out;
  if (in->struct_size < sizeof(size_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        fn, ": ", what, "->struct_size is ", in->struct_size, "; set it to sizeof(", what,
        ") (", sizeof(T), " in this library), or fill the struct with its _init function"));
  }
  const size_t n = std::min(in->struct_size, sizeof(T));
  std::memcpy(static_cast<void*>(&out), in, n);
  out.struct_size = sizeof(T);
  return out;
}

// Writes `value` into the caller's struct up to its struct_size.
template <typename T>
absl::Status WriteStruct(T* out, const T& value, const char* fn, const char* what) {
  if (out == nullptr) return absl::OkStatus();
  const size_t size = out->struct_size;
  if (size < sizeof(size_t)) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": ", what, "->struct_size is ", size,
                                                   "; set it to sizeof(", what, ") (",
                                                   sizeof(T), " in this library)"));
  }
  const size_t n = std::min(size, sizeof(T));
  std::memcpy(static_cast<void*>(out), &value, n);
  out->struct_size = size;
  return absl::OkStatus();
}

void WriteText(const std::string& text, char* buffer, size_t capacity, size_t* length) {
  if (length != nullptr) *length = text.size();
  if (buffer == nullptr || capacity == 0) return;
  const size_t n = std::min(capacity - 1, text.size());
  std::memcpy(buffer, text.data(), n);
  buffer[n] = '\0';
}

absl::Status CheckText(char* buffer, size_t capacity, const char* fn) {
  if (buffer == nullptr && capacity > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": buffer is NULL but capacity is ", capacity));
  }
  return absl::OkStatus();
}

// A C enum's value as the caller stored it: C lets any int through an enum type, and loading
// one outside the enumerators' range as the C++ enum is undefined, so its bytes are read.
template <typename E>
int EnumValue(const E& e) {
  static_assert(sizeof(E) == sizeof(int), "the C API's enums are int-sized");
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

absl::StatusOr<fsdp::DType> ToDType(int d, const char* fn, const char* what) {
  if (d < 0 || d > static_cast<int>(fsdp::DType::kU8)) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": ", what, " is ", d,
                                                   ", not an fsdp_dtype (FSDP_DTYPE_F32 .. "
                                                   "FSDP_DTYPE_U8)"));
  }
  return static_cast<fsdp::DType>(d);
}

absl::StatusOr<fsdp::ShardingStrategy> ToStrategy(int s, const char* fn) {
  if (s < 0 || s > static_cast<int>(fsdp::ShardingStrategy::kHybridShardGradOp)) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": strategy is ", s,
                     ", not an fsdp_strategy (FSDP_FULL_SHARD .. FSDP_HYBRID_SHARD_GRAD_OP)"));
  }
  return static_cast<fsdp::ShardingStrategy>(s);
}

absl::StatusOr<fsdp::OffloadKind> ToOffload(int o, const char* fn) {
  if (o < 0 || o > static_cast<int>(fsdp::OffloadKind::kAll)) {
    return absl::InvalidArgumentError(absl::StrCat(
        fn, ": offload is ", o, ", not an fsdp_offload (FSDP_OFFLOAD_NONE .. FSDP_OFFLOAD_ALL)"));
  }
  return static_cast<fsdp::OffloadKind>(o);
}

absl::StatusOr<fsdp::BackendOptions> ToOptions(const fsdp_key_value* kv, size_t count,
                                               const char* fn) {
  if (kv == nullptr && count > 0) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": options is NULL but count is ", count));
  }
  fsdp::BackendOptions options;
  for (size_t i = 0; i < count; ++i) {
    if (kv[i].key == nullptr || kv[i].value == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(fn, ": option ", i, " has a NULL key or value"));
    }
    options[kv[i].key] = kv[i].value;
  }
  return options;
}

fsdp::CommOptions ToCommOptions(const fsdp_world_options& o) {
  fsdp::CommOptions c;
  if (o.timeout_seconds > 0) c.timeout = absl::Seconds(o.timeout_seconds);
  return c;
}

fsdp_view ToCView(const fsdp::View& v) {
  fsdp_view c;
  std::memset(&c, 0, sizeof(c));
  c.struct_size = sizeof(c);
  c.host = v.empty() ? nullptr : v.host();
  c.address = v.allocation.address;
  c.storage = v.allocation.storage;
  c.allocation_bytes = v.allocation.bytes;
  c.offset = v.offset;
  c.count = v.count;
  c.dtype = static_cast<fsdp_dtype>(static_cast<int>(v.dtype));
  return c;
}

absl::StatusOr<fsdp::View> FromCView(fsdp::Backend* backend, const fsdp_view* c, int64_t bytes,
                                     const char* fn) {
  if (c == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": view is NULL"));
  FSDP_ASSIGN_OR_RETURN(fsdp_view v, ReadStruct<fsdp_view>(
                                         c, [](fsdp_view* p) {
                                           std::memset(p, 0, sizeof(*p));
                                           p->struct_size = sizeof(*p);
                                         },
                                         fn, "fsdp_view"));
  FSDP_ASSIGN_OR_RETURN(fsdp::DType dtype, ToDType(EnumValue(v.dtype), fn, "view->dtype"));
  const int64_t size = static_cast<int64_t>(fsdp::DTypeSize(dtype));
  if (v.count < 0 || v.offset < 0 || v.count > (INT64_MAX - v.offset) / size ||
      static_cast<uint64_t>(v.offset + v.count * size) > v.allocation_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        fn, ": the view (offset ", v.offset, " bytes, ", v.count, " elements of ",
        std::string(fsdp::DTypeName(dtype)), ") does not fit its allocation of ", v.allocation_bytes,
        " bytes: pass a view the library handed out"));
  }
  if (bytes != v.count * size) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": bytes is ", bytes, " but the view has ",
                                                   v.count * size, " (", v.count, " x ",
                                                   std::string(fsdp::DTypeName(dtype)), ")"));
  }
  fsdp::View view;
  view.backend = backend;
  view.allocation = fsdp::Allocation{v.address, v.storage, static_cast<size_t>(v.allocation_bytes)};
  view.offset = v.offset;
  view.count = v.count;
  view.dtype = dtype;
  return view;
}

// Before a hook: an `out` whose struct_size cannot be right is refused before the hook runs.
absl::Status CheckUnitView(const fsdp_unit_view* out, const char* fn) {
  if (out != nullptr && out->struct_size < sizeof(size_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        fn, ": out->struct_size is ", out->struct_size, "; set it to sizeof(fsdp_unit_view)"));
  }
  return absl::OkStatus();
}

absl::Status WriteUnitView(const fsdp::UnitView& u, fsdp_unit_view* out, const char* fn) {
  if (out == nullptr) return absl::OkStatus();
  fsdp_unit_view v;
  std::memset(&v, 0, sizeof(v));
  v.struct_size = sizeof(v);
  v.unit = u.unit;
  v.numel = u.numel;
  v.params = ToCView(u.data_view);
  v.grads = ToCView(u.grads_view);
  return WriteStruct(out, v, fn, "fsdp_unit_view");
}

// Before a step: an `out` whose struct_size cannot be right is refused before the step runs.
absl::Status CheckStepStats(const fsdp_step_stats* out, const char* fn) {
  if (out != nullptr && out->struct_size < sizeof(size_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        fn, ": out->struct_size is ", out->struct_size, "; set it to sizeof(fsdp_step_stats)"));
  }
  return absl::OkStatus();
}

absl::Status WriteStepStats(const fsdp::StepStats& s, fsdp_step_stats* out, const char* fn) {
  fsdp_step_stats c;
  std::memset(&c, 0, sizeof(c));
  c.struct_size = sizeof(c);
  c.grad_norm = s.grad_norm;
  c.clip_coefficient = s.clip_coefficient;
  c.lr = s.lr;
  c.step = s.step;
  c.skipped = s.skipped;
  c.nonfinite = s.nonfinite;
  c.loss_scale = s.loss_scale;
  return WriteStruct(out, c, fn, "fsdp_step_stats");
}

// The runtime's hooks and queries, after the handle check.
#define FSDP_RUNTIME(handle)                            \
  FSDP_CHECK_HANDLE(handle, Kind::kRuntime, "runtime"); \
  fsdp::ShardingRuntime& r = *(handle)->rt

absl::Status CheckUnit(const fsdp::ShardingRuntime& r, int unit, const char* fn) {
  if (unit < 0 || unit >= r.num_units()) {
    return absl::OutOfRangeError(absl::StrCat(fn, ": unit ", unit, " does not exist (",
                                              r.num_units(), " units registered)"));
  }
  return absl::OkStatus();
}

// A destroyed handle's object is freed, but its small shell is kept for the life of the
// process, so that its address is never handed out again: a stale handle stays an error
// instead of silently naming a newer object of the same kind.
void KeepShell(void* shell) {
  static std::mutex mu;
  static auto* shells = new std::vector<void*>();
  std::lock_guard<std::mutex> lock(mu);
  shells->push_back(shell);
}
void Bury(fsdp_world* w) {
  w->owned.reset();
  w->comm = nullptr;
  KeepShell(w);
}
void Bury(fsdp_backend* b) {
  b->backend.reset();
  KeepShell(b);
}
void Bury(fsdp_runtime* r) {
  r->runtime.reset();
  r->rt = nullptr;
  KeepShell(r);
}
void Bury(fsdp_thread_group* g) {
  g->world.reset();
  g->mpi_ranks.clear();
  KeepShell(g);
}
void Bury(fsdp_model* m) {
  m->model.reset();
  KeepShell(m);
}

void ReleaseWorld(fsdp_world* w) {
  if (w->released.load() && w->runtimes.load() == 0) Bury(w);
}
void ReleaseBackend(fsdp_backend* b) {
  if (b->released.load() && b->runtimes.load() == 0) Bury(b);
}

// A rank's body on its thread, with a world handle the library owns (fsdp_run_threads,
// fsdp_run_mpi_threads). The body's error is the library's now; a failing rank aborts its
// world, so that peers still in a collective with it fail now rather than at the timeout.
absl::Status RunRankBody(Communicator& comm, fsdp_rank_body body, void* user) {
  auto* w = new fsdp_world;
  w->comm = &comm;
  w->borrowed = true;
  AddHandle(w, Kind::kWorld);
  const absl::Status s = TakeError(body(w, user));
  if (!s.ok()) {
    comm.Abort(
        absl::Status(s.code(), absl::StrCat("rank ", comm.rank(), " failed: ", s.message())));
  }
  RemoveHandle(w, Kind::kWorld);
  w->released = true;
  ReleaseWorld(w);
  return s;
}

// This process's ranks of an mpi_threads world of `threads` ranks per process.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MpiThreads(
    const char* fn, int threads, const fsdp_world_options& o) {
  if (!fsdp::MpiBuilt()) {
    return absl::UnimplementedError(
        absl::StrCat(fn, ": this libfsdp was built without MPI (FSDP_WITH_MPI off)"));
  }
  if (threads < 1 || threads > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": threads = ", threads, "; give 1 to 4096 ranks per process"));
  }
  return fsdp::CreateMpiThreadsWorld(threads, ToCommOptions(o));
}

}  // namespace

extern "C" {

// ---- version and errors -------------------------------------------------------------------------

uint32_t fsdp_api_version(void) { return FSDP_C_API_VERSION; }

const char* fsdp_version_string(void) {
  static const std::string* text = new std::string(absl::StrCat(
      "libfsdp ", FSDP_PROJECT_VERSION, " (C API ", FSDP_C_API_VERSION_MAJOR, ".",
      FSDP_C_API_VERSION_MINOR, ")"));
  return text->c_str();
}

fsdp_code fsdp_error_code(const fsdp_error* error) {
  return error == nullptr ? FSDP_CODE_OK : error->code;
}

const char* fsdp_error_message(const fsdp_error* error) {
  return error == nullptr ? "" : error->message.c_str();
}

fsdp_error* fsdp_error_create(fsdp_code code, const char* message) {
  const int c = EnumValue(code);
  try {
    return NewError(c <= 0 || c > FSDP_CODE_UNAUTHENTICATED ? FSDP_CODE_UNKNOWN : code,
                    message == nullptr ? std::string() : std::string(message));
  } catch (...) {
    return &kOutOfMemory;
  }
}

void fsdp_error_destroy(fsdp_error* error) {
  if (error != nullptr && error != &kOutOfMemory) delete error;
}

// ---- worlds -----------------------------------------------------------------------------------------

void fsdp_world_options_init(fsdp_world_options* options) {
  if (options == nullptr) return;
  std::memset(options, 0, sizeof(*options));
  options->struct_size = sizeof(*options);
}

fsdp_error* fsdp_run_threads(int size, const fsdp_world_options* options, fsdp_rank_body body,
                             void* user) {
  static constexpr char fn[] = "fsdp_run_threads";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_OUT(body, "body");
    FSDP_ASSIGN_OR_RETURN(fsdp_world_options o,
                          ReadStruct(options, fsdp_world_options_init, fn, "fsdp_world_options"));
    return fsdp::LocalWorld::Run(size, ToCommOptions(o), [&](Communicator& comm) {
      return RunRankBody(comm, body, user);
    });
  });
}

fsdp_error* fsdp_thread_group_create(int size, const fsdp_world_options* options,
                                     fsdp_thread_group** out) {
  static constexpr char fn[] = "fsdp_thread_group_create";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_OUT(out, "out");
    FSDP_ASSIGN_OR_RETURN(fsdp_world_options o,
                          ReadStruct(options, fsdp_world_options_init, fn, "fsdp_world_options"));
    FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::LocalWorld> world,
                          fsdp::LocalWorld::Create(size, ToCommOptions(o)));
    auto* g = new fsdp_thread_group;
    g->world = std::move(world);
    AddHandle(g, Kind::kThreadGroup);
    *out = g;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_thread_group_take_rank(fsdp_thread_group* group, int rank, fsdp_world** out) {
  static constexpr char fn[] = "fsdp_thread_group_take_rank";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(group, Kind::kThreadGroup, "group");
    FSDP_CHECK_OUT(out, "out");
    std::unique_ptr<Communicator> comm;
    {
      std::lock_guard<std::mutex> lock(group->mu);
      if (group->world != nullptr) {
        FSDP_ASSIGN_OR_RETURN(comm, group->world->TakeRank(rank));
      } else {
        const int n = static_cast<int>(group->mpi_ranks.size());
        if (rank < group->first || rank >= group->first + n) {
          return absl::InvalidArgumentError(absl::StrCat(
              fn, ": rank ", rank, " is not one of this process's ranks ", group->first, " to ",
              group->first + n - 1, " (fsdp_thread_group_ranks)"));
        }
        comm = std::move(group->mpi_ranks[static_cast<size_t>(rank - group->first)]);
        if (comm == nullptr) {
          return absl::FailedPreconditionError(
              absl::StrCat(fn, ": rank ", rank, " was taken already (each rank once)"));
        }
      }
    }
    auto* w = new fsdp_world;
    w->comm = comm.get();
    w->owned = std::move(comm);
    AddHandle(w, Kind::kWorld);
    *out = w;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_thread_group_ranks(const fsdp_thread_group* group, int* first, int* count) {
  static constexpr char fn[] = "fsdp_thread_group_ranks";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(group, Kind::kThreadGroup, "group");
    FSDP_CHECK_OUT(first, "first");
    FSDP_CHECK_OUT(count, "count");
    auto* g = const_cast<fsdp_thread_group*>(group);
    std::lock_guard<std::mutex> lock(g->mu);
    *first = g->world != nullptr ? 0 : g->first;
    *count = g->world != nullptr ? g->world->size() : static_cast<int>(g->mpi_ranks.size());
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_mpi_thread_group_create(int threads, const fsdp_world_options* options,
                                         fsdp_thread_group** out) {
  static constexpr char fn[] = "fsdp_mpi_thread_group_create";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_OUT(out, "out");
    FSDP_ASSIGN_OR_RETURN(fsdp_world_options o,
                          ReadStruct(options, fsdp_world_options_init, fn, "fsdp_world_options"));
    FSDP_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> ranks,
                          MpiThreads(fn, threads, o));
    auto* g = new fsdp_thread_group;
    g->first = ranks.front()->rank();
    g->mpi_ranks = std::move(ranks);
    AddHandle(g, Kind::kThreadGroup);
    *out = g;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_run_mpi_threads(int threads, const fsdp_world_options* options,
                                 fsdp_rank_body body, void* user) {
  static constexpr char fn[] = "fsdp_run_mpi_threads";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_OUT(body, "body");
    FSDP_ASSIGN_OR_RETURN(fsdp_world_options o,
                          ReadStruct(options, fsdp_world_options_init, fn, "fsdp_world_options"));
    FSDP_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> ranks,
                          MpiThreads(fn, threads, o));
    std::vector<absl::Status> results(ranks.size());
    std::vector<std::thread> ts;
    for (size_t t = 0; t < ranks.size(); ++t) {
      ts.emplace_back([&, t] { results[t] = RunRankBody(*ranks[t], body, user); });
    }
    for (std::thread& t : ts) t.join();
    for (const absl::Status& s : results) FSDP_RETURN_IF_ERROR(s);
    return absl::OkStatus();
  });
}

void fsdp_thread_group_destroy(fsdp_thread_group* group) {
  if (group == nullptr || !RemoveHandle(group, Kind::kThreadGroup)) return;
  Bury(group);
}

fsdp_error* fsdp_world_create_mpi(const fsdp_world_options* options, fsdp_world** out) {
  static constexpr char fn[] = "fsdp_world_create_mpi";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_OUT(out, "out");
    FSDP_ASSIGN_OR_RETURN(fsdp_world_options o,
                          ReadStruct(options, fsdp_world_options_init, fn, "fsdp_world_options"));
    if (!fsdp::MpiBuilt()) {
      return absl::UnimplementedError(
          absl::StrCat(fn, ": this libfsdp was built without MPI (FSDP_WITH_MPI off)"));
    }
    FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
                          fsdp::CreateMpiWorld(ToCommOptions(o)));
    auto* w = new fsdp_world;
    w->comm = comm.get();
    w->owned = std::move(comm);
    AddHandle(w, Kind::kWorld);
    *out = w;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_world_create_mpi_comm(const void* mpi_comm, const fsdp_world_options* options,
                                       fsdp_world** out) {
  static constexpr char fn[] = "fsdp_world_create_mpi_comm";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_OUT(mpi_comm, "mpi_comm");
    FSDP_CHECK_OUT(out, "out");
    FSDP_ASSIGN_OR_RETURN(fsdp_world_options o,
                          ReadStruct(options, fsdp_world_options_init, fn, "fsdp_world_options"));
    if (!fsdp::MpiBuilt()) {
      return absl::UnimplementedError(
          absl::StrCat(fn, ": this libfsdp was built without MPI (FSDP_WITH_MPI off)"));
    }
    FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
                          fsdp::CreateMpiWorldFrom(mpi_comm, ToCommOptions(o)));
    auto* w = new fsdp_world;
    w->comm = comm.get();
    w->owned = std::move(comm);
    AddHandle(w, Kind::kWorld);
    *out = w;
    return absl::OkStatus();
  });
}

void fsdp_mpi_shutdown(void) {
  try {
    if (fsdp::MpiBuilt()) fsdp::ShutdownMpi();
  } catch (...) {
  }
}

int fsdp_mpi_finish(const fsdp_error* status, const char* program) {
  try {
    return fsdp::FinishMpi(FromError(status), program == nullptr ? "libfsdp" : program);
  } catch (...) {
    return 1;
  }
}

void fsdp_world_destroy(fsdp_world* world) {
  if (world == nullptr) return;
  {
    Live& l = Handles();
    std::lock_guard<std::mutex> lock(l.mu);
    auto it = l.handles.find(world);
    // A run_threads body's world is the library's: leave it to the library.
    if (it == l.handles.end() || it->second != Kind::kWorld || world->borrowed) return;
    l.handles.erase(it);
  }
  world->released = true;
  ReleaseWorld(world);
}

fsdp_error* fsdp_world_rank(const fsdp_world* world, int* rank) {
  static constexpr char fn[] = "fsdp_world_rank";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(world, Kind::kWorld, "world");
    FSDP_CHECK_OUT(rank, "rank");
    *rank = world->comm->rank();
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_world_size(const fsdp_world* world, int* size) {
  static constexpr char fn[] = "fsdp_world_size";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(world, Kind::kWorld, "world");
    FSDP_CHECK_OUT(size, "size");
    *size = world->comm->size();
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_world_abort(fsdp_world* world, const fsdp_error* reason) {
  static constexpr char fn[] = "fsdp_world_abort";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(world, Kind::kWorld, "world");
    absl::Status s = FromError(reason);
    if (s.ok()) s = absl::AbortedError(absl::StrCat("rank ", world->comm->rank(), " aborted"));
    world->comm->Abort(s);
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_world_host_layout(fsdp_world* world, int* num_hosts, int* ranks_per_host) {
  static constexpr char fn[] = "fsdp_world_host_layout";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(world, Kind::kWorld, "world");
    FSDP_ASSIGN_OR_RETURN(fsdp::HostLayout layout, fsdp::DiscoverHostLayout(*world->comm));
    if (num_hosts != nullptr) *num_hosts = layout.num_hosts;
    if (ranks_per_host != nullptr) *ranks_per_host = layout.uniform_ranks_per_host();
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_world_check_same_settings(fsdp_world* world, const fsdp_key_value* settings,
                                           size_t count, const char* context) {
  static constexpr char fn[] = "fsdp_world_check_same_settings";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(world, Kind::kWorld, "world");
    if (settings == nullptr && count > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(fn, ": settings is NULL but count is ", count));
    }
    std::vector<fsdp::Setting> s;
    for (size_t i = 0; i < count; ++i) {
      if (settings[i].key == nullptr || settings[i].value == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(fn, ": setting ", i, " has a NULL key or value"));
      }
      s.push_back({settings[i].key, settings[i].value});
    }
    return fsdp::CheckSameSettings(*world->comm, s, context == nullptr ? "" : context);
  });
}

fsdp_error* fsdp_world_agree(fsdp_world* world, const fsdp_error* local) {
  static constexpr char fn[] = "fsdp_world_agree";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(world, Kind::kWorld, "world");
    return fsdp::AgreeOnStatus(*world->comm, FromError(local));
  });
}

// ---- backends ---------------------------------------------------------------------------------------

fsdp_error* fsdp_backend_names(char* buffer, size_t capacity, size_t* length) {
  static constexpr char fn[] = "fsdp_backend_names";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RETURN_IF_ERROR(CheckText(buffer, capacity, fn));
    WriteText(fsdp::BackendNames(), buffer, capacity, length);
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_backend_create(const char* name, const fsdp_key_value* options, size_t count,
                                int rank, fsdp_backend** out) {
  static constexpr char fn[] = "fsdp_backend_create";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_OUT(name, "name");
    FSDP_CHECK_OUT(out, "out");
    if (rank < 0) return absl::InvalidArgumentError(absl::StrCat(fn, ": rank is ", rank));
    FSDP_ASSIGN_OR_RETURN(fsdp::BackendOptions o, ToOptions(options, count, fn));
    FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::Backend> backend,
                          fsdp::CreateBackend(name, o, rank));
    auto* b = new fsdp_backend;
    b->backend = std::move(backend);
    AddHandle(b, Kind::kBackend);
    *out = b;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_backend_device_count(const char* name, const fsdp_key_value* options,
                                      size_t count, int* devices) {
  static constexpr char fn[] = "fsdp_backend_device_count";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_OUT(name, "name");
    FSDP_CHECK_OUT(devices, "devices");
    FSDP_ASSIGN_OR_RETURN(fsdp::BackendOptions o, ToOptions(options, count, fn));
    FSDP_ASSIGN_OR_RETURN(*devices, fsdp::BackendDeviceCount(name, o));
    return absl::OkStatus();
  });
}

void fsdp_backend_destroy(fsdp_backend* backend) {
  if (backend == nullptr || !RemoveHandle(backend, Kind::kBackend)) return;
  backend->released = true;
  ReleaseBackend(backend);
}

fsdp_error* fsdp_backend_name(const fsdp_backend* backend, char* buffer, size_t capacity,
                              size_t* length) {
  static constexpr char fn[] = "fsdp_backend_name";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    FSDP_RETURN_IF_ERROR(CheckText(buffer, capacity, fn));
    WriteText(std::string(backend->backend->name()), buffer, capacity, length);
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_backend_is_host(const fsdp_backend* backend, int* is_host) {
  static constexpr char fn[] = "fsdp_backend_is_host";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    FSDP_CHECK_OUT(is_host, "is_host");
    *is_host = backend->backend->is_host() ? 1 : 0;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_backend_memory(const fsdp_backend* backend, int64_t* in_use, int64_t* peak) {
  static constexpr char fn[] = "fsdp_backend_memory";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    const fsdp::MemoryStats m = backend->backend->memory_stats();
    if (in_use != nullptr) *in_use = static_cast<int64_t>(m.bytes_in_use);
    if (peak != nullptr) *peak = static_cast<int64_t>(m.peak_bytes);
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_backend_synchronize(fsdp_backend* backend) {
  static constexpr char fn[] = "fsdp_backend_synchronize";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    return backend->backend->Synchronize();
  });
}

fsdp_error* fsdp_view_copy_to_host(fsdp_backend* backend, const fsdp_view* view, void* dst,
                                   int64_t bytes) {
  static constexpr char fn[] = "fsdp_view_copy_to_host";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    FSDP_CHECK_OUT(dst, "dst");
    FSDP_ASSIGN_OR_RETURN(fsdp::View v, FromCView(backend->backend.get(), view, bytes, fn));
    if (v.empty()) return absl::OkStatus();
    return backend->backend->CopyToHost(dst, v);
  });
}

fsdp_error* fsdp_view_copy_from_host(fsdp_backend* backend, const fsdp_view* view,
                                     const void* src, int64_t bytes) {
  static constexpr char fn[] = "fsdp_view_copy_from_host";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    FSDP_CHECK_OUT(src, "src");
    FSDP_ASSIGN_OR_RETURN(fsdp::View v, FromCView(backend->backend.get(), view, bytes, fn));
    if (v.empty()) return absl::OkStatus();
    return backend->backend->CopyFromHost(v, src);
  });
}

fsdp_error* fsdp_backend_wrap_host_memory(fsdp_backend* backend, void* pointer, int64_t count,
                                          fsdp_dtype dtype, fsdp_view* out) {
  static constexpr char fn[] = "fsdp_backend_wrap_host_memory";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    FSDP_CHECK_OUT(pointer, "pointer");
    FSDP_CHECK_OUT(out, "out");
    FSDP_ASSIGN_OR_RETURN(fsdp::DType d, ToDType(EnumValue(dtype), fn, "dtype"));
    FSDP_ASSIGN_OR_RETURN(fsdp::View v,
                          fsdp::WrapHostMemory(backend->backend.get(), pointer, count, d));
    return WriteStruct(out, ToCView(v), fn, "fsdp_view");
  });
}

fsdp_error* fsdp_backend_wrap_native_memory(fsdp_backend* backend, void* pointer, int64_t count,
                                            fsdp_dtype dtype, fsdp_view* out) {
  static constexpr char fn[] = "fsdp_backend_wrap_native_memory";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    FSDP_CHECK_OUT(pointer, "pointer");
    FSDP_CHECK_OUT(out, "out");
    FSDP_ASSIGN_OR_RETURN(fsdp::DType d, ToDType(EnumValue(dtype), fn, "dtype"));
    FSDP_ASSIGN_OR_RETURN(fsdp::View v, backend->backend->WrapNativeMemory(pointer, count, d));
    return WriteStruct(out, ToCView(v), fn, "fsdp_view");
  });
}

fsdp_error* fsdp_backend_native_stream(fsdp_backend* backend, int stream, void** out) {
  static constexpr char fn[] = "fsdp_backend_native_stream";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    FSDP_CHECK_OUT(out, "out");
    if (stream != 0 && stream != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(fn, ": stream is ", stream, " (0: compute, 1: communication)"));
    }
    void* s = backend->backend->native_stream(stream == 0 ? fsdp::Stream::kCompute
                                                          : fsdp::Stream::kComm);
    if (s == nullptr) {
      return absl::UnimplementedError(absl::StrCat(
          fn, ": the ", std::string(backend->backend->name()),
          " backend has no native stream handle (its streams are the library's own)"));
    }
    *out = s;
    return absl::OkStatus();
  });
}

// ---- the runtime -------------------------------------------------------------------------------------

void fsdp_sharding_options_init(fsdp_sharding_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof(*o));
  const fsdp::ShardingOptions d;
  o->struct_size = sizeof(*o);
  o->strategy = FSDP_FULL_SHARD;
  o->hybrid_shard_size = d.hybrid_shard_size;
  o->forward_prefetch = d.forward_prefetch;
  o->backward_prefetch = d.backward_prefetch;
  o->max_prefetch_units = d.max_prefetch_units;
  o->param_dtype = FSDP_DTYPE_F32;
  o->reduce_dtype = FSDP_DTYPE_F32;
  o->dynamic_loss_scale = 0;
  o->initial_loss_scale = d.mixed_precision.initial_loss_scale;
  o->max_grad_norm = d.max_grad_norm;
  o->optimizer = FSDP_OPTIMIZER_ADAMW;
  o->adamw_beta1 = d.adamw.beta1;
  o->adamw_beta2 = d.adamw.beta2;
  o->adamw_eps = d.adamw.eps;
  o->weight_decay = -1.0f;
  o->sgd_momentum = d.sgd.momentum;
  o->nonfinite = FSDP_NONFINITE_ERROR;
  o->offload = FSDP_OFFLOAD_NONE;
  o->offload_budget_bytes = -1;
}

namespace {
absl::StatusOr<fsdp::ShardingOptions> ToShardingOptions(const fsdp_sharding_options& c,
                                                        const char* fn) {
  fsdp::ShardingOptions o;
  FSDP_ASSIGN_OR_RETURN(o.strategy, ToStrategy(EnumValue(c.strategy), fn));
  o.hybrid_shard_size = c.hybrid_shard_size;
  o.forward_prefetch = c.forward_prefetch != 0;
  o.backward_prefetch = c.backward_prefetch != 0;
  o.max_prefetch_units = c.max_prefetch_units;
  FSDP_ASSIGN_OR_RETURN(o.mixed_precision.param_dtype, ToDType(EnumValue(c.param_dtype), fn, "param_dtype"));
  FSDP_ASSIGN_OR_RETURN(o.mixed_precision.reduce_dtype,
                        ToDType(EnumValue(c.reduce_dtype), fn, "reduce_dtype"));
  o.mixed_precision.dynamic_loss_scale = c.dynamic_loss_scale != 0;
  o.mixed_precision.initial_loss_scale = c.initial_loss_scale;
  o.max_grad_norm = c.max_grad_norm;
  const int optimizer = EnumValue(c.optimizer);
  if (optimizer != FSDP_OPTIMIZER_ADAMW && optimizer != FSDP_OPTIMIZER_SGD) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": optimizer is ", optimizer,
                     ", not an fsdp_optimizer (FSDP_OPTIMIZER_ADAMW, FSDP_OPTIMIZER_SGD)"));
  }
  o.optimizer = optimizer == FSDP_OPTIMIZER_SGD ? fsdp::OptimizerKind::kSgd
                                                : fsdp::OptimizerKind::kAdamW;
  o.adamw.beta1 = c.adamw_beta1;
  o.adamw.beta2 = c.adamw_beta2;
  o.adamw.eps = c.adamw_eps;
  if (c.weight_decay >= 0) {
    o.adamw.weight_decay = c.weight_decay;
    o.sgd.weight_decay = c.weight_decay;
  }
  o.sgd.momentum = c.sgd_momentum;
  const int nonfinite = EnumValue(c.nonfinite);
  if (nonfinite != FSDP_NONFINITE_ERROR && nonfinite != FSDP_NONFINITE_SKIP) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": nonfinite is ", nonfinite,
                     ", not an fsdp_nonfinite (FSDP_NONFINITE_ERROR, FSDP_NONFINITE_SKIP)"));
  }
  o.nonfinite = nonfinite == FSDP_NONFINITE_SKIP ? fsdp::NonFinitePolicy::kSkip
                                                   : fsdp::NonFinitePolicy::kError;
  FSDP_ASSIGN_OR_RETURN(o.offload.what, ToOffload(EnumValue(c.offload), fn));
  o.offload.budget_bytes = c.offload_budget_bytes;
  return o;
}
}  // namespace

fsdp_error* fsdp_runtime_create(fsdp_backend* backend, fsdp_world* world,
                                const fsdp_sharding_options* options, fsdp_runtime** out) {
  static constexpr char fn[] = "fsdp_runtime_create";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    FSDP_CHECK_HANDLE(world, Kind::kWorld, "world");
    FSDP_CHECK_OUT(out, "out");
    FSDP_ASSIGN_OR_RETURN(
        fsdp_sharding_options c,
        ReadStruct(options, fsdp_sharding_options_init, fn, "fsdp_sharding_options"));
    FSDP_ASSIGN_OR_RETURN(fsdp::ShardingOptions o, ToShardingOptions(c, fn));
    FSDP_ASSIGN_OR_RETURN(
        std::unique_ptr<fsdp::ShardingRuntime> runtime,
        fsdp::ShardingRuntime::Create(backend->backend.get(), *world->comm, std::move(o)));
    auto* r = new fsdp_runtime;
    r->rt = runtime.get();
    r->runtime = std::move(runtime);
    r->world = world;
    r->backend = backend;
    ++world->runtimes;
    ++backend->runtimes;
    AddHandle(r, Kind::kRuntime);
    *out = r;
    return absl::OkStatus();
  });
}

void fsdp_runtime_destroy(fsdp_runtime* runtime) {
  if (runtime == nullptr) return;
  {
    Live& l = Handles();
    std::lock_guard<std::mutex> lock(l.mu);
    auto it = l.handles.find(runtime);
    // A model's runtime is the model's to destroy.
    if (it == l.handles.end() || it->second != Kind::kRuntime || runtime->borrowed) return;
    l.handles.erase(it);
  }
  fsdp_world* w = runtime->world;
  fsdp_backend* b = runtime->backend;
  try {
    Bury(runtime);
  } catch (...) {
  }
  --w->runtimes;
  --b->runtimes;
  ReleaseWorld(w);
  ReleaseBackend(b);
}

void fsdp_param_init(fsdp_param* param) {
  if (param == nullptr) return;
  std::memset(param, 0, sizeof(*param));
  param->struct_size = sizeof(*param);
  param->requires_grad = 1;
  param->weight_decay = -1;
}

fsdp_error* fsdp_runtime_register_unit(fsdp_runtime* runtime, const char* name,
                                       const fsdp_param* params, size_t count, int* unit) {
  static constexpr char fn[] = "fsdp_runtime_register_unit";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_CHECK_OUT(name, "name");
    if (params == nullptr && count > 0) {
      return absl::InvalidArgumentError(absl::StrCat(fn, ": params is NULL but count is ", count));
    }
    std::vector<fsdp::ParamInfo> infos;
    // Each element's own struct_size steps through the array: an older caller's shorter
    // struct is read as such.
    const char* p = reinterpret_cast<const char*>(params);
    for (size_t i = 0; i < count; ++i) {
      const auto* in = reinterpret_cast<const fsdp_param*>(p);
      FSDP_ASSIGN_OR_RETURN(fsdp_param c, ReadStruct(in, fsdp_param_init, fn, "fsdp_param"));
      p += in->struct_size;
      if (c.name == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(fn, ": params[", i, "].name is NULL"));
      }
      if (c.ndim < 0 || c.ndim > 8 || (c.ndim > 0 && c.shape == nullptr)) {
        return absl::InvalidArgumentError(absl::StrCat(
            fn, ": params[", i, "] (", c.name, ") has ndim ", c.ndim,
            c.shape == nullptr ? " and a NULL shape" : "", "; 0 to 8 dimensions are allowed"));
      }
      std::optional<bool> decay;
      if (c.weight_decay >= 0) decay = c.weight_decay != 0;
      infos.emplace_back(c.name, std::vector<int64_t>(c.shape, c.shape + c.ndim),
                         c.requires_grad != 0, decay);
    }
    FSDP_ASSIGN_OR_RETURN(int u, r.RegisterUnit(name, std::move(infos)));
    if (unit != nullptr) *unit = u;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_runtime_finalize(fsdp_runtime* runtime, fsdp_init_fn init, void* user) {
  static constexpr char fn[] = "fsdp_runtime_finalize";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    // The first error of `init` stops the fill; the rest of the shards are zeros. Finalize is
    // collective, so every rank still finishes it; then the ranks agree on the error.
    absl::Status init_status;
    absl::Status s = r.Finalize([&](int u, const fsdp::ParamInfo& param, int64_t begin,
                                    int64_t end, float* out) {
      if (init == nullptr || !init_status.ok()) {
        std::fill(out, out + (end - begin), 0.0f);
        return;
      }
      int index = 0;
      const std::vector<fsdp::TensorSlot>& slots = r.unit_tensors(u);
      for (size_t i = 0; i < slots.size(); ++i) {
        if (slots[i].name == param.name) index = static_cast<int>(i);
      }
      init_status = TakeError(init(user, u, index, begin, end, out));
      if (!init_status.ok()) std::fill(out, out + (end - begin), 0.0f);
    });
    FSDP_RETURN_IF_ERROR(s);
    return fsdp::AgreeOnStatus(r.world(), init_status);
  });
}

fsdp_error* fsdp_runtime_num_units(const fsdp_runtime* runtime, int* count) {
  static constexpr char fn[] = "fsdp_runtime_num_units";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_CHECK_OUT(count, "count");
    *count = r.num_units();
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_runtime_unit_param(const fsdp_runtime* runtime, int unit, int index,
                                    int64_t* offset, int64_t* numel, char* name, size_t capacity,
                                    size_t* length) {
  static constexpr char fn[] = "fsdp_runtime_unit_param";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_RETURN_IF_ERROR(CheckUnit(r, unit, fn));
    FSDP_RETURN_IF_ERROR(CheckText(name, capacity, fn));
    const std::vector<fsdp::TensorSlot>& slots = r.unit_tensors(unit);
    if (index < 0 || index >= static_cast<int>(slots.size())) {
      return absl::InvalidArgumentError(absl::StrCat(fn, ": unit ", unit, " has ", slots.size(),
                                                     " parameters, not one at index ", index));
    }
    if (offset != nullptr) *offset = slots[index].offset;
    if (numel != nullptr) *numel = slots[index].numel;
    WriteText(slots[index].name, name, capacity, length);
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_runtime_unit_numel(const fsdp_runtime* runtime, int unit, int64_t* numel) {
  static constexpr char fn[] = "fsdp_runtime_unit_numel";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_RETURN_IF_ERROR(CheckUnit(r, unit, fn));
    FSDP_CHECK_OUT(numel, "numel");
    *numel = r.unit_numel(unit);
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_pre_forward(fsdp_runtime* runtime, int unit, fsdp_unit_view* out) {
  static constexpr char fn[] = "fsdp_pre_forward";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_RETURN_IF_ERROR(CheckUnitView(out, fn));
    FSDP_ASSIGN_OR_RETURN(fsdp::UnitView v, r.PreForward(unit));
    return WriteUnitView(v, out, fn);
  });
}

fsdp_error* fsdp_post_forward(fsdp_runtime* runtime, int unit) {
  static constexpr char fn[] = "fsdp_post_forward";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    return r.PostForward(unit);
  });
}

fsdp_error* fsdp_pre_backward(fsdp_runtime* runtime, int unit, fsdp_unit_view* out) {
  static constexpr char fn[] = "fsdp_pre_backward";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_RETURN_IF_ERROR(CheckUnitView(out, fn));
    FSDP_ASSIGN_OR_RETURN(fsdp::UnitView v, r.PreBackward(unit));
    return WriteUnitView(v, out, fn);
  });
}

fsdp_error* fsdp_post_backward(fsdp_runtime* runtime, int unit) {
  static constexpr char fn[] = "fsdp_post_backward";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    return r.PostBackward(unit);
  });
}

fsdp_error* fsdp_finish_backward(fsdp_runtime* runtime) {
  static constexpr char fn[] = "fsdp_finish_backward";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    return r.FinishBackward();
  });
}

fsdp_error* fsdp_finish_forward_only(fsdp_runtime* runtime) {
  static constexpr char fn[] = "fsdp_finish_forward_only";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    return r.FinishForwardOnly();
  });
}

fsdp_error* fsdp_step(fsdp_runtime* runtime, float lr, fsdp_step_stats* out) {
  static constexpr char fn[] = "fsdp_step";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_RETURN_IF_ERROR(CheckStepStats(out, fn));
    FSDP_ASSIGN_OR_RETURN(fsdp::StepStats s, r.Step(lr));
    return WriteStepStats(s, out, fn);
  });
}

fsdp_error* fsdp_set_sync_gradients(fsdp_runtime* runtime, int sync) {
  static constexpr char fn[] = "fsdp_set_sync_gradients";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    r.set_sync_gradients(sync != 0);
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_set_requires_all_reduce(fsdp_runtime* runtime, int all_reduce) {
  static constexpr char fn[] = "fsdp_set_requires_all_reduce";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    r.set_requires_all_reduce(all_reduce != 0);
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_set_activation_bytes(fsdp_runtime* runtime, int64_t bytes) {
  static constexpr char fn[] = "fsdp_set_activation_bytes";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    if (bytes < 0) return absl::InvalidArgumentError(absl::StrCat(fn, ": bytes is ", bytes));
    r.SetActivationBytes(bytes);
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_runtime_loss_scale(const fsdp_runtime* runtime, float* scale) {
  static constexpr char fn[] = "fsdp_runtime_loss_scale";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_CHECK_OUT(scale, "scale");
    *scale = r.loss_scale();
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_runtime_steps(const fsdp_runtime* runtime, int64_t* steps) {
  static constexpr char fn[] = "fsdp_runtime_steps";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_CHECK_OUT(steps, "steps");
    *steps = r.steps();
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_runtime_gather_unit(fsdp_runtime* runtime, int unit, float* out,
                                     int64_t capacity) {
  static constexpr char fn[] = "fsdp_runtime_gather_unit";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_RETURN_IF_ERROR(CheckUnit(r, unit, fn));
    FSDP_CHECK_OUT(out, "out");
    if (capacity < r.unit_numel(unit)) {
      return absl::InvalidArgumentError(absl::StrCat(fn, ": unit ", unit, " has ",
                                                     r.unit_numel(unit),
                                                     " elements but capacity is ", capacity));
    }
    return r.GatherUnit(unit, out);
  });
}

fsdp_error* fsdp_runtime_memory(const fsdp_runtime* runtime, fsdp_memory_report* out) {
  static constexpr char fn[] = "fsdp_runtime_memory";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_CHECK_OUT(out, "out");
    const fsdp::MemoryReport m = r.memory();
    fsdp_memory_report c;
    std::memset(&c, 0, sizeof(c));
    c.struct_size = sizeof(c);
    c.param_shard_bytes = m.param_shard_bytes;
    c.grad_shard_bytes = m.grad_shard_bytes;
    c.optimizer_bytes = m.optimizer_bytes;
    c.gathered_param_bytes = m.gathered_param_bytes;
    c.gathered_param_peak_bytes = m.gathered_param_peak_bytes;
    c.grad_buffer_bytes = m.grad_buffer_bytes;
    c.grad_buffer_peak_bytes = m.grad_buffer_peak_bytes;
    c.activation_peak_bytes = m.activation_peak_bytes;
    c.secondary_param_bytes = m.secondary_param_bytes;
    c.secondary_param_peak_bytes = m.secondary_param_peak_bytes;
    c.peak_bytes = m.peak_bytes;
    c.host_offload_bytes = m.host_offload_bytes;
    c.offloaded_units = m.offloaded_units;
    return WriteStruct(out, c, fn, "fsdp_memory_report");
  });
}

fsdp_error* fsdp_runtime_reset_peaks(fsdp_runtime* runtime) {
  static constexpr char fn[] = "fsdp_runtime_reset_peaks";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    r.ResetPeaks();
    return absl::OkStatus();
  });
}

// ---- checkpoints -------------------------------------------------------------------------------------

fsdp_error* fsdp_checkpoint_save(fsdp_runtime* runtime, const char* dir, int overwrite) {
  static constexpr char fn[] = "fsdp_checkpoint_save";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_CHECK_OUT(dir, "dir");
    fsdp::SaveOptions o;
    o.overwrite = overwrite != 0;
    return fsdp::SaveCheckpoint(r, dir, {}, o);
  });
}

fsdp_error* fsdp_checkpoint_load(fsdp_runtime* runtime, const char* dir, int load_optimizer_state,
                                 int64_t* step) {
  static constexpr char fn[] = "fsdp_checkpoint_load";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_CHECK_OUT(dir, "dir");
    fsdp::LoadOptions o;
    o.load_optimizer_state = load_optimizer_state != 0;
    FSDP_ASSIGN_OR_RETURN(fsdp::LoadedCheckpoint loaded, fsdp::LoadCheckpoint(r, dir, o));
    if (step != nullptr) *step = loaded.step;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_safetensors_export(fsdp_runtime* runtime, const char* path, fsdp_dtype dtype) {
  static constexpr char fn[] = "fsdp_safetensors_export";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_CHECK_OUT(path, "path");
    fsdp::SafetensorsExportOptions o;
    FSDP_ASSIGN_OR_RETURN(o.dtype, ToDType(EnumValue(dtype), fn, "dtype"));
    return fsdp::ExportSafetensors(r, path, o);
  });
}

fsdp_error* fsdp_safetensors_import(fsdp_runtime* runtime, const char* path,
                                    int ignore_extra_tensors) {
  static constexpr char fn[] = "fsdp_safetensors_import";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RUNTIME(runtime);
    FSDP_CHECK_OUT(path, "path");
    fsdp::SafetensorsImportOptions o;
    o.ignore_extra_tensors = ignore_extra_tensors != 0;
    return fsdp::ImportSafetensors(r, path, o);
  });
}

// ---- the bundled models ---------------------------------------------------------------------------------

void fsdp_model_options_init(fsdp_model_options* options) {
  if (options == nullptr) return;
  std::memset(options, 0, sizeof(*options));
  const fsdp::nn::ShardedModelOptions d;
  options->struct_size = sizeof(*options);
  options->config = nullptr;
  options->batch_size = d.batch_size;
  options->seq_len = d.seq_len;
  options->seed = d.seed;
  options->checkpoint_every = d.checkpoint_every;
}

fsdp_error* fsdp_model_create(fsdp_backend* backend, fsdp_world* world,
                              const fsdp_sharding_options* sharding,
                              const fsdp_model_options* options, fsdp_model** out) {
  static constexpr char fn[] = "fsdp_model_create";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(backend, Kind::kBackend, "backend");
    FSDP_CHECK_HANDLE(world, Kind::kWorld, "world");
    FSDP_CHECK_OUT(out, "out");
    FSDP_ASSIGN_OR_RETURN(
        fsdp_sharding_options c,
        ReadStruct(sharding, fsdp_sharding_options_init, fn, "fsdp_sharding_options"));
    FSDP_ASSIGN_OR_RETURN(fsdp_model_options m,
                          ReadStruct(options, fsdp_model_options_init, fn, "fsdp_model_options"));
    fsdp::nn::ShardedModelOptions o;
    FSDP_ASSIGN_OR_RETURN(o.sharding, ToShardingOptions(c, fn));
    o.batch_size = m.batch_size;
    o.seq_len = m.seq_len;
    o.seed = m.seed;
    o.checkpoint_every = m.checkpoint_every;
    FSDP_ASSIGN_OR_RETURN(fsdp::nn::ModelConfig config,
                          fsdp::nn::ModelConfig::FromName(m.config == nullptr ? "nano" : m.config));
    FSDP_ASSIGN_OR_RETURN(
        std::unique_ptr<fsdp::nn::ShardedModel> model,
        fsdp::nn::ShardedModel::Create(config, backend->backend.get(), *world->comm, o));
    auto* md = new fsdp_model;
    auto* r = new fsdp_runtime;
    r->rt = &model->runtime();
    r->world = world;
    r->backend = backend;
    r->borrowed = true;
    md->model = std::move(model);
    md->runtime = r;
    md->world = world;
    md->backend = backend;
    ++world->runtimes;
    ++backend->runtimes;
    AddHandle(r, Kind::kRuntime);
    AddHandle(md, Kind::kModel);
    *out = md;
    return absl::OkStatus();
  });
}

void fsdp_model_destroy(fsdp_model* model) {
  if (model == nullptr || !RemoveHandle(model, Kind::kModel)) return;
  RemoveHandle(model->runtime, Kind::kRuntime);
  fsdp_world* w = model->world;
  fsdp_backend* b = model->backend;
  try {
    Bury(model);
    Bury(model->runtime);
  } catch (...) {
  }
  --w->runtimes;
  --b->runtimes;
  ReleaseWorld(w);
  ReleaseBackend(b);
}

fsdp_error* fsdp_model_info(const fsdp_model* model, int* vocab_size, int* block_size,
                            int64_t* num_parameters) {
  static constexpr char fn[] = "fsdp_model_info";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(model, Kind::kModel, "model");
    const fsdp::nn::ModelConfig& c = model->model->config();
    if (vocab_size != nullptr) *vocab_size = c.vocab_size();
    if (block_size != nullptr) *block_size = c.block_size();
    if (num_parameters != nullptr) {
      int64_t n = 0;
      const fsdp::ShardingRuntime& r = model->model->runtime();
      for (int u = 0; u < r.num_units(); ++u) n += r.unit_numel(u);
      *num_parameters = n;
    }
    return absl::OkStatus();
  });
}

namespace {
absl::Status CheckTokens(const fsdp_model* model, const int32_t* inputs, const int32_t* targets,
                         int64_t count, bool targets_required, const char* fn) {
  FSDP_CHECK_OUT(inputs, "inputs");
  if (targets_required) FSDP_CHECK_OUT(targets, "targets");
  const fsdp::nn::StagedModel& m = model->model->model();
  const int64_t want = static_cast<int64_t>(m.batch_size()) * m.seq_len();
  if (count != want) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": count is ", count, " but the model takes ",
                                                   m.batch_size(), " x ", m.seq_len(), " = ", want,
                                                   " tokens (batch_size x seq_len)"));
  }
  const int vocab = model->model->config().vocab_size();
  for (int64_t i = 0; i < count; ++i) {
    if (inputs[i] < 0 || inputs[i] >= vocab || (targets != nullptr &&
                                                (targets[i] < 0 || targets[i] >= vocab))) {
      return absl::InvalidArgumentError(
          absl::StrCat(fn, ": token ", i, " is out of [0, ", vocab, "): input ", inputs[i],
                       targets != nullptr ? absl::StrCat(", target ", targets[i]) : ""));
    }
  }
  return absl::OkStatus();
}
}  // namespace

fsdp_error* fsdp_model_forward_backward(fsdp_model* model, const int32_t* inputs,
                                        const int32_t* targets, int64_t count, float* loss) {
  static constexpr char fn[] = "fsdp_model_forward_backward";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(model, Kind::kModel, "model");
    FSDP_RETURN_IF_ERROR(CheckTokens(model, inputs, targets, count, true, fn));
    FSDP_ASSIGN_OR_RETURN(float l, model->model->ForwardBackward(inputs, targets));
    if (loss != nullptr) *loss = l;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_model_forward(fsdp_model* model, const int32_t* inputs, const int32_t* targets,
                               int64_t count, float* loss) {
  static constexpr char fn[] = "fsdp_model_forward";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(model, Kind::kModel, "model");
    FSDP_RETURN_IF_ERROR(CheckTokens(model, inputs, targets, count, true, fn));
    FSDP_ASSIGN_OR_RETURN(float l, model->model->Forward(inputs, targets));
    if (loss != nullptr) *loss = l;
    return absl::OkStatus();
  });
}

fsdp_error* fsdp_model_step(fsdp_model* model, float lr, fsdp_step_stats* out) {
  static constexpr char fn[] = "fsdp_model_step";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(model, Kind::kModel, "model");
    FSDP_RETURN_IF_ERROR(CheckStepStats(out, fn));
    FSDP_ASSIGN_OR_RETURN(fsdp::StepStats s, model->model->Step(lr));
    return WriteStepStats(s, out, fn);
  });
}

fsdp_error* fsdp_model_runtime(fsdp_model* model, fsdp_runtime** out) {
  static constexpr char fn[] = "fsdp_model_runtime";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_HANDLE(model, Kind::kModel, "model");
    FSDP_CHECK_OUT(out, "out");
    *out = model->runtime;
    return absl::OkStatus();
  });
}

// ---- the planner ---------------------------------------------------------------------------------------

void fsdp_plan_request_init(fsdp_plan_request* request) {
  if (request == nullptr) return;
  std::memset(request, 0, sizeof(*request));
  request->struct_size = sizeof(*request);
  request->model = nullptr;
  request->world_size = 1;
  request->strategy = FSDP_FULL_SHARD;
  request->param_dtype = FSDP_DTYPE_F32;
  request->reduce_dtype = FSDP_DTYPE_F32;
  request->batch_size = 1;
  request->micro_batches = 1;
  request->offload = FSDP_OFFLOAD_NONE;
  request->offload_budget_bytes = -1;
}

namespace {
absl::StatusOr<fsdp::PlanRequest> ToPlanRequest(const fsdp_plan_request* in, const char* fn) {
  FSDP_CHECK_OUT(in, "request");
  FSDP_ASSIGN_OR_RETURN(fsdp_plan_request c,
                        ReadStruct(in, fsdp_plan_request_init, fn, "fsdp_plan_request"));
  fsdp::PlanRequest r;
  if (c.model != nullptr) r.model = c.model;
  r.world_size = c.world_size;
  r.ranks_per_host = c.ranks_per_host;
  FSDP_ASSIGN_OR_RETURN(r.strategy, ToStrategy(EnumValue(c.strategy), fn));
  r.hybrid_shard_size = c.hybrid_shard_size;
  FSDP_ASSIGN_OR_RETURN(r.param_dtype, ToDType(EnumValue(c.param_dtype), fn, "param_dtype"));
  FSDP_ASSIGN_OR_RETURN(r.reduce_dtype, ToDType(EnumValue(c.reduce_dtype), fn, "reduce_dtype"));
  r.checkpoint_every = c.checkpoint_every;
  r.batch_size = c.batch_size;
  r.seq_len = c.seq_len;
  r.micro_batches = c.micro_batches;
  r.device_memory_bytes = c.device_memory_bytes;
  FSDP_ASSIGN_OR_RETURN(r.offload.what, ToOffload(EnumValue(c.offload), fn));
  r.offload.budget_bytes = c.offload_budget_bytes;
  return r;
}
}  // namespace

fsdp_error* fsdp_plan_memory(const fsdp_plan_request* request, fsdp_memory_plan* out) {
  static constexpr char fn[] = "fsdp_plan_memory";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_CHECK_OUT(out, "out");
    FSDP_ASSIGN_OR_RETURN(fsdp::PlanRequest r, ToPlanRequest(request, fn));
    FSDP_ASSIGN_OR_RETURN(fsdp::MemoryPlan p, fsdp::PlanMemory(r));
    fsdp_memory_plan c;
    std::memset(&c, 0, sizeof(c));
    c.struct_size = sizeof(c);
    c.param_shard_bytes = p.param_shard_bytes;
    c.grad_shard_bytes = p.grad_shard_bytes;
    c.optimizer_bytes = p.optimizer_bytes;
    c.gathered_param_peak_bytes = p.gathered_param_peak_bytes;
    c.grad_buffer_peak_bytes = p.grad_buffer_peak_bytes;
    c.activation_peak_bytes = p.activation_peak_bytes;
    c.secondary_param_peak_bytes = p.secondary_param_peak_bytes;
    c.peak_bytes = p.peak_bytes;
    c.host_offload_bytes = p.host_offload_bytes;
    c.num_parameters = p.num_parameters;
    c.num_units = p.num_units;
    c.fits = p.fits ? 1 : 0;
    return WriteStruct(out, c, fn, "fsdp_memory_plan");
  });
}

fsdp_error* fsdp_plan_format(const fsdp_plan_request* request, char* buffer, size_t capacity,
                             size_t* length) {
  static constexpr char fn[] = "fsdp_plan_format";
  return Guard(fn, [&]() -> absl::Status {
    FSDP_RETURN_IF_ERROR(CheckText(buffer, capacity, fn));
    FSDP_ASSIGN_OR_RETURN(fsdp::PlanRequest r, ToPlanRequest(request, fn));
    FSDP_ASSIGN_OR_RETURN(fsdp::MemoryPlan p, fsdp::PlanMemory(r));
    WriteText(fsdp::FormatMemoryPlan(p), buffer, capacity, length);
    return absl::OkStatus();
  });
}

}  // extern "C"

static_assert(FSDP_C_API_VERSION_MAJOR == FSDP_C_API_SOVERSION &&
                  FSDP_C_API_VERSION_MINOR == FSDP_C_API_SOMINOR,
              "c_api.h's version and src/capi/CMakeLists.txt's FSDP_C_API_MAJOR/MINOR differ");
