# bench/overlap_bench: FULL_SHARD step time with a simulated link, with and without prefetch.
add_executable(overlap_bench ${CMAKE_CURRENT_LIST_DIR}/overlap_bench.cc)
target_link_libraries(overlap_bench PRIVATE fsdp::fsdp)
fsdp_project_warnings(overlap_bench)
