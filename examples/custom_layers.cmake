# examples/custom_layers: a framework's own layers (Linear + tanh) driven through the sharding
# runtime's per-unit hooks (docs/sharding.md).
add_executable(custom_layers ${CMAKE_CURRENT_LIST_DIR}/custom_layers.cc)
target_link_libraries(custom_layers PRIVATE fsdp::fsdp absl::flags absl::flags_parse
                                            absl::flags_usage)
fsdp_project_warnings(custom_layers)
