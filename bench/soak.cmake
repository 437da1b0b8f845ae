# bench/soak_bench: a long FULL_SHARD run twice: resident memory growth, bytes held between
# steps, bitwise reproducibility (not part of CI's default path: minutes of run time).
add_executable(soak_bench ${CMAKE_CURRENT_LIST_DIR}/soak_bench.cc)
target_link_libraries(soak_bench PRIVATE fsdp::fsdp)
fsdp_project_warnings(soak_bench)
