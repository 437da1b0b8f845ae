// cuda_emu: a small host emulator of the CUDA subset that kernels/cuda/*.cu use, so that the
// kernels run (compiled as C++ with -DFSDP_CUDA_EMULATION) on machines without a GPU and are
// checked against the CPU kernels (tests/backends/cuda_kernels_emulated_test.cc). The shim
// headers in shim/ (cuda_runtime_api.h, cuda_bf16.h, cuda_fp16.h) include this file and shadow
// the CUDA toolkit's for that target only.
//
// What it emulates:
// - launches through FSDP_LAUNCH (kernels/cuda/launch.cuh): the blocks of a grid run one after
//   another (x fastest, then y, z); the threads of a block run as cooperative user-level
//   contexts (ucontext makecontext / swapcontext) on the calling OS thread, each on its own
//   stack (kStackBytes, allocated once with a guard page below it, reused by every launch);
// - __syncthreads(): a block barrier. A thread that reaches it switches to the scheduler,
//   which resumes the other threads round-robin; all wait until every thread of the block that
//   has not returned has arrived (as on sm_70+, returned threads do not count);
// - __shfl_xor_sync / __shfl_down_sync with the full mask: the 32 lanes of a warp write their
//   value into the warp's slot array (double-buffered) and meet at a warp barrier (the same
//   switch-based scheme), then read their source lane's slot; a warp of fewer than 32 threads,
//   or a mask other than 0xffffffff, is reported and aborts;
// - threadIdx, blockIdx, blockDim, gridDim (dim3 / uint3);
// - static __shared__ arrays (__shared__ is `static`: blocks run one at a time, so one copy
//   per kernel is the block's shared memory; it keeps the previous block's values, where a GPU
//   has undefined ones) and dynamic shared memory (FSDP_DYNAMIC_SHARED),
//   a per-launch buffer filled with 0xff bytes (NaN as floats) before each block, so a read of
//   a word no thread wrote shows up;
// - atomicAdd on float / double as a plain add (one OS thread: nothing is concurrent);
// - the intrinsics the kernels call (__fadd_rn and friends, exactly rounded host arithmetic;
//   __float_as_uint, __uint_as_float, __int_as_float, __half2float, __ushort_as_half) and the
//   <cmath> functions (expf, logf, ... are the host's);
// - cudaGetLastError / cudaPeekAtLastError with CUDA's launch-configuration errors: a zero
//   grid or block dimension, more than 1024 threads per block, block z > 64, grid y or z >
//   65535 give cudaErrorInvalidConfiguration; dynamic shared memory above 48 KiB without
//   cudaFuncSetAttribute(MaxDynamicSharedMemorySize), or above kMaxOptInSmem, gives
//   cudaErrorInvalidValue. The kernel does not run then, and cudaGetLastError returns (and
//   clears) the last such error;
// - checks CUDA leaves undefined: threads of a block waiting at different barriers (e.g. a
//   __syncthreads in a branch that not all threads take, with a shuffle in the other) abort
//   with "deadlock"; a shuffle in a partial warp or after a lane returned aborts.
//
// What it does not emulate: any concurrency. Threads interleave only at barriers and shuffles,
// in a fixed order, so a data race (a missing __syncthreads, two blocks writing one word) is
// not found, and results do not depend on the schedule. TSan does not help either (one OS
// thread); compute-sanitizer racecheck / synccheck on a GPU does that. Also not emulated:
// streams (every launch runs to completion at once, `stream` is ignored), warp divergence
// (the lanes of a warp are not in lockstep between shuffles), device math accuracy (expf etc.
// are the host libm's, not CUDA's ulp bounds), FMA contraction (nvcc contracts a * b + c by
// default; the host compiler may or may not), the memory model, and device memory (every
// pointer is host memory).
//
// Sanitizers: under ASan the stack switches are annotated (__sanitizer_start_switch_fiber /
// __sanitizer_finish_switch_fiber) and the stacks are 256 KiB; ASan prints its one-line
// warning about swapcontext and works. Under TSan the test skips itself (no annotations, and
// nothing for TSan to find on one OS thread).
#pragma once

#include <ucontext.h>
#include <sys/mman.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <math.h>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define CUDA_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDA_EMU_ASAN 1
#endif
#endif
#ifdef CUDA_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

// ---- CUDA keywords -------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

// ---- runtime types --------------------------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};
struct CUstream_st;
using cudaStream_t = CUstream_st*;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
};
using cudaError = cudaError_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct __half {
  uint16_t bits;
};

namespace cuda_emu {

inline constexpr size_t kStackBytes =
#ifdef CUDA_EMU_ASAN
    256 * 1024;  // ASan's redzones make frames larger
#else
    64 * 1024;
#endif
inline constexpr size_t kDefaultSmem = 48 * 1024;
inline constexpr size_t kMaxOptInSmem = 227 * 1024;  // sm_90 (sm_80: 163 KiB)

[[noreturn]] inline void Fail(const char* what) {
  std::fprintf(stderr, "cuda_emu: %s\n", what);
  std::abort();
}

enum class Wait { kRunnable, kBlockBarrier, kWarpBarrier, kDone };

inline constexpr size_t kGuardBytes = 4096;

struct Fiber {
  Fiber() {
    void* mem = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) Fail("mmap of a thread stack failed");
    mprotect(mem, kGuardBytes, PROT_NONE);  // guard page: a stack overflow faults
    stack = static_cast<char*>(mem) + kGuardBytes;
  }
  ~Fiber() { munmap(static_cast<char*>(stack) - kGuardBytes, kStackBytes + kGuardBytes); }
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  ucontext_t ctx;
  void* stack = nullptr;  // kStackBytes usable, a guard page below
  Wait wait = Wait::kRunnable;
  uint3 tid{0, 0, 0};
  unsigned shuffles = 0;  // shuffles done by this thread in this block
};

// The emulator's state: one launch at a time, on one OS thread.
struct State {
  std::vector<std::unique_ptr<Fiber>> fibers;  // grows to the largest block launched, then reused
  ucontext_t scheduler;
  ucontext_t pristine;         // getcontext once; copied before each makecontext
  bool have_pristine = false;
  Fiber* current = nullptr;
  unsigned nthreads = 0, live = 0, block_arrived = 0;
  unsigned warp_arrived[32] = {}, warp_live[32] = {};
  uint64_t slots[2][32][32] = {};  // [phase][warp][lane]
  void (*body)() = nullptr;        // runs the kernel with the launch's arguments
  std::vector<unsigned char> dynamic_smem;
  cudaError_t last_error = cudaSuccess;
  std::map<const void*, int> max_dynamic_smem;  // cudaFuncSetAttribute
  long launches = 0;
#ifdef CUDA_EMU_ASAN
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
#endif
};
inline State& S() {
  static State s;
  return s;
}
inline uint3 g_thread_idx{0, 0, 0}, g_block_idx{0, 0, 0};
inline dim3 g_block_dim, g_grid_dim;

// ---- context switches (annotated for ASan, which otherwise loses track of the stack) -------
inline void SwitchToScheduler(Fiber* f, bool dying) {
  State& s = S();
#ifdef CUDA_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(dying ? nullptr : &fake, s.sched_stack_bottom,
                                 s.sched_stack_size);
  swapcontext(&f->ctx, &s.scheduler);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)dying;
  swapcontext(&f->ctx, &s.scheduler);
#endif
}
inline void SwitchToFiber(Fiber* f) {
  State& s = S();
  s.current = f;
  g_thread_idx = f->tid;
#ifdef CUDA_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f->stack, kStackBytes);
  swapcontext(&s.scheduler, &f->ctx);
  __sanitizer_finish_switch_fiber(fake, &s.sched_stack_bottom, &s.sched_stack_size);
#else
  swapcontext(&s.scheduler, &f->ctx);
#endif
}

// ---- barriers -------------------------------------------------------------------------------
inline unsigned Warp(const Fiber* f) {
  return (f->tid.x + g_block_dim.x * (f->tid.y + g_block_dim.y * f->tid.z)) / 32u;
}
inline void ReleaseBlockBarrierIfComplete() {
  State& s = S();
  if (s.block_arrived == 0 || s.block_arrived < s.live) return;
  for (unsigned i = 0; i < s.nthreads; ++i)
    if (s.fibers[i]->wait == Wait::kBlockBarrier) s.fibers[i]->wait = Wait::kRunnable;
  s.block_arrived = 0;
}
inline void ReleaseWarpBarrierIfComplete(unsigned w) {
  State& s = S();
  if (s.warp_arrived[w] == 0 || s.warp_arrived[w] < s.warp_live[w]) return;
  for (unsigned i = w * 32; i < s.nthreads && i < w * 32 + 32; ++i)
    if (s.fibers[i]->wait == Wait::kWarpBarrier) s.fibers[i]->wait = Wait::kRunnable;
  s.warp_arrived[w] = 0;
}
inline void BlockBarrier() {
  State& s = S();
  Fiber* f = s.current;
  f->wait = Wait::kBlockBarrier;
  ++s.block_arrived;
  ReleaseBlockBarrierIfComplete();
  SwitchToScheduler(f, false);
}
inline void WarpBarrier(unsigned w) {
  State& s = S();
  Fiber* f = s.current;
  f->wait = Wait::kWarpBarrier;
  ++s.warp_arrived[w];
  ReleaseWarpBarrierIfComplete(w);
  SwitchToScheduler(f, false);
}

// One shuffle: every lane publishes v, meets the others, and reads lane `src` (when valid).
// The slots are double-buffered (a lane's k-th shuffle uses buffer k % 2): a lane writes
// buffer k % 2 again at its shuffle k + 2, which it reaches only after every lane arrived at
// shuffle k + 1, i.e. after every lane read shuffle k's value.
template <typename T>
T Shuffle(unsigned mask, T v, unsigned src, bool valid) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  if (mask != 0xffffffffu) Fail("shuffle with a mask other than 0xffffffff is not emulated");
  State& s = S();
  Fiber* f = s.current;
  const unsigned flat = f->tid.x + g_block_dim.x * (f->tid.y + g_block_dim.y * f->tid.z);
  const unsigned w = flat / 32u;
  if (s.nthreads < w * 32 + 32) Fail("shuffle in a partial warp (block size not a multiple of 32)");
  if (s.warp_live[w] != 32) Fail("shuffle with the full mask after a lane of the warp returned");
  const unsigned phase = f->shuffles++ & 1u;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  s.slots[phase][w][flat % 32u] = bits;
  WarpBarrier(w);
  T r = v;
  if (valid) std::memcpy(&r, &s.slots[phase][w][src], sizeof(T));
  return r;
}

// ---- launches -------------------------------------------------------------------------------
inline void FiberEntry() {
  State& s = S();
#ifdef CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s.sched_stack_bottom, &s.sched_stack_size);
#endif
  s.body();
  Fiber* f = s.current;
  f->wait = Wait::kDone;
  --s.live;
  const unsigned w = Warp(f);
  --s.warp_live[w];
  ReleaseWarpBarrierIfComplete(w);
  ReleaseBlockBarrierIfComplete();
  SwitchToScheduler(f, true);
  Fail("a finished thread was resumed");
}

// Runs one block: every thread from the start of the kernel to its return.
inline void RunBlock() {
  State& s = S();
  const unsigned n = s.nthreads;
  s.live = n;
  s.block_arrived = 0;
  for (unsigned w = 0; w * 32 < n; ++w) {
    s.warp_live[w] = n - w * 32 < 32 ? n - w * 32 : 32;
    s.warp_arrived[w] = 0;
  }
  for (unsigned i = 0; i < n; ++i) {
    Fiber* f = s.fibers[i].get();
    f->ctx = s.pristine;
    f->ctx.uc_stack.ss_sp = f->stack;
    f->ctx.uc_stack.ss_size = kStackBytes;
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, FiberEntry, 0);
    f->wait = Wait::kRunnable;
    f->shuffles = 0;
    f->tid = uint3{i % g_block_dim.x, (i / g_block_dim.x) % g_block_dim.y,
                   i / (g_block_dim.x * g_block_dim.y)};
  }
  if (!s.dynamic_smem.empty()) std::memset(s.dynamic_smem.data(), 0xff, s.dynamic_smem.size());
  while (s.live > 0) {
    bool ran = false;
    for (unsigned i = 0; i < n; ++i) {
      if (s.fibers[i]->wait != Wait::kRunnable) continue;
      ran = true;
      SwitchToFiber(s.fibers[i].get());
    }
    if (!ran) Fail("deadlock: the threads of a block wait at different barriers");
  }
  s.current = nullptr;
}

// getcontext returns twice as far as GCC knows: kept out of line, so that its caller's
// variables are not "clobbered by longjmp" (-Wclobbered).
[[gnu::noinline]] inline void SavePristineContext() {
  getcontext(&S().pristine);
  S().have_pristine = true;
}

inline void Record(cudaError_t e) {
  S().last_error = e;  // the last error, as cudaGetLastError returns it
}

inline bool Configure(const void* kernel, dim3 g, dim3 b, size_t smem) {
  State& s = S();
  const uint64_t nthr = uint64_t{b.x} * b.y * b.z;
  if (g.x == 0 || g.y == 0 || g.z == 0 || b.x == 0 || b.y == 0 || b.z == 0 || nthr > 1024 ||
      b.x > 1024 || b.y > 1024 || b.z > 64 || g.y > 65535 || g.z > 65535) {
    Record(cudaErrorInvalidConfiguration);
    return false;
  }
  const auto opt_in = s.max_dynamic_smem.find(kernel);
  const size_t limit = opt_in == s.max_dynamic_smem.end()
                           ? kDefaultSmem
                           : static_cast<size_t>(opt_in->second);
  if (smem > limit) {
    Record(cudaErrorInvalidValue);
    return false;
  }
  if (!s.have_pristine) SavePristineContext();
  while (s.fibers.size() < nthr) s.fibers.push_back(std::make_unique<Fiber>());
  s.nthreads = static_cast<unsigned>(nthr);
  s.dynamic_smem.assign(smem, 0xff);
  g_block_dim = b;
  g_grid_dim = g;
  ++s.launches;
  return true;
}

template <typename... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;

  // kernel<<<grid, block, smem, stream>>>(args...): converts the arguments to the
  // parameter types once, as CUDA does, then runs every block.
  template <typename... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "wrong number of kernel arguments");
    if (!Configure(reinterpret_cast<const void*>(kernel), grid, block, smem)) return;
    static std::tuple<std::decay_t<P>...>* params = nullptr;
    static void (*fn)(P...) = nullptr;
    std::tuple<std::decay_t<P>...> copy(static_cast<P>(std::forward<A>(args))...);
    auto* saved_params = params;  // launches do not nest, but keep them reentrant anyway
    auto* saved_fn = fn;
    params = &copy;
    fn = kernel;
    S().body = [] { std::apply(fn, *params); };
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          g_block_idx = uint3{x, y, z};
          RunBlock();
        }
    params = saved_params;
    fn = saved_fn;
  }
};
template <typename... P>
Launch<P...> MakeLaunch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                        cudaStream_t) {
  return Launch<P...>{kernel, grid, block, smem};
}

inline void* DynamicShared() { return S().dynamic_smem.data(); }
inline long Launches() { return S().launches; }

// f16 -> f32, exact (as fsdp::F16ToFloat).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant == 0 ? INFINITY : NAN;
    uint32_t u = 0x7f800000u | (mant != 0 ? 0x400000u | (mant << 13) : 0u);
    std::memcpy(&v, &u, 4);
  } else {
    uint32_t u = ((exp + 112u) << 23) | (mant << 13);
    std::memcpy(&v, &u, 4);
  }
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u |= sign;
  std::memcpy(&v, &u, 4);
  return v;
}

}  // namespace cuda_emu

#define threadIdx (::cuda_emu::g_thread_idx)
#define blockIdx (::cuda_emu::g_block_idx)
#define blockDim (::cuda_emu::g_block_dim)
#define gridDim (::cuda_emu::g_grid_dim)

inline void __syncthreads() { ::cuda_emu::BlockBarrier(); }

namespace cuda_emu {
inline unsigned Lane() {
  return (g_thread_idx.x + g_block_dim.x * (g_thread_idx.y + g_block_dim.y * g_thread_idx.z)) %
         32u;
}
}  // namespace cuda_emu
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  const unsigned src = ::cuda_emu::Lane() ^ (static_cast<unsigned>(lane_mask) & 31u);
  return ::cuda_emu::Shuffle(mask, v, src, true);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
  const unsigned src = ::cuda_emu::Lane() + delta;
  return ::cuda_emu::Shuffle(mask, v, src, src < 32u);
}

inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}
inline double atomicAdd(double* p, double v) {
  const double old = *p;
  *p = old + v;
  return old;
}

// Exactly rounded single operations (the host's IEEE arithmetic; never contracted, since
// each is a separate function returning a rounded value).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int __float_as_int(float f) {
  int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
inline float __half2float(__half h) { return ::cuda_emu::HalfToFloat(h.bits); }

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = ::cuda_emu::S().last_error;
  ::cuda_emu::S().last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return ::cuda_emu::S().last_error; }
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
  }
  return "unknown error";
}
template <typename... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > ::cuda_emu::kMaxOptInSmem) {
    ::cuda_emu::Record(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  ::cuda_emu::S().max_dynamic_smem[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
