// Fuzz target: loading a distributed checkpoint (dtensor/checkpoint/checkpoint.h,
// LoadCheckpoint) from an arbitrary metadata.json and data file. The input is split at its first
// NUL byte: the text before it is <dir>/metadata.json, the bytes after it <dir>/rank-00000.bin.
// The load targets fixed plain tensors (F32 [4, 3]; I64 [5]; F32 [2, 3, 2] stored as [6, 2]) and
// must succeed or return a clean error: never crash, throw, read outside the directory or
// write outside its targets; so must listing the checkpoint's tensors (CheckpointTensors).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dtensor/checkpoint/checkpoint.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dtensor;
  const uint8_t* nul = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t meta_size = nul != nullptr ? static_cast<size_t>(nul - data) : size;
  const std::string dir = fuzz::TempDir();
  fuzz::WriteTempFile("metadata.json", data, meta_size);
  if (nul != nullptr) {
    fuzz::WriteTempFile("rank-00000.bin", nul + 1, size - meta_size - 1);
  } else {
    fuzz::WriteTempFile("rank-00000.bin", data, 0);
  }
  absl::StatusOr<Tensor> a = Tensor::Empty({4, 3}, DType::kFloat32, Device::Cpu());
  absl::StatusOr<Tensor> b = Tensor::Empty({5}, DType::kInt64, Device::Cpu());
  absl::StatusOr<Tensor> c = Tensor::Empty({2, 3, 2}, DType::kFloat32, Device::Cpu());
  FUZZ_CHECK(a.ok() && b.ok() && c.ok());
  const CheckpointState state = {
      {.name = "a", .tensor = *a}, {.name = "b", .tensor = *b}, {.name = "c", .tensor = *c, .stored_shape = {6, 2}}};
  LoadStats stats;
  const absl::Status s = LoadCheckpoint(dir, state, &stats);
  if (std::getenv("FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "LoadCheckpoint: %s\n", s.ToString().c_str());
  if (!s.ok()) FUZZ_CHECK(fuzz::IsCleanError(s));
  // Only the one data file of the directory can be opened.
  FUZZ_CHECK(stats.files_opened <= 1);
  const absl::StatusOr<std::vector<CheckpointTensor>> listed = CheckpointTensors(dir);
  if (!listed.ok()) FUZZ_CHECK(fuzz::IsCleanError(listed.status()));
  return 0;
}
