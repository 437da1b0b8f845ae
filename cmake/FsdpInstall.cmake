# install() rules and the exported package: find_package(fsdp CONFIG) -> fsdp::fsdp.
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

# fsdp::report: the harness reports of fsdp/bench_report.h, a library of its own.
install(TARGETS fsdp fsdp_report EXPORT fsdpTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The backends outside the core library that this build has, each its own target and package
# component: fsdp::pjrt, fsdp::cuda (find_package(fsdp COMPONENTS pjrt cuda)), and
# fsdp::backends, which registers them by name in fsdp/registry.h (an object library: its
# registrations run in any program that links it, though nothing names them).
set(FSDP_COMPONENTS "")
set(fsdp_extra_targets fsdp_backends)
if(TARGET fsdp_pjrt)
  list(APPEND fsdp_extra_targets fsdp_pjrt)
  list(APPEND FSDP_COMPONENTS pjrt)
endif()
if(TARGET fsdp_cuda)
  list(APPEND fsdp_extra_targets fsdp_cuda fsdp_caching_allocator)
  list(APPEND FSDP_COMPONENTS cuda)
endif()
foreach(t IN LISTS fsdp_extra_targets)
  string(REGEX REPLACE "^fsdp_" "" name ${t})
  set_target_properties(${t} PROPERTIES EXPORT_NAME ${name})
endforeach()
install(TARGETS ${fsdp_extra_targets} EXPORT fsdpTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  OBJECTS DESTINATION ${CMAKE_INSTALL_LIBDIR}/fsdp/objects
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The headers of the backends this build left out are not installed.
set(fsdp_header_excludes "")
if(NOT TARGET fsdp_pjrt)
  list(APPEND fsdp_header_excludes PATTERN pjrt_backend.h EXCLUDE PATTERN pjrt_client.h EXCLUDE)
endif()
if(NOT TARGET fsdp_cuda)
  list(APPEND fsdp_header_excludes PATTERN cuda_backend.h EXCLUDE)
endif()
install(DIRECTORY include/fsdp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} ${fsdp_header_excludes})
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

# The C API: libfsdp.so (fsdp::c, an export set of its own so that a program in C finds it
# without the C++ dependencies: find_package(fsdp COMPONENTS c)), and fsdp.pc for pkg-config.
# The libraries it was linked with outside the system's directories (CUDA's) stay on its RPATH.
set_target_properties(fsdp_c PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS fsdp_c EXPORT fsdpCTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT fsdpCTargets NAMESPACE fsdp:: FILE fsdpCTargets.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/fsdp)
file(RELATIVE_PATH FSDP_PC_PREFIX "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
string(REGEX REPLACE "/$" "" FSDP_PC_PREFIX "${FSDP_PC_PREFIX}")
configure_file(cmake/fsdp.pc.in ${CMAKE_CURRENT_BINARY_DIR}/fsdp.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/fsdp.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
