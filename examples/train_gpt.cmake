# examples/train_gpt: single-rank GPT training on the embedded corpus (scripts/run_example.sh).
add_executable(train_gpt ${CMAKE_CURRENT_LIST_DIR}/train_gpt.cc)
target_link_libraries(train_gpt PRIVATE fsdp::fsdp absl::flags absl::flags_parse absl::flags_usage)
fsdp_project_warnings(train_gpt)
# --backend pjrt when the PJRT backend is built (backends/pjrt).
if(TARGET fsdp_pjrt)
  target_link_libraries(train_gpt PRIVATE fsdp_pjrt)
  target_compile_definitions(train_gpt PRIVATE FSDP_TRAIN_WITH_PJRT)
endif()
# --backend cuda when the CUDA backend is built (backends/cuda).
if(TARGET fsdp_cuda)
  target_link_libraries(train_gpt PRIVATE fsdp_cuda)
  target_compile_definitions(train_gpt PRIVATE FSDP_TRAIN_WITH_CUDA)
endif()
