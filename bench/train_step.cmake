# bench/train_step_bench: one rank's GPT training step time, tokens/s and MFU (plain main).
add_executable(train_step_bench ${CMAKE_CURRENT_LIST_DIR}/train_step_bench.cc)
target_link_libraries(train_step_bench PRIVATE fsdp::fsdp)
fsdp_project_warnings(train_step_bench)
