// Emulation shim (tests/cuda_emu/cuda_emu.h): shadows the CUDA toolkit's <cuda_runtime_api.h> for the
// targets that put tests/cuda_emu/shim first on their include path.
#pragma once
#include "../cuda_emu.h"
