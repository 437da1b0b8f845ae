/* The C API of libfsdp: sharded data-parallel training (FSDP / ZeRO) for any language that can
 * call C (C, Rust, Julia, Go, Python through ctypes, C++ built with another toolchain).
 *
 * C99, no C++ types. The shared library libfsdp.so (SONAME libfsdp.so.<FSDP_C_API_VERSION_MAJOR>)
 * exports exactly the fsdp_* functions declared here; everything else in it is hidden.
 * docs/c_api.md has a complete example, in C and in Python.
 *
 * Conventions (the PJRT C API's):
 * - Handles are opaque pointers. Each kind has a destroy function; destroying NULL is a no-op.
 *   Passing NULL, a handle of another kind, or a destroyed handle where a handle is expected is
 *   an FSDP_CODE_INVALID_ARGUMENT error, never a crash (a destroyed handle's address is never
 *   reused for another handle).
 * - Every function that can fail returns an fsdp_error* : NULL on success, else an error the
 *   caller owns and frees with fsdp_error_destroy. Its code is absl::StatusCode's (which is
 *   gRPC's); its message says what was wrong and what to do. Out-parameters are written only on
 *   success. Nothing throws or aborts across this boundary.
 * - Argument structs begin with `struct_size` (set it to sizeof the struct, or use the
 *   matching *_init function, which sets it and every default). The library reads only the
 *   fields inside struct_size: a program compiled against an older header, whose struct is
 *   shorter, gets the defaults for the fields added since. Structs the library writes (views,
 *   statistics, reports) are written up to the caller's struct_size.
 * - Booleans are int (0 false, anything else true). Sizes and element counts are int64_t.
 * - Thread safety: a world, backend or runtime handle belongs to one rank and is used by one
 *   thread at a time (the rank's thread); different ranks' handles may be used concurrently.
 *   Functions without a handle (version, errors, planner, thread worlds) are thread-safe.
 */
#ifndef FSDP_C_API_H_
#define FSDP_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- version ------------------------------------------------------------------------------ */
/* The major version changes when a function or a struct field changes meaning or is removed
 * (the SONAME carries it); the minor version when something is added (a function, an enum value,
 * a field at the end of a struct). A program built against header (M, m) runs with any library
 * (M, m') whose m' >= m. */
#define FSDP_C_API_VERSION_MAJOR 0
#define FSDP_C_API_VERSION_MINOR 2
#define FSDP_C_API_VERSION ((FSDP_C_API_VERSION_MAJOR << 16) | FSDP_C_API_VERSION_MINOR)

/* The library's (major << 16) | minor, to compare with FSDP_C_API_VERSION. */
uint32_t fsdp_api_version(void);
/* "libfsdp <project version> (C API <major>.<minor>)"; a static string. */
const char* fsdp_version_string(void);

/* ---- errors ------------------------------------------------------------------------------- */
typedef enum fsdp_code {
  FSDP_CODE_OK = 0,
  FSDP_CODE_CANCELLED = 1,
  FSDP_CODE_UNKNOWN = 2,
  FSDP_CODE_INVALID_ARGUMENT = 3,
  FSDP_CODE_DEADLINE_EXCEEDED = 4,
  FSDP_CODE_NOT_FOUND = 5,
  FSDP_CODE_ALREADY_EXISTS = 6,
  FSDP_CODE_PERMISSION_DENIED = 7,
  FSDP_CODE_RESOURCE_EXHAUSTED = 8,
  FSDP_CODE_FAILED_PRECONDITION = 9,
  FSDP_CODE_ABORTED = 10,
  FSDP_CODE_OUT_OF_RANGE = 11,
  FSDP_CODE_UNIMPLEMENTED = 12,
  FSDP_CODE_INTERNAL = 13,
  FSDP_CODE_UNAVAILABLE = 14,
  FSDP_CODE_DATA_LOSS = 15,
  FSDP_CODE_UNAUTHENTICATED = 16
} fsdp_code;

typedef struct fsdp_error fsdp_error;
/* The code of `error` (FSDP_CODE_OK for NULL). */
fsdp_code fsdp_error_code(const fsdp_error* error);
/* Its message, valid until fsdp_error_destroy ("" for NULL). */
const char* fsdp_error_message(const fsdp_error* error);
/* A new error, for a callback to return (copies `message`). A code of FSDP_CODE_OK or out of
 * range becomes FSDP_CODE_UNKNOWN. */
fsdp_error* fsdp_error_create(fsdp_code code, const char* message);
void fsdp_error_destroy(fsdp_error* error);

/* Text out-parameters: `buffer` of `capacity` bytes receives the text, cut to fit and always
 * NUL-terminated (when capacity > 0); `*length` (when not NULL) receives the whole text's length
 * without the NUL, so a caller can retry with length + 1 bytes. buffer may be NULL with
 * capacity 0 to ask for the length. */

/* ---- data types ----------------------------------------------------------------------------- */
typedef enum fsdp_dtype {
  FSDP_DTYPE_F32 = 0,
  FSDP_DTYPE_BF16 = 1,
  FSDP_DTYPE_F16 = 2,
  FSDP_DTYPE_F64 = 3,
  FSDP_DTYPE_I32 = 4,
  FSDP_DTYPE_I64 = 5,
  FSDP_DTYPE_U8 = 6
} fsdp_dtype;

/* ---- worlds: the ranks and their communicators ---------------------------------------------- */
/* A world handle is one rank's communicator over all ranks of the job. */
typedef struct fsdp_world fsdp_world;

typedef struct fsdp_world_options {
  size_t struct_size;
  /* How long a rank waits for its peers at a collective before the job fails with
   * FSDP_CODE_DEADLINE_EXCEEDED on every rank; <= 0: the library's default (60 s, or
   * $FSDP_COMM_TIMEOUT_S seconds). */
  double timeout_seconds;
} fsdp_world_options;
void fsdp_world_options_init(fsdp_world_options* options);

/* Ranks as threads of this process. The body of rank r runs on a thread of its own with the
 * world handle of rank r (valid until the body returns; do not destroy it). The call returns
 * when every body has, with the first error in rank order (the bodies' own errors are taken
 * over by the library), or NULL. A failing rank makes its peers' collectives fail rather than
 * wait forever. options may be NULL. 1 <= size <= 4096. */
typedef fsdp_error* (*fsdp_rank_body)(fsdp_world* world, void* user);
fsdp_error* fsdp_run_threads(int size, const fsdp_world_options* options, fsdp_rank_body body,
                             void* user);

/* The same world for callers that start the threads themselves (Python's threading): create
 * it once, then each thread takes its rank's handle (each rank once) and destroys it when done.
 * The group may be destroyed while ranks still use their handles. */
typedef struct fsdp_thread_group fsdp_thread_group;
fsdp_error* fsdp_thread_group_create(int size, const fsdp_world_options* options,
                                     fsdp_thread_group** out);
fsdp_error* fsdp_thread_group_take_rank(fsdp_thread_group* group, int rank, fsdp_world** out);
/* The world ranks a group holds: first .. first + count - 1 (0 .. size - 1 for ranks as
 * threads; this process's ranks for fsdp_mpi_thread_group_create). Since C API 0.2. */
fsdp_error* fsdp_thread_group_ranks(const fsdp_thread_group* group, int* first, int* count);
void fsdp_thread_group_destroy(fsdp_thread_group* group);

/* Processes under mpirun, each playing `threads` ranks as threads (a backend with several devices
 * per process: a PJRT client's chips, a host's GPUs): one world of processes x threads ranks,
 * world rank = process rank * threads + t (transport "mpi_threads": groups inside a process
 * through memory, across processes through MPI). Collective over the processes, each passing
 * the same `threads` (else FSDP_CODE_INVALID_ARGUMENT). fsdp_run_mpi_threads runs `body` for
 * each of this process's ranks on a thread of its own, as fsdp_run_threads does;
 * fsdp_mpi_thread_group_create is the same world for callers that start the threads themselves:
 * take each of this process's ranks (fsdp_thread_group_ranks) with fsdp_thread_group_take_rank.
 * FSDP_CODE_UNIMPLEMENTED in a build without MPI. Since C API 0.2. */
fsdp_error* fsdp_run_mpi_threads(int threads, const fsdp_world_options* options,
                                 fsdp_rank_body body, void* user);
fsdp_error* fsdp_mpi_thread_group_create(int threads, const fsdp_world_options* options,
                                         fsdp_thread_group** out);

/* Processes under mpirun: the world of MPI_COMM_WORLD (MPI is initialised by the library with
 * MPI_THREAD_MULTIPLE if the program has not; groups inside a host move data through shared
 * memory). Collective over the processes. FSDP_CODE_UNIMPLEMENTED in a build without MPI. */
fsdp_error* fsdp_world_create_mpi(const fsdp_world_options* options, fsdp_world** out);
/* The same over the caller's own communicator: `mpi_comm` points to an MPI_Comm (&comm in C;
 * MPI._addressof(comm) from mpi4py), e.g. one group of an MPI_Comm_split: collective over its
 * processes, which become the world's ranks in their order there. The library works on
 * duplicates; the caller keeps its communicator. A caller that initialised MPI itself and goes
 * on calling it must have asked for MPI_THREAD_MULTIPLE. */
fsdp_error* fsdp_world_create_mpi_comm(const void* mpi_comm, const fsdp_world_options* options,
                                       fsdp_world** out);
/* Finalises MPI after the last MPI world is destroyed (call once, at the end of the program;
 * a no-op without MPI). MPI_Finalize waits for every peer, also a dead or stopped one: after a
 * failure use fsdp_mpi_finish instead. */
void fsdp_mpi_shutdown(void);
/* The end of an MPI program: `return fsdp_mpi_finish(status, "trainer");`. When `status` is NULL
 * and no MPI world failed, shuts MPI down (fsdp_mpi_shutdown) and returns 0. Otherwise prints
 * "<program>: [rank R] <error>" to stderr and aborts the job (MPI_Abort), so that mpirun ends
 * every process at once, also one that hangs or was stopped; it does not return then. Without
 * MPI: 0 for NULL, else prints the error and returns 1. Does not take `status`. */
int fsdp_mpi_finish(const fsdp_error* status, const char* program);

/* Destroys a world made by fsdp_world_create_mpi or fsdp_thread_group_take_rank (not one
 * handed to an fsdp_run_threads body). Every runtime made over it must be destroyed first. */
void fsdp_world_destroy(fsdp_world* world);
fsdp_error* fsdp_world_rank(const fsdp_world* world, int* rank);
fsdp_error* fsdp_world_size(const fsdp_world* world, int* size);
/* Fails the world on every rank: its collectives in flight and later ones return `reason`
 * (a rank that gives up tells its peers, which would otherwise wait for it until the timeout).
 * Does not take `reason`; NULL: FSDP_CODE_ABORTED. fsdp_run_threads does this for a body that
 * returns an error. */
fsdp_error* fsdp_world_abort(fsdp_world* world, const fsdp_error* reason);
/* Collective: the hosts the ranks run on; ranks_per_host is 0 when hosts hold different numbers
 * of ranks or ranks that are not consecutive. */
fsdp_error* fsdp_world_host_layout(fsdp_world* world, int* num_hosts, int* ranks_per_host);
/* Collective: FSDP_CODE_INVALID_ARGUMENT on every rank when ranks were given different
 * settings (name/value pairs, in order), naming the first that differs, a rank, and both
 * values; `context` (may be NULL) starts the message. */
typedef struct fsdp_key_value {
  const char* key;
  const char* value;
} fsdp_key_value;
fsdp_error* fsdp_world_check_same_settings(fsdp_world* world, const fsdp_key_value* settings,
                                           size_t count, const char* context);
/* Collective: NULL on every rank when every rank passed NULL; else on every rank a copy of the
 * lowest failing rank's error ("rank R: ..."). Does not take `local`. */
fsdp_error* fsdp_world_agree(fsdp_world* world, const fsdp_error* local);

/* ---- backends ------------------------------------------------------------------------------- */
typedef struct fsdp_backend fsdp_backend;

/* The names of the backends this library has, comma-separated ("cpu, cuda, pjrt, sim"). */
fsdp_error* fsdp_backend_names(char* buffer, size_t capacity, size_t* length);
/* A backend by name (the registry's: cpu, sim, pjrt, cuda) for rank `rank` of this process,
 * with its options as key/value pairs (e.g. {"plugin", "/path/xla_cpu_pjrt.so"}; docs/backends
 * .md lists each backend's keys; an unknown key is an error that lists the known ones). */
fsdp_error* fsdp_backend_create(const char* name, const fsdp_key_value* options, size_t count,
                                int rank, fsdp_backend** out);
/* The devices backend `name` has in this process with these options (a PJRT plugin's devices,
 * the GPUs), or -1 when it has no fixed number (cpu, sim: any number of ranks share the host).
 * An error says why the backend cannot run here. */
fsdp_error* fsdp_backend_device_count(const char* name, const fsdp_key_value* options,
                                      size_t count, int* devices);
/* Every runtime using the backend must be destroyed first. */
void fsdp_backend_destroy(fsdp_backend* backend);
fsdp_error* fsdp_backend_name(const fsdp_backend* backend, char* buffer, size_t capacity,
                              size_t* length);
/* Whether the host reaches the backend's memory directly (cpu): then views carry host
 * pointers. */
fsdp_error* fsdp_backend_is_host(const fsdp_backend* backend, int* is_host);
/* Bytes allocated now and at peak since the last reset. */
fsdp_error* fsdp_backend_memory(const fsdp_backend* backend, int64_t* in_use, int64_t* peak);
/* Waits for everything queued on the backend's streams. */
fsdp_error* fsdp_backend_synchronize(fsdp_backend* backend);

/* A window of a backend's memory: `count` elements of `dtype`. On a host backend `host` points
 * at the first element; on a device it is NULL and `address` + `offset` is the device address
 * (a CUDA device pointer on the cuda backend; on pjrt an opaque identifier: PJRT gives no
 * pointer into a buffer). `storage` and `allocation_bytes` identify the allocation to the
 * backend. Views do not own memory: a hook's view is valid until the next hook on the unit. */
typedef struct fsdp_view {
  size_t struct_size;
  void* host;
  void* address;
  void* storage;
  uint64_t allocation_bytes;
  int64_t offset; /* bytes from address */
  int64_t count;  /* elements */
  fsdp_dtype dtype;
} fsdp_view;

/* Copies a view to host memory (`bytes` must be the view's) and back, on the backend's
 * compute stream; copy_to_host waits for the data. */
fsdp_error* fsdp_view_copy_to_host(fsdp_backend* backend, const fsdp_view* view, void* dst,
                                   int64_t bytes);
fsdp_error* fsdp_view_copy_from_host(fsdp_backend* backend, const fsdp_view* view,
                                     const void* src, int64_t bytes);
/* A view of the caller's host memory (`count` elements of `dtype` at `pointer`), on a host
 * backend; FSDP_CODE_FAILED_PRECONDITION on a device backend. The memory must outlive its
 * uses. */
fsdp_error* fsdp_backend_wrap_host_memory(fsdp_backend* backend, void* pointer, int64_t count,
                                          fsdp_dtype dtype, fsdp_view* out);
/* Adopting native memory: a view of memory the caller allocated with the device runtime (on
 * cuda a device pointer of the backend's GPU, cudaMalloc'd), which the library never frees; on
 * a host backend the same as fsdp_backend_wrap_host_memory. FSDP_CODE_UNIMPLEMENTED on sim and
 * pjrt (PJRT buffers are opaque: copy in with fsdp_view_copy_from_host). */
fsdp_error* fsdp_backend_wrap_native_memory(fsdp_backend* backend, void* pointer, int64_t count,
                                            fsdp_dtype dtype, fsdp_view* out);
/* Exporting a native handle: the backend's stream (0 compute, 1 communication), a cudaStream_t
 * on the cuda backend, for a framework to issue its kernels in the runtime's order.
 * FSDP_CODE_UNIMPLEMENTED where the backend has none (cpu, sim: their streams are the library's
 * own; pjrt: PJRT exposes no stream). Adopting the framework's stream instead: the cuda
 * backend's option {"compute_stream", "0x..."} (its address, as text) at fsdp_backend_create. */
fsdp_error* fsdp_backend_native_stream(fsdp_backend* backend, int stream, void** out);

/* ---- the sharding runtime ------------------------------------------------------------------- */
typedef enum fsdp_strategy {
  FSDP_FULL_SHARD = 0,
  FSDP_SHARD_GRAD_OP = 1,
  FSDP_NO_SHARD = 2,
  FSDP_HYBRID_SHARD = 3,
  FSDP_HYBRID_SHARD_GRAD_OP = 4
} fsdp_strategy;

typedef enum fsdp_optimizer { FSDP_OPTIMIZER_ADAMW = 0, FSDP_OPTIMIZER_SGD = 1 } fsdp_optimizer;
typedef enum fsdp_nonfinite { FSDP_NONFINITE_ERROR = 0, FSDP_NONFINITE_SKIP = 1 } fsdp_nonfinite;
typedef enum fsdp_offload {
  FSDP_OFFLOAD_NONE = 0,
  FSDP_OFFLOAD_OPTIMIZER = 1,
  FSDP_OFFLOAD_ALL = 2
} fsdp_offload;

/* fsdp/sharding.h's ShardingOptions, field by field (its comments say what each does). */
typedef struct fsdp_sharding_options {
  size_t struct_size;
  fsdp_strategy strategy;    /* FSDP_FULL_SHARD */
  int hybrid_shard_size;     /* 0: the ranks of one host */
  int forward_prefetch;      /* 1 */
  int backward_prefetch;     /* 1 */
  int max_prefetch_units;    /* 1 */
  fsdp_dtype param_dtype;    /* FSDP_DTYPE_F32 */
  fsdp_dtype reduce_dtype;   /* FSDP_DTYPE_F32 */
  int dynamic_loss_scale;    /* 0 */
  float initial_loss_scale;  /* 65536 */
  float max_grad_norm;       /* 0: no clipping */
  fsdp_optimizer optimizer;  /* FSDP_OPTIMIZER_ADAMW */
  float adamw_beta1;         /* 0.9 */
  float adamw_beta2;         /* 0.95 */
  float adamw_eps;           /* 1e-8 */
  float weight_decay;        /* AdamW 0.1, SGD 0 when left at the init value (< 0) */
  float sgd_momentum;        /* 0 */
  fsdp_nonfinite nonfinite;  /* FSDP_NONFINITE_ERROR */
  /* Added in 0.1 at the end, as later fields will be. */
  fsdp_offload offload;         /* FSDP_OFFLOAD_NONE */
  int64_t offload_budget_bytes; /* < 0: every unit */
} fsdp_sharding_options;
void fsdp_sharding_options_init(fsdp_sharding_options* options);

typedef struct fsdp_runtime fsdp_runtime;
/* Collective over `world`; the options must be the same on every rank (else an error on every
 * rank naming the option). `backend` and `world` must outlive the runtime. */
fsdp_error* fsdp_runtime_create(fsdp_backend* backend, fsdp_world* world,
                                const fsdp_sharding_options* options, fsdp_runtime** out);
void fsdp_runtime_destroy(fsdp_runtime* runtime);

/* A parameter of a unit. */
typedef struct fsdp_param {
  size_t struct_size;
  const char* name;
  const int64_t* shape;
  int ndim;
  int requires_grad; /* 1; 0: frozen */
  int weight_decay;  /* -1: by rank (tensors of 2+ dimensions), 0 off, 1 on */
} fsdp_param;
void fsdp_param_init(fsdp_param* param);

/* Registers a unit of parameters (their elements are laid out one after another in a flat
 * buffer, in this order); `*unit` receives its index (0, 1, ... in registration order).
 * Parameter names are unique across all units (checkpoints and exports name tensors by them):
 * a name used twice is FSDP_CODE_ALREADY_EXISTS. A refused registration (a dimension < 1, a
 * name used twice) fails the runtime, as a hook out of order does. */
fsdp_error* fsdp_runtime_register_unit(fsdp_runtime* runtime, const char* name,
                                       const fsdp_param* params, size_t count, int* unit);
/* Fills elements [begin, end) of parameter `param` of unit `unit` into `out` (end - begin
 * floats); return NULL, or an error that stops finalize. */
typedef fsdp_error* (*fsdp_init_fn)(void* user, int unit, int param, int64_t begin, int64_t end,
                                    float* out);
/* Collective: checks that every rank registered the same units and allocates the shards, filled
 * through `init` (called for the pieces inside this rank's shard only); init NULL: zeros. */
fsdp_error* fsdp_runtime_finalize(fsdp_runtime* runtime, fsdp_init_fn init, void* user);

fsdp_error* fsdp_runtime_num_units(const fsdp_runtime* runtime, int* count);
/* Parameter `index` of unit `unit`: its offset (elements) in the unit's flat buffer and its
 * element count; `name` gets its name (a text out-parameter, may be NULL). */
fsdp_error* fsdp_runtime_unit_param(const fsdp_runtime* runtime, int unit, int index,
                                    int64_t* offset, int64_t* numel, char* name, size_t capacity,
                                    size_t* length);
fsdp_error* fsdp_runtime_unit_numel(const fsdp_runtime* runtime, int unit, int64_t* numel);

/* What a hook hands over: the unit's gathered parameters (in param_dtype) and, in backward, the
 * f32 gradient buffer of the same layout to accumulate (+=) into (grads.count 0 in forward). */
typedef struct fsdp_unit_view {
  size_t struct_size;
  int unit;
  int64_t numel;
  fsdp_view params;
  fsdp_view grads;
} fsdp_unit_view;

/* The hooks, in fsdp/sharding.h's order. The order is checked: a hook out of order is an
 * FSDP_CODE_FAILED_PRECONDITION error before any data is touched, and it fails the runtime and
 * its world on every rank (a peer must not wait in a collective for a rank that went astray):
 * destroy them and start again. A unit that does not exist is FSDP_CODE_OUT_OF_RANGE. `out`
 * may be NULL; a wrong out->struct_size is refused before the hook runs. */
fsdp_error* fsdp_pre_forward(fsdp_runtime* runtime, int unit, fsdp_unit_view* out);
fsdp_error* fsdp_post_forward(fsdp_runtime* runtime, int unit);
fsdp_error* fsdp_pre_backward(fsdp_runtime* runtime, int unit, fsdp_unit_view* out);
fsdp_error* fsdp_post_backward(fsdp_runtime* runtime, int unit);
fsdp_error* fsdp_finish_backward(fsdp_runtime* runtime);
fsdp_error* fsdp_finish_forward_only(fsdp_runtime* runtime);

typedef struct fsdp_step_stats {
  size_t struct_size;
  double grad_norm;       /* global L2 norm before clipping */
  float clip_coefficient; /* what the gradients were multiplied by */
  float lr;
  int64_t step;  /* optimizer steps taken, this one included */
  int skipped;   /* inf/NaN gradients on some rank: no update */
  int nonfinite;
  float loss_scale; /* what the next backward multiplies the loss gradient by */
} fsdp_step_stats;
/* Clips, updates every local shard with learning rate `lr`, zeroes the gradients. `out` may be
 * NULL (else set its struct_size). */
fsdp_error* fsdp_step(fsdp_runtime* runtime, float lr, fsdp_step_stats* out);

/* no_sync: while 0, backward passes accumulate whole gradients locally. */
fsdp_error* fsdp_set_sync_gradients(fsdp_runtime* runtime, int sync);
/* HYBRID strategies: while 0, backward passes reduce inside the shard group only. */
fsdp_error* fsdp_set_requires_all_reduce(fsdp_runtime* runtime, int all_reduce);
/* The model's activation bytes, for the memory report. */
fsdp_error* fsdp_set_activation_bytes(fsdp_runtime* runtime, int64_t bytes);
fsdp_error* fsdp_runtime_loss_scale(const fsdp_runtime* runtime, float* scale);
fsdp_error* fsdp_runtime_steps(const fsdp_runtime* runtime, int64_t* steps);
/* Collective over the shard group: the whole unit's f32 parameters (numel floats, `capacity`
 * floats of room) into `out`. */
fsdp_error* fsdp_runtime_gather_unit(fsdp_runtime* runtime, int unit, float* out,
                                     int64_t capacity);

/* fsdp/sharding.h's MemoryReport: bytes per rank. */
typedef struct fsdp_memory_report {
  size_t struct_size;
  int64_t param_shard_bytes;
  int64_t grad_shard_bytes;
  int64_t optimizer_bytes;
  int64_t gathered_param_bytes;
  int64_t gathered_param_peak_bytes;
  int64_t grad_buffer_bytes;
  int64_t grad_buffer_peak_bytes;
  int64_t activation_peak_bytes;
  int64_t secondary_param_bytes;
  int64_t secondary_param_peak_bytes;
  int64_t peak_bytes;
  int64_t host_offload_bytes;
  int offloaded_units;
} fsdp_memory_report;
fsdp_error* fsdp_runtime_memory(const fsdp_runtime* runtime, fsdp_memory_report* out);
/* Restarts the report's peaks. */
fsdp_error* fsdp_runtime_reset_peaks(fsdp_runtime* runtime);

/* ---- checkpoints ---------------------------------------------------------------------------- */
/* Collective: fsdp/checkpoint.h's SaveCheckpoint (a directory that appears complete or not at
 * all; an existing complete one is replaced only with `overwrite`). */
fsdp_error* fsdp_checkpoint_save(fsdp_runtime* runtime, const char* dir, int overwrite);
/* Collective: LoadCheckpoint, on any world size or strategy (resharding); the step reached is
 * written to `step` (may be NULL). load_optimizer_state 0: parameters only. */
fsdp_error* fsdp_checkpoint_load(fsdp_runtime* runtime, const char* dir, int load_optimizer_state,
                                 int64_t* step);
/* Collective: every parameter to one safetensors file (f32, bf16 or f16), rank 0 writes. */
fsdp_error* fsdp_safetensors_export(fsdp_runtime* runtime, const char* path, fsdp_dtype dtype);
/* Collective: parameters from a safetensors file, index or Hugging Face directory. */
fsdp_error* fsdp_safetensors_import(fsdp_runtime* runtime, const char* path,
                                    int ignore_extra_tensors);

/* ---- the bundled models (MODEL_SPEC.md: GPT-2 and Llama 2) ----------------------------------- */
/* A bundled model trained with sharding (fsdp/nn/sharded_model.h): its forward and backward run
 * through the same hooks, on a backend that has the model ops (cpu, sim, pjrt, cuda). */
typedef struct fsdp_model fsdp_model;

typedef struct fsdp_model_options {
  size_t struct_size;
  const char* config;   /* "nano", "mini", "gpt2", ..., "llama-nano", "llama2-7b" (NULL: "nano") */
  int batch_size;       /* B, sequences per rank and micro-batch: 8 */
  int seq_len;          /* T: 64 */
  uint64_t seed;        /* parameter initialisation: 1337 */
  int checkpoint_every; /* activation checkpointing of every k-th block; 0: none */
} fsdp_model_options;
void fsdp_model_options_init(fsdp_model_options* options);

/* Collective over `world`. `backend` and `world` must outlive the model. */
fsdp_error* fsdp_model_create(fsdp_backend* backend, fsdp_world* world,
                              const fsdp_sharding_options* sharding,
                              const fsdp_model_options* options, fsdp_model** out);
void fsdp_model_destroy(fsdp_model* model);
/* The model's vocabulary size, block size (longest sequence) and parameter count. */
fsdp_error* fsdp_model_info(const fsdp_model* model, int* vocab_size, int* block_size,
                            int64_t* num_parameters);
/* One micro-batch on this rank: forward, loss, backward. `inputs` and `targets` are B x T token
 * ids (`count` = B * T each, in [0, vocab_size)); `loss` (may be NULL) gets this rank's mean
 * loss. Gradients accumulate until fsdp_model_step. */
fsdp_error* fsdp_model_forward_backward(fsdp_model* model, const int32_t* inputs,
                                        const int32_t* targets, int64_t count, float* loss);
/* Forward only (evaluation): this rank's mean loss. */
fsdp_error* fsdp_model_forward(fsdp_model* model, const int32_t* inputs, const int32_t* targets,
                               int64_t count, float* loss);
fsdp_error* fsdp_model_step(fsdp_model* model, float lr, fsdp_step_stats* out);
/* The model's runtime, for set_sync_gradients, the memory report and checkpoints. The handle is
 * the model's: valid until fsdp_model_destroy; fsdp_runtime_destroy ignores it. */
fsdp_error* fsdp_model_runtime(fsdp_model* model, fsdp_runtime** out);

/* ---- the planner ---------------------------------------------------------------------------- */
/* fsdp/plan.h's PlanRequest for a bundled model configuration. */
typedef struct fsdp_plan_request {
  size_t struct_size;
  const char* model;       /* "nano" ... "llama2-70b" (NULL: "nano") */
  int world_size;          /* 1 */
  int ranks_per_host;      /* 0: one host */
  fsdp_strategy strategy;  /* FSDP_FULL_SHARD */
  int hybrid_shard_size;   /* 0 */
  fsdp_dtype param_dtype;  /* F32 */
  fsdp_dtype reduce_dtype; /* F32 */
  int checkpoint_every;    /* 0: no activation checkpointing; 1 every block */
  int batch_size;          /* 1 */
  int seq_len;             /* 0: the model's block size */
  int micro_batches;       /* 1 */
  int64_t device_memory_bytes; /* 0: unknown */
  fsdp_offload offload;        /* NONE */
  int64_t offload_budget_bytes; /* < 0: every unit */
} fsdp_plan_request;
void fsdp_plan_request_init(fsdp_plan_request* request);

typedef struct fsdp_memory_plan {
  size_t struct_size;
  int64_t param_shard_bytes;
  int64_t grad_shard_bytes;
  int64_t optimizer_bytes;
  int64_t gathered_param_peak_bytes;
  int64_t grad_buffer_peak_bytes;
  int64_t activation_peak_bytes;
  int64_t secondary_param_peak_bytes;
  int64_t peak_bytes;
  int64_t host_offload_bytes;
  int64_t num_parameters;
  int num_units;
  int fits; /* peak_bytes <= device_memory_bytes (1 when that is 0) */
} fsdp_memory_plan;
fsdp_error* fsdp_plan_memory(const fsdp_plan_request* request, fsdp_memory_plan* out);
/* The plan as fsdp_plan prints it (a table with a note). */
fsdp_error* fsdp_plan_format(const fsdp_plan_request* request, char* buffer, size_t capacity,
                             size_t* length);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FSDP_C_API_H_ */
