// Status helpers: the two macros Debian's Abseil (20220623) lacks.
//
// Every boundary a user or a peer can make fail returns absl::Status or absl::StatusOr<T>.
// These macros keep the happy path readable:
//
//   absl::StatusOr<Tensor> Twice(const Tensor& x) {
//     DT_ASSIGN_OR_RETURN(Tensor y, Add(x, x));
//     DT_RETURN_IF_ERROR(CheckFinite(y));
//     return y;
//   }
//
// Messages start with the operation in brackets and name the offending values, e.g.
// "[Matmul] inner dims differ: a is [3, 4], b is [5, 2]".
#ifndef DTENSOR_TENSOR_STATUS_H_
#define DTENSOR_TENSOR_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define DT_STATUS_CONCAT_INNER_(a, b) a##b
#define DT_STATUS_CONCAT_(a, b) DT_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define DT_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status dt_status_ = (expr);      \
    if (!dt_status_.ok()) return dt_status_; \
  } while (false)

// `DT_ASSIGN_OR_RETURN(lhs, expr)`: evaluates `expr` (an absl::StatusOr<T>); on error returns
// its status, otherwise moves the value into `lhs` (which may be a declaration). It expands to
// several statements: after an `if`, put it in braces.
#define DT_ASSIGN_OR_RETURN(lhs, expr) DT_ASSIGN_OR_RETURN_IMPL_(DT_STATUS_CONCAT_(dt_statusor_, __LINE__), lhs, expr)

#define DT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)     \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace dtensor {

// InvalidArgument with the operation name in brackets, e.g. Invalid("Matmul", "a is ", ...).
template <typename... Args>
absl::Status InvalidArg(const char* op, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat("[", op, "] ", args...));
}

}  // namespace dtensor

#endif  // DTENSOR_TENSOR_STATUS_H_
