# collectives_bench: nccl-tests style bandwidth of the local and mpi communicators, next to
# memcpy and Open MPI's own collectives (bench/collectives_bench.cc). Links fsdp_collectives only.
add_executable(collectives_bench ${CMAKE_CURRENT_LIST_DIR}/collectives_bench.cc)
target_link_libraries(collectives_bench PRIVATE fsdp_collectives absl::flags absl::flags_parse
                      absl::flags_usage)
target_include_directories(collectives_bench PRIVATE ${PROJECT_SOURCE_DIR})
if(FSDP_WITH_MPI)
  target_compile_definitions(collectives_bench PRIVATE FSDP_BENCH_WITH_MPI)
  target_link_libraries(collectives_bench PRIVATE MPI::MPI_CXX)
endif()
fsdp_project_warnings(collectives_bench)
