# cmake -P script: installs fsdp into WORK_DIR/prefix, then builds README.md's first program
# (the code blocks after "<!-- file: main.cc -->" and "<!-- file: CMakeLists.txt -->", taken
# verbatim) as a project outside the tree against it, runs it (ranks as threads, and under
# mpirun when MPIEXEC is given) and checks that the loss fell. Then builds BACKENDS_CONSUMER
# against the package's components (COMPONENTS: "pjrt,cuda" as the build has them, commas for
# semicolons) and runs it with the PJRT plugin PJRT_PLUGIN, and checks that asking for a
# component the package lacks fails find_package with a message that says so.
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGV}")
  endif()
  set(output "${out}" PARENT_SCOPE)
endfunction()

# Writes the fenced block that follows "<!-- file: NAME -->" in README.md to SRC/NAME.
file(READ ${README} readme)
function(extract name)
  string(FIND "${readme}" "<!-- file: ${name} -->" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "README.md has no block marked <!-- file: ${name} -->")
  endif()
  string(SUBSTRING "${readme}" ${at} -1 rest)
  string(FIND "${rest}" "```" open)
  string(SUBSTRING "${rest}" ${open} -1 rest)
  string(FIND "${rest}" "\n" eol)  # skip the fence line with its language
  math(EXPR eol "${eol} + 1")
  string(SUBSTRING "${rest}" ${eol} -1 rest)
  string(FIND "${rest}" "\n```" close)
  string(SUBSTRING "${rest}" 0 ${close} block)
  file(WRITE ${WORK_DIR}/src/${name} "${block}\n")
endfunction()
extract(main.cc)
extract(CMakeLists.txt)

run(${CMAKE_COMMAND} --install ${FSDP_BUILD_DIR} --prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} -S ${WORK_DIR}/src -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
# check_loss(OUTPUT WHAT): the program printed "loss A -> B" with B < A.
function(check_loss out what)
  if(NOT out MATCHES "loss ([0-9.]+) -> ([0-9.]+)")
    message(FATAL_ERROR "README's program (${what}) printed no 'loss A -> B' line")
  endif()
  # CMake compares the two as floating-point numbers.
  if(NOT CMAKE_MATCH_1 GREATER CMAKE_MATCH_2)
    message(FATAL_ERROR "README's program (${what}) trained, but the loss did not fall: "
                        "${CMAKE_MATCH_1} -> ${CMAKE_MATCH_2}")
  endif()
  message("install_consumer: README's program (${what}) built against the installed package; "
          "loss ${CMAKE_MATCH_1} -> ${CMAKE_MATCH_2}")
endfunction()

run(${WORK_DIR}/build/first_program)
check_loss("${output}" "ranks as threads")
if(MPIEXEC)
  run(${MPIEXEC} -np 2 --oversubscribe --allow-run-as-root --mca btl self,vader
      ${WORK_DIR}/build/first_program)
  check_loss("${output}" "mpirun -np 2")
endif()

# The accelerator backends as components, and the umbrella header.
string(REPLACE "," ";" want "${COMPONENTS}")
list(REMOVE_ITEM want "")
run(${CMAKE_COMMAND} -S ${BACKENDS_CONSUMER} -B ${WORK_DIR}/backends_build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release "-DFSDP_WANT=${COMPONENTS}")
run(${CMAKE_COMMAND} --build ${WORK_DIR}/backends_build)
# The same consumer with a C++ standard of its own set (the package's C++20 requirement meets
# the consumer's, and a newer one is fine): built, not run again.
run(${CMAKE_COMMAND} -S ${BACKENDS_CONSUMER} -B ${WORK_DIR}/backends_build_cxx23 -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release "-DFSDP_WANT=${COMPONENTS}"
    -DCMAKE_CXX_STANDARD=23 -DCMAKE_CXX_STANDARD_REQUIRED=ON)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/backends_build_cxx23)
set(ENV{FSDP_PJRT_PLUGIN} "${PJRT_PLUGIN}")
set(ENV{TF_CPP_MIN_LOG_LEVEL} 2)
run(${WORK_DIR}/backends_build/backends_consumer)
if(NOT output MATCHES "backends_consumer: ok")
  message(FATAL_ERROR "backends_consumer did not end with 'backends_consumer: ok'")
endif()
foreach(c IN LISTS want)
  if(NOT output MATCHES "backends_consumer: ${c}: [^\n]*round-tripped"
     AND NOT output MATCHES "backends_consumer: ${c} is registered but cannot run here")
    message(FATAL_ERROR "backends_consumer did not use the ${c} backend")
  endif()
endforeach()
message("install_consumer: the components '${want}' of the installed package linked and ran")

# A component the package lacks: find_package fails, naming it.
set(missing nosuch)
foreach(c IN ITEMS pjrt cuda)
  list(FIND want ${c} at)
  if(at EQUAL -1)
    set(missing ${c})
    break()
  endif()
endforeach()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${BACKENDS_CONSUMER} -B ${WORK_DIR}/missing_build
    -G ${GENERATOR} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix "-DFSDP_WANT=${missing}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0)
  message(FATAL_ERROR "find_package(fsdp REQUIRED COMPONENTS ${missing}) succeeded on a package "
                      "without it")
endif()
if(NOT out MATCHES "${missing}")
  message(FATAL_ERROR "find_package(fsdp COMPONENTS ${missing}) failed without naming it:\n${out}")
endif()
message("install_consumer: find_package(fsdp REQUIRED COMPONENTS ${missing}) fails as it should")

# The C API: a C program built against the installed package with CMake (a C-only project,
# COMPONENTS c) and with pkg-config and a plain compiler line; libfsdp.so exports the C API only.
run(${CMAKE_COMMAND} -S ${C_CONSUMER} -B ${WORK_DIR}/c_build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/c_build)
run(${WORK_DIR}/c_build/c_consumer)
if(NOT output MATCHES "c_consumer: ok")
  message(FATAL_ERROR "c_consumer (CMake) did not end with 'c_consumer: ok'")
endif()
file(GLOB_RECURSE pc_files ${WORK_DIR}/prefix/*/fsdp.pc)
if(NOT pc_files)
  message(FATAL_ERROR "the installed package has no fsdp.pc")
endif()
list(GET pc_files 0 pc_file)
get_filename_component(pc_dir ${pc_file} DIRECTORY)
get_filename_component(lib_dir ${pc_dir} DIRECTORY)
find_program(PKG_CONFIG pkg-config REQUIRED)
find_program(CC NAMES cc gcc REQUIRED)
set(ENV{PKG_CONFIG_PATH} ${pc_dir})
run(${PKG_CONFIG} --cflags --libs fsdp)
string(STRIP "${output}" flags)
separate_arguments(flags UNIX_COMMAND "${flags}")
run(${CC} -std=c99 -Wall -Werror ${C_CONSUMER}/main.c ${flags} -o ${WORK_DIR}/c_consumer_pc)
set(ENV{LD_LIBRARY_PATH} ${lib_dir})
run(${WORK_DIR}/c_consumer_pc)
if(NOT output MATCHES "c_consumer: ok")
  message(FATAL_ERROR "c_consumer (pkg-config) did not end with 'c_consumer: ok'")
endif()
find_program(NM nm REQUIRED)
run(${NM} -D --defined-only ${lib_dir}/libfsdp.so)
string(REGEX MATCHALL "[^\n]+" symbols "${output}")
set(exported 0)
foreach(line IN LISTS symbols)
  if(NOT line MATCHES " fsdp_[a-z0-9_]+$")
    message(FATAL_ERROR "libfsdp.so exports a symbol outside the C API: ${line}")
  endif()
  math(EXPR exported "${exported} + 1")
endforeach()
message("install_consumer: the C API built with CMake and with pkg-config, and ran; "
        "libfsdp.so exports ${exported} symbols, all fsdp_*")
