# examples/train_gpt: GPT / Llama training with sharding on the embedded corpus
# (scripts/run_example.sh). Every backend this build has comes through the registry.
add_executable(train_gpt ${CMAKE_CURRENT_LIST_DIR}/train_gpt.cc
                         ${CMAKE_CURRENT_LIST_DIR}/train_gpt_settings.cc)
target_include_directories(train_gpt PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(train_gpt PRIVATE fsdp::fsdp fsdp::backends absl::flags absl::flags_parse
                                        absl::flags_usage)
fsdp_project_warnings(train_gpt)
