// Error handling for libfsdp: absl::Status / absl::StatusOr everywhere an operation can fail,
// with the two propagation macros used throughout the library.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define FSDP_STATUS_CONCAT_INNER_(a, b) a##b
#define FSDP_STATUS_CONCAT_(a, b) FSDP_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function if not OK.
#define FSDP_RETURN_IF_ERROR(expr)                      \
  do {                                                  \
    ::absl::Status fsdp_status_ = (expr);               \
    if (!fsdp_status_.ok()) return fsdp_status_;        \
  } while (0)

// `lhs` = value of `expr` (an absl::StatusOr<T>), or returns its error status.
#define FSDP_ASSIGN_OR_RETURN(lhs, expr) \
  FSDP_ASSIGN_OR_RETURN_IMPL_(FSDP_STATUS_CONCAT_(fsdp_statusor_, __LINE__), lhs, expr)
#define FSDP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()
