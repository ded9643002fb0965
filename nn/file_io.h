// Whole-file reads and atomic writes, for checkpoints and data files.
//
//   DT_RETURN_IF_ERROR(WriteFileAtomically("Save", "/ckpt/step100.bin", {header, payload}));
//   DT_ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes("Load", "/ckpt/step100.bin"));
//
// A write goes to a temporary file in the same directory, is fsync'ed, renamed over the target
// and the directory fsync'ed: readers see the old file or the complete new one, never a part.
// Errors name `op` (the caller's operation) and the path; a missing file is NotFound.
#ifndef DTENSOR_NN_FILE_IO_H_
#define DTENSOR_NN_FILE_IO_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dtensor {

// Writes `pieces` back to back to `path` atomically.
absl::Status WriteFileAtomically(const char* op, const std::string& path, absl::Span<const absl::string_view> pieces);

// The whole contents of `path`.
absl::StatusOr<std::string> ReadFileBytes(const char* op, const std::string& path);

}  // namespace dtensor

#endif  // DTENSOR_NN_FILE_IO_H_
