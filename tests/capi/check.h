/* CHECK(call): returns the error of a C API call that failed from the enclosing function (which
 * returns fsdp_error*), after printing where and why. For the C tests. */
#ifndef FSDP_TESTS_CAPI_CHECK_H_
#define FSDP_TESTS_CAPI_CHECK_H_

#include <stdio.h>

#include "fsdp/c_api.h"

#define CHECK(call)                                                                      \
  do {                                                                                   \
    fsdp_error* check_error_ = (call);                                                   \
    if (check_error_ != NULL) {                                                          \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                      \
              fsdp_error_message(check_error_));                                         \
      return check_error_;                                                               \
    }                                                                                    \
  } while (0)

#endif
