# bench/pjrt_bench: the PJRT backend's per-launch overhead, compile time and step time next to
# the CPU backend (built with the PJRT backend).
if(TARGET fsdp_pjrt)
  add_executable(pjrt_bench ${CMAKE_CURRENT_LIST_DIR}/pjrt_bench.cc)
  target_link_libraries(pjrt_bench PRIVATE fsdp::fsdp fsdp_pjrt)
  target_include_directories(pjrt_bench PRIVATE ${PROJECT_SOURCE_DIR})
  fsdp_project_warnings(pjrt_bench)
endif()
