# install() rules and the exported package: find_package(fsdp CONFIG) -> fsdp::fsdp.
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

# fsdp::report: the harness reports of fsdp/bench_report.h, a library of its own.
install(TARGETS fsdp fsdp_report EXPORT fsdpTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/fsdp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT fsdpTargets NAMESPACE fsdp:: FILE fsdpTargets.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/fsdp)
configure_package_config_file(cmake/fsdpConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/fsdpConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/fsdp)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/fsdpConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/fsdpConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/fsdpConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/fsdp)
