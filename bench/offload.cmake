# bench/offload_bench: step time with the optimizer state offloaded to host memory on the sim
# device (a simulated host link), against the step without offload; a device budget too small
# without offload.
add_executable(offload_bench ${CMAKE_CURRENT_LIST_DIR}/offload_bench.cc)
target_link_libraries(offload_bench PRIVATE fsdp::fsdp)
target_include_directories(offload_bench PRIVATE ${PROJECT_SOURCE_DIR})
fsdp_project_warnings(offload_bench)
