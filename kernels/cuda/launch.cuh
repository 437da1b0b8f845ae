// Kernel launches and dynamic shared memory, written so that the kernels compile both with
// nvcc and as plain C++ under the host emulator of tests/cuda_emu (FSDP_CUDA_EMULATION, used
// by tests/backends/cuda_kernels_emulated_test.cc):
//   FSDP_LAUNCH(kernel, grid, block, smem, stream)(args...)
//       is kernel<<<grid, block, smem, stream>>>(args...); a kernel template with several
//       arguments goes in parentheses: FSDP_LAUNCH((K<A, B>), ...);
//   FSDP_DYNAMIC_SHARED(type, name);
//       is extern __shared__ type name[]; (the block's dynamic shared memory).
#pragma once

#ifdef FSDP_CUDA_EMULATION
#define FSDP_LAUNCH(kernel, grid, block, smem, stream) \
  ::cuda_emu::MakeLaunch(kernel, grid, block, smem, stream)
#define FSDP_DYNAMIC_SHARED(type, name) \
  type* const name = static_cast<type*>(::cuda_emu::DynamicShared())
#else
#define FSDP_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#define FSDP_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif
