# bench/fsdp_bench: the scaling harness (fsdp/bench.h, docs/scaling.md): a grid of training runs,
# a table, JSON lines, CSV and SVG plots.
add_executable(fsdp_bench ${CMAKE_CURRENT_LIST_DIR}/fsdp_bench.cc ${CMAKE_CURRENT_LIST_DIR}/fsdp_bench_args.cc
                          ${CMAKE_CURRENT_LIST_DIR}/fsdp_bench_project.cc)
target_link_libraries(fsdp_bench PRIVATE fsdp::fsdp fsdp::report absl::flags absl::flags_parse absl::flags_usage
                      absl::flags_reflection)
target_include_directories(fsdp_bench PRIVATE ${PROJECT_SOURCE_DIR})
fsdp_project_warnings(fsdp_bench)
