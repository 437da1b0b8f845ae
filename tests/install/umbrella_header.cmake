# cmake -P script: every public header (include/fsdp/**.h, INCLUDE_DIR) is either included by
# the umbrella header fsdp/fsdp.h or named in its comment as one it leaves out on purpose, so a
# new header cannot be forgotten.
file(READ ${INCLUDE_DIR}/fsdp/fsdp.h umbrella)
file(GLOB_RECURSE headers RELATIVE ${INCLUDE_DIR} ${INCLUDE_DIR}/fsdp/*.h)
set(missing "")
foreach(h IN LISTS headers)
  if(h STREQUAL "fsdp/fsdp.h")
    continue()
  endif()
  string(FIND "${umbrella}" "#include \"${h}\"" included)
  string(FIND "${umbrella}" "//   ${h} " named)
  if(included EQUAL -1 AND named EQUAL -1)
    list(APPEND missing ${h})
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "fsdp/fsdp.h neither includes nor names (as left out) these public "
                      "headers: ${missing}")
endif()
list(LENGTH headers n)
message("umbrella_header: fsdp/fsdp.h covers all ${n} public headers")
