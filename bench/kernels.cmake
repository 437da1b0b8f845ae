# Kernel benchmarks (Google Benchmark): the sgemm MFU peak and the CPU kernels at `mini` shapes.
if(benchmark_FOUND)
  add_executable(kernels_bench ${CMAKE_CURRENT_LIST_DIR}/kernels_bench.cc)
  target_link_libraries(kernels_bench PRIVATE fsdp::fsdp benchmark::benchmark OpenMP::OpenMP_CXX)
  fsdp_project_warnings(kernels_bench)
endif()
