// Safetensors: read and write named tensors in the Hugging Face safetensors file format.
//
//   std::vector<std::pair<std::string, Tensor>> params = {{"wte.weight", wte}, {"step", step}};
//   DT_RETURN_IF_ERROR(WriteSafetensors("/ckpt/model.safetensors", params, {{"step", "100"}}));
//   DT_ASSIGN_OR_RETURN(NamedTensors file, ReadSafetensors("/ckpt/model.safetensors"));
//   for (const auto& [name, t] : file.tensors) std::cout << name << " " << t.ToString() << "\n";
//   const Tensor* w = file.Find("wte.weight");   // nullptr when absent
//   std::string step = file.metadata.at("step");
//
// Layout of a file: 8-byte little-endian header length N, N bytes of JSON
//   {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<value>", ...}}        (optional)
// then the raw little-endian, row-major data; offsets are relative to the end of the header.
// Supported dtypes: F32, BF16, F16, I32, I64, BOOL, F8_E4M3, F8_E5M2 (the DTypes dtensor has);
// the other safetensors dtypes (F64, U8, I8, I16, U16, U32, U64) are rejected when reading.
//
// Writing copies non-contiguous and non-CPU tensors to contiguous host memory first and is
// atomic: the file is written to a temporary file in the same directory, fsync'ed, then renamed
// over `path`, so readers see the old file or the complete new one, never a partial one.
// Reading validates the whole file (header length against the file size, JSON syntax, dtypes,
// shapes, offsets that must tile the data section exactly) and returns NotFound for a missing
// file, InvalidArgument naming the file and the tensor for anything malformed.
#ifndef DTENSOR_NN_SAFETENSORS_H_
#define DTENSOR_NN_SAFETENSORS_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {

// The contents of a safetensors file: tensors in file (header) order, plus string metadata.
struct NamedTensors {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;

  // The tensor called `name`, or nullptr.
  const Tensor* Find(const std::string& name) const;
};

// The safetensors dtype string ("F32", "BF16", ...) of `dtype`.
const char* SafetensorsDTypeName(DType dtype);

// Writes `tensors` (names unique, non-empty, not "__metadata__"; any strides, any device) and
// `metadata` to `path` atomically, in the given order.
absl::Status WriteSafetensors(const std::string& path, absl::Span<const std::pair<std::string, Tensor>> tensors,
                              const std::map<std::string, std::string>& metadata = {});

// Reads every tensor of `path` into new contiguous CPU tensors.
absl::StatusOr<NamedTensors> ReadSafetensors(const std::string& path);

}  // namespace dtensor

#endif  // DTENSOR_NN_SAFETENSORS_H_
