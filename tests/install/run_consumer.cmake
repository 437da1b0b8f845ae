# cmake -P script: installs fsdp into WORK_DIR/prefix, then builds README.md's first program
# (the code blocks after "<!-- file: main.cc -->" and "<!-- file: CMakeLists.txt -->", taken
# verbatim) as a project outside the tree against it, runs it (ranks as threads, and under
# mpirun when MPIEXEC is given) and checks that the loss fell.
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
