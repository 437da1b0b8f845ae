# bench/checkpoint_bench: how long a synchronous and a background save (AsyncCheckpointer) stop
# training, on ranks as threads or under mpirun (docs/checkpoints.md, "Asynchronous saves").
add_executable(checkpoint_bench ${CMAKE_CURRENT_LIST_DIR}/checkpoint_bench.cc)
target_link_libraries(checkpoint_bench PRIVATE fsdp::fsdp absl::flags absl::flags_parse
                      absl::flags_usage absl::flags_reflection)
target_include_directories(checkpoint_bench PRIVATE ${PROJECT_SOURCE_DIR})
fsdp_project_warnings(checkpoint_bench)
