# Compile flags: warnings as errors for the project's own targets, sanitizers, -march.
include_guard(GLOBAL)

if(FSDP_NATIVE)
  set(FSDP_ARCH_FLAGS -march=native)
elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  # x86-64-v3 = AVX2 + FMA + F16C: every x86 server since 2015 (Haswell, Zen 1).
  set(FSDP_ARCH_FLAGS -march=x86-64-v3)
else()
  set(FSDP_ARCH_FLAGS "")
endif()
# C++ only: nvcc takes its own architecture flags (CMAKE_CUDA_ARCHITECTURES).
add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${FSDP_ARCH_FLAGS}>")

if(FSDP_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(FSDP_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT FSDP_SANITIZE STREQUAL "")
  message(FATAL_ERROR "FSDP_SANITIZE must be '', 'address' or 'thread', not '${FSDP_SANITIZE}'")
endif()
set(CMAKE_CXX_FLAGS_RELEASE "-O3 -DNDEBUG")
if(FSDP_SANITIZE STREQUAL "")
  set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "-O2 -g -DNDEBUG")
else()
  # Sanitizer reports need function names and line numbers, which -g1 keeps; full debug
  # information made the sanitizer builds a fifth slower to compile and link. -O1, the level
  # the sanitizers' documentation suggests: UBSan's checks at -O2 made the library's files
  # 1.6x slower to compile than at -O1 (src/fsdp/sharding_runtime.cc: 97 s against 61 s on a
  # busy core), and the sanitizer builds are most of CI's cold time.
  set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "-O1 -g1 -DNDEBUG")
endif()
# fsdp_test_compile_options(target): test sources compile at -O1 in the optimised builds (a
# third less compile time than -O3 in Release, half of -O2's for GoogleTest's expansions under
# a sanitizer); the library they link, whose code the tests exercise and spend their time in,
# keeps the build's level (-O3 in Release, -O2 in RelWithDebInfo, -O1 under a sanitizer).
# Under ASan+UBSan the test sources are instrumented by ASan only: UBSan's checks in
# GoogleTest's expansions were two fifths of each test file's compile time
# (tests/fsdp/sharding_runtime_test.cc: 32 s with both, 19 s with ASan alone), and the
# undefined behaviour the stage is after is the library's, which keeps both. Memory errors in
# test code, and in the library's inline code a test compiles, are still ASan's to find. TSan
# instruments everything: a test's synchronisation must be seen.
# Under a sanitizer the test sources compile at -O0 (tests/fsdp/sharding_runtime_test.cc
# under ASan: 16 s against 28 s at -O1): their own code only drives the library, whose -O1
# code the tests spend their time in.
# With HOT, the test's own code does heavy work (the collectives' references over 64 MiB,
# 45% slower at -O1): it keeps the build's optimisation outside the sanitizer builds, and -O1
# under them.
function(fsdp_test_compile_options target)
  cmake_parse_arguments(ARG "HOT" "" "" ${ARGN})
  if(NOT FSDP_SANITIZE STREQUAL "" AND NOT ARG_HOT)
    target_compile_options(${target} PRIVATE $<$<CONFIG:Release,RelWithDebInfo>:-O0>)
  elseif(NOT FSDP_SANITIZE STREQUAL "" OR NOT ARG_HOT)
    target_compile_options(${target} PRIVATE $<$<CONFIG:Release,RelWithDebInfo>:-O1>)
  endif()
  if(FSDP_SANITIZE STREQUAL "address")
    target_compile_options(${target} PRIVATE -fno-sanitize=undefined)
  endif()
endfunction()

# Warnings are errors in the project's own code (third-party headers come in as SYSTEM).
function(fsdp_project_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Werror
    -Wno-unused-parameter -Wno-sign-compare)
endfunction()
