// Whether this test binary runs under a sanitizer (ASan+UBSan or TSan). A few cases that repeat
// code other cases already run, only at a larger size, skip themselves there, saying so: a
// sanitizer finds a memory error or a race in the code that runs, not in how much of it runs,
// and the plain stage still runs them.
#pragma once

namespace fsdp::testing {

inline bool UnderSanitizer() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

}  // namespace fsdp::testing
