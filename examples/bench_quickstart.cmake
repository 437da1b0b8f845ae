# examples/bench_quickstart: a harness that calls fsdp::RunBench and reads the figures.
add_executable(bench_quickstart ${CMAKE_CURRENT_LIST_DIR}/bench_quickstart.cc)
target_link_libraries(bench_quickstart PRIVATE fsdp::fsdp fsdp::report)
fsdp_project_warnings(bench_quickstart)
