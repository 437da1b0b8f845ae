// cuda_device_probe PROGRAM [ARGS...]: runs PROGRAM when this process sees a CUDA device;
// otherwise prints "skipped: no CUDA device (...)" and exits 77, which CTest reports as a
// skipped test (the gpu-labelled entries, tests/CMakeLists.txt).
#include <unistd.h>

#include <cstdio>
#include <string>

#include "fsdp/cuda_backend.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: cuda_device_probe PROGRAM [ARGS...]\n");
    return 2;
  }
  const std::string why = fsdp::CudaUnavailableReason();
  if (!why.empty()) {
    std::printf("skipped: %s\n", why.c_str());
    return 77;
  }
  execv(argv[1], argv + 1);
  std::perror("cuda_device_probe: execv");
  return 127;
}
