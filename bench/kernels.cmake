# Kernel benchmarks (Google Benchmark): the sgemm MFU peak and the CPU kernels at `mini` shapes.
if(benchmark_FOUND)
  # attention_full_square.cc: the attention that keeps the T x T matrix, as the baseline of the
  # blocked kernels; it calls the kernels' private GEMM and softmax (kernels/cpu/*.h).
  add_executable(kernels_bench ${CMAKE_CURRENT_LIST_DIR}/kernels_bench.cc
                               ${CMAKE_CURRENT_LIST_DIR}/attention_full_square.cc)
  target_include_directories(kernels_bench PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(kernels_bench PRIVATE fsdp::fsdp benchmark::benchmark OpenMP::OpenMP_CXX)
  fsdp_project_warnings(kernels_bench)
endif()
