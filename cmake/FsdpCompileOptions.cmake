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
set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "-O2 -g -DNDEBUG")

# Warnings are errors in the project's own code (third-party headers come in as SYSTEM).
function(fsdp_project_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Werror
    -Wno-unused-parameter -Wno-sign-compare)
endfunction()
