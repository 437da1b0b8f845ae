# cmake -P script: writes OUTPUT, a C++ file defining `std::string_view FUNCTION()` in
# namespace NAMESPACE that returns the bytes of INPUT (run at build time by src/nn).
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" hex_len)
math(EXPR size "${hex_len} / 2")
# 16 bytes per line, each as 0xNN (CMake regexes have no {n} repetition).
string(REPEAT "[0-9a-f][0-9a-f]" 16 line_pattern)
string(REGEX REPLACE "(${line_pattern})" "\\1\n" hex "${hex}")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
file(WRITE "${OUTPUT}.tmp"
  "// Generated from ${INPUT} by src/nn/embed_file.cmake. Do not edit.\n"
  "#include <string_view>\n\n"
  "namespace ${NAMESPACE} {\n"
  "namespace {\n"
  "// One extra zero byte so an empty input is still a valid array.\n"
  "const unsigned char kBytes[${size} + 1] = {\n${bytes}0};\n"
  "}  // namespace\n\n"
  "std::string_view ${FUNCTION}() {\n"
  "  return {reinterpret_cast<const char*>(kBytes), ${size}};\n"
  "}\n\n"
  "}  // namespace ${NAMESPACE}\n")
file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")
