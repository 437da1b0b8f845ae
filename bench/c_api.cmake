# bench/c_api_bench: a training step through the C API (libfsdp.so) against the same step
# through the C++ API, alternating on the same threads; and the cost of one hook call through
# the C boundary.
add_executable(c_api_bench ${CMAKE_CURRENT_LIST_DIR}/c_api_bench.cc
               ${PROJECT_SOURCE_DIR}/tests/capi/mlp.c)
target_link_libraries(c_api_bench PRIVATE fsdp::fsdp fsdp::c)
target_include_directories(c_api_bench PRIVATE ${PROJECT_SOURCE_DIR})
set_source_files_properties(${PROJECT_SOURCE_DIR}/tests/capi/mlp.c PROPERTIES LANGUAGE C)
fsdp_project_warnings(c_api_bench)
