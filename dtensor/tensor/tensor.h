// Tensor: a local (single-device) strided array — the bottom layer of dtensor.
//
//   DT_ASSIGN_OR_RETURN(Tensor x, Tensor::FromVector<float>({1, 2, 3, 4, 5, 6}, {2, 3}));
//   DT_ASSIGN_OR_RETURN(Tensor xt, x.Transpose(0, 1));     // view: [3, 2], strides [1, 3]
//   DT_ASSIGN_OR_RETURN(auto parts, x.Chunk(2, 1));         // torch.chunk: [2, 2] and [2, 1]
//   float* p = x.data<float>();                             // first element, offset applied
//
// A Tensor is a view: shared storage + shape + strides (in elements) + storage offset
// (in elements) + dtype. Copying a Tensor copies the view, not the data; views made by
// Narrow/Slice/Select/Chunk/Split/Transpose/Permute/View/Expand/Squeeze/Unsqueeze share
// storage with their base. Operations that compute (Contiguous, Reshape that must copy, cast,
// cross-device copy, arithmetic) live in dtensor/ops/ops.h.
//
// Every view that can fail returns absl::StatusOr: out-of-range dims, bad sizes and shapes
// that cannot be viewed give InvalidArgument naming the operation and the shapes.
#ifndef DTENSOR_TENSOR_TENSOR_H_
#define DTENSOR_TENSOR_TENSOR_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/tensor/allocator.h"
#include "dtensor/tensor/device.h"
#include "dtensor/tensor/dtype.h"

namespace dtensor {

// Shapes and strides. Dims are int64; strides are in elements and may be 0 (broadcast).
using Shape = absl::InlinedVector<int64_t, 6>;
using IntSpan = absl::Span<const int64_t>;

// Kernels (CUDA in particular) take at most this many dims.
inline constexpr int kMaxDims = 8;

// Product of sizes (1 for a 0-d shape).
int64_t NumElements(IntSpan shape);
// Row-major strides of a contiguous tensor of `shape`.
Shape ContiguousStrides(IntSpan shape);
// "[2, 3]"
std::string ShapeString(IntSpan shape);
// Maps dim in [-ndim, ndim) to [0, ndim); InvalidArgument naming `op` otherwise.
absl::StatusOr<int64_t> NormalizeDim(const char* op, int64_t dim, int64_t ndim);
// NumPy/PyTorch broadcasting of two shapes; InvalidArgument naming `op` when incompatible.
absl::StatusOr<Shape> BroadcastShapes(const char* op, IntSpan a, IntSpan b);
// Resolves one -1 in `shape` so that it holds `numel` elements; InvalidArgument otherwise.
absl::StatusOr<Shape> InferViewShape(const char* op, IntSpan shape, int64_t numel);

// Memory of a tensor: a block from an Allocator, or borrowed memory (FromBlob).
class Storage {
 public:
  // Owns `data`, returned to `allocator` on destruction (allocator may be null for borrowed).
  Storage(void* data, size_t nbytes, Device device, Allocator* allocator)
      : data_(data), nbytes_(nbytes), device_(device), allocator_(allocator) {}
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  Allocator* allocator() const { return allocator_; }

  // PyTorch's storage resize_(0) / resize_(n), which FSDP uses to free unsharded parameters
  // between forward and backward while the autograd graph keeps views of them: Release()
  // returns the memory to the allocator (every view keeps this Storage; data() is null until
  // Reallocate()), Reallocate() takes a fresh block of the same size (contents undefined).
  // Only for memory from an allocator: FailedPrecondition for borrowed memory (FromBlob).
  // Reading a view while released is a contract violation.
  absl::Status Release();
  absl::Status Reallocate();
  bool released() const { return data_ == nullptr && nbytes_ > 0; }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  Allocator* allocator_;
};

class Tensor {
 public:
  // An undefined tensor (no storage); defined() is false.
  Tensor() = default;

  // Uninitialised contiguous tensor from the device's DefaultAllocator. Negative sizes,
  // more than kMaxDims dims or an unavailable device -> error.
  static absl::StatusOr<Tensor> Empty(IntSpan shape, DType dtype, Device device = Device::Cpu());
  // A contiguous CPU tensor in pinned host memory (PinnedHostAllocator) where that is
  // available, else as Empty on the CPU: the staging buffer of device-to-host copies.
  static absl::StatusOr<Tensor> EmptyPinned(IntSpan shape, DType dtype);
  // Borrows `data` (not owned; must outlive every view). Empty `strides` means contiguous.
  static absl::StatusOr<Tensor> FromBlob(void* data, IntSpan shape, DType dtype, Device device, IntSpan strides = {});
  // A contiguous CPU tensor holding a copy of `values`; numel(shape) must equal values.size().
  template <typename T>
  static absl::StatusOr<Tensor> FromVector(absl::Span<const T> values, IntSpan shape);
  template <typename T>
  static absl::StatusOr<Tensor> FromVector(const std::vector<T>& values, IntSpan shape) {
    return FromVector<T>(absl::MakeConstSpan(values), shape);
  }
  template <typename T>
  static absl::StatusOr<Tensor> FromVector(std::initializer_list<T> values, IntSpan shape) {
    return FromVector<T>(absl::MakeConstSpan(values.begin(), values.size()), shape);
  }
  // The elements in row-major order (any strides: a view reads as what it shows).
  // InvalidArgument when T is not the dtype; FailedPrecondition off the CPU (copy it first
  // with To(x, Device::Cpu())).
  template <typename T>
  absl::StatusOr<std::vector<T>> ToVector() const;

  bool defined() const { return storage_ != nullptr; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  IntSpan shape() const { return shape_; }
  IntSpan strides() const { return strides_; }
  // Size of dim `d` (negative counts from the end). Precondition: -dim() <= d < dim().
  int64_t size(int64_t d) const { return shape_[static_cast<size_t>(d < 0 ? d + dim() : d)]; }
  int64_t stride(int64_t d) const { return strides_[static_cast<size_t>(d < 0 ? d + dim() : d)]; }
  int64_t storage_offset() const { return offset_; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * ElementSize(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool is_contiguous() const;
  // Whether its memory comes from PinnedHostAllocator (EmptyPinned on a machine with a GPU).
  bool is_pinned() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  // Address of element [0, ..., 0]; nullptr without memory (also an empty view at an offset into
  // an empty storage, whose data() is null: offsetting null is undefined).
  void* raw_data() const {
    char* base = storage_ ? static_cast<char*>(storage_->data()) : nullptr;
    return base != nullptr ? base + offset_ * static_cast<int64_t>(ElementSize(dtype_)) : nullptr;
  }
  // Typed address of element [0, ..., 0]. Precondition: DTypeOf<T> == dtype().
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw_data());
  }

  // ---- Views (share storage) ----
  // Elements [start, start + length) of `dim`.
  absl::StatusOr<Tensor> Narrow(int64_t dim, int64_t start, int64_t length) const;
  // Python-style slice [start:end:step] of `dim`; start/end clamp to the size, step >= 1.
  absl::StatusOr<Tensor> Slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  // Removes `dim`, keeping index `index` of it.
  absl::StatusOr<Tensor> Select(int64_t dim, int64_t index) const;
  // torch.chunk: pieces of ceil(size/chunks) along `dim`; may return fewer than `chunks`.
  absl::StatusOr<std::vector<Tensor>> Chunk(int64_t chunks, int64_t dim) const;
  // torch.split with an int: pieces of `split_size` (the last may be smaller).
  absl::StatusOr<std::vector<Tensor>> Split(int64_t split_size, int64_t dim) const;
  // torch.split with a list of sizes that must sum to size(dim).
  absl::StatusOr<std::vector<Tensor>> SplitWithSizes(IntSpan sizes, int64_t dim) const;
  absl::StatusOr<Tensor> Transpose(int64_t dim0, int64_t dim1) const;
  // dims must be a permutation of [0, dim()).
  absl::StatusOr<Tensor> Permute(IntSpan dims) const;
  // Same elements, new shape without copying; one size may be -1. Fails (InvalidArgument) when
  // the strides do not allow it — use Reshape in ops.h, which copies when needed.
  absl::StatusOr<Tensor> View(IntSpan shape) const;
  // Broadcast to `shape` (size-1 dims get stride 0; -1 keeps a size; new leading dims allowed).
  absl::StatusOr<Tensor> Expand(IntSpan shape) const;
  absl::StatusOr<Tensor> Unsqueeze(int64_t dim) const;
  absl::StatusOr<Tensor> Squeeze(int64_t dim) const;
  // Arbitrary view of the same storage; checks that every element stays inside the storage.
  absl::StatusOr<Tensor> AsStrided(IntSpan shape, IntSpan strides, int64_t storage_offset) const;

  // "Tensor(float32, cpu, [2, 3])"
  std::string ToString() const;

 private:
  Tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype);

  std::shared_ptr<Storage> storage_;
  Shape shape_;
  Shape strides_;
  int64_t offset_ = 0;
  int64_t numel_ = 0;
  DType dtype_ = DType::kFloat32;
  Device device_ = Device::Cpu();
};

template <typename T>
absl::StatusOr<Tensor> Tensor::FromVector(absl::Span<const T> values, IntSpan shape) {
  auto t = Empty(shape, DTypeOf<T>::value, Device::Cpu());
  if (!t.ok()) return t.status();
  if (t->numel() != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError("[FromVector] " + std::to_string(values.size()) + " values do not fill shape " +
                                      ShapeString(shape));
  }
  T* out = t->template data<T>();
  for (size_t i = 0; i < values.size(); ++i) out[i] = values[i];
  return t;
}

template <typename T>
absl::StatusOr<std::vector<T>> Tensor::ToVector() const {
  if (dtype_ != DTypeOf<T>::value) {
    return absl::InvalidArgumentError(std::string("[ToVector] the tensor is ") + DTypeName(dtype_) + ", not " +
                                      DTypeName(DTypeOf<T>::value));
  }
  if (!device_.is_cpu()) {
    return absl::FailedPreconditionError("[ToVector] the tensor is on " + device_.ToString() +
                                         ": copy it to the CPU first (To(x, Device::Cpu()))");
  }
  std::vector<T> out(static_cast<size_t>(numel_));
  if (numel_ == 0) return out;
  const T* base = data<T>();
  Shape index(shape_.size(), 0);
  int64_t at = 0;  // element offset of `index` from base
  for (int64_t i = 0; i < numel_; ++i) {
    out[static_cast<size_t>(i)] = base[at];
    for (int64_t d = static_cast<int64_t>(shape_.size()) - 1; d >= 0; --d) {  // next index, row-major
      const size_t k = static_cast<size_t>(d);
      if (++index[k] < shape_[k]) {
        at += strides_[k];
        break;
      }
      at -= (shape_[k] - 1) * strides_[k];
      index[k] = 0;
    }
  }
  return out;
}

}  // namespace dtensor

#endif  // DTENSOR_TENSOR_TENSOR_H_
