#include "dtensor/tensor/tensor.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/tensor/cuda_hooks.h"
#include "dtensor/tensor/status.h"

namespace dtensor {

int64_t NumElements(IntSpan shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Shape ContiguousStrides(IntSpan shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

std::string ShapeString(IntSpan shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::StatusOr<int64_t> NormalizeDim(const char* op, int64_t dim, int64_t ndim) {
  const int64_t lo = ndim == 0 ? -1 : -ndim;
  const int64_t hi = ndim == 0 ? 1 : ndim;  // a 0-d tensor accepts dim 0 / -1, as PyTorch
  if (dim < lo || dim >= hi) {
    return InvalidArg(op, "dim ", dim, " out of range for a tensor of ", ndim, " dims [", lo, ", ", hi, ")");
  }
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

absl::StatusOr<Shape> BroadcastShapes(const char* op, IntSpan a, IntSpan b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1) {
      return InvalidArg(op, "shapes ", ShapeString(a), " and ", ShapeString(b), " do not broadcast (dim ", i, ": ", da,
                        " vs ", db, ")");
    }
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Storage::~Storage() {
  if (allocator_ != nullptr) allocator_->Free(data_);
}

absl::Status Storage::Release() {
  if (allocator_ == nullptr) {
    return absl::FailedPreconditionError("[Storage::Release] borrowed memory (FromBlob) cannot be released");
  }
  allocator_->Free(data_);
  data_ = nullptr;
  return absl::OkStatus();
}

absl::Status Storage::Reallocate() {
  if (allocator_ == nullptr) {
    return absl::FailedPreconditionError("[Storage::Reallocate] borrowed memory (FromBlob) cannot be reallocated");
  }
  if (data_ != nullptr || nbytes_ == 0) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(data_, allocator_->Allocate(nbytes_));
  return absl::OkStatus();
}

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype)
    : storage_(std::move(storage)),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      offset_(offset),
      numel_(NumElements(shape_)),
      dtype_(dtype),
      device_(storage_->device()) {}

namespace {

absl::Status CheckShape(const char* op, IntSpan shape) {
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    return InvalidArg(op, "shape ", ShapeString(shape), " has more than ", kMaxDims, " dims");
  }
  for (int64_t s : shape) {
    if (s < 0) return InvalidArg(op, "negative size in shape ", ShapeString(shape));
  }
  // The element count (and its bytes at up to 8 per element) must fit in int64: a product that
  // wrapped would size the buffer far too small (a review saw [2^62, 32] become 0 bytes).
  for (int64_t s : shape) {
    if (s == 0) return absl::OkStatus();  // empty, whatever the other sizes
  }
  int64_t n = 1;
  for (int64_t s : shape) {
    if (n > (int64_t{1} << 60) / s) return InvalidArg(op, "shape ", ShapeString(shape), " has more than 2^60 elements");
    n *= s;
  }
  return absl::OkStatus();
}

absl::Status CheckDevice(const char* op, Device device) {
  if (device.is_cuda()) {
    if (!CudaBuilt()) {
      return absl::FailedPreconditionError(
          absl::StrCat("[", op, "] ", device.ToString(), " requested but ", internal::CudaNotLinkedMessage()));
    }
    if (device.index < 0 || device.index >= CudaDeviceCount()) {
      return absl::FailedPreconditionError(absl::StrCat("[", op, "] ", device.ToString(), " requested but ",
                                                        CudaDeviceCount(), " CUDA devices are visible"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Tensor> Tensor::Empty(IntSpan shape, DType dtype, Device device) {
  DT_RETURN_IF_ERROR(CheckShape("Empty", shape));
  DT_RETURN_IF_ERROR(CheckDevice("Empty", device));
  const size_t nbytes = static_cast<size_t>(NumElements(shape)) * ElementSize(dtype);
  Allocator& alloc = DefaultAllocator(device);
  DT_ASSIGN_OR_RETURN(void* p, alloc.Allocate(nbytes));
  auto storage = std::make_shared<Storage>(p, nbytes, device, &alloc);
  return Tensor(std::move(storage), Shape(shape.begin(), shape.end()), ContiguousStrides(shape), 0, dtype);
}

absl::StatusOr<Tensor> Tensor::EmptyPinned(IntSpan shape, DType dtype) {
  if (!PinnedHostAvailable()) return Empty(shape, dtype, Device::Cpu());
  DT_RETURN_IF_ERROR(CheckShape("EmptyPinned", shape));
  const size_t nbytes = static_cast<size_t>(NumElements(shape)) * ElementSize(dtype);
  Allocator& alloc = PinnedHostAllocator();
  DT_ASSIGN_OR_RETURN(void* p, alloc.Allocate(nbytes));
  auto storage = std::make_shared<Storage>(p, nbytes, Device::Cpu(), &alloc);
  return Tensor(std::move(storage), Shape(shape.begin(), shape.end()), ContiguousStrides(shape), 0, dtype);
}

absl::StatusOr<Tensor> Tensor::FromBlob(void* data, IntSpan shape, DType dtype, Device device, IntSpan strides) {
  DT_RETURN_IF_ERROR(CheckShape("FromBlob", shape));
  if (!strides.empty() && strides.size() != shape.size()) {
    return InvalidArg("FromBlob", "strides ", ShapeString(strides), " do not match shape ", ShapeString(shape));
  }
  Shape st = strides.empty() ? ContiguousStrides(shape) : Shape(strides.begin(), strides.end());
  int64_t extent = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) extent = 0;
  }
  if (extent != 0) {
    for (size_t i = 0; i < shape.size(); ++i) extent += (shape[i] - 1) * st[i];
  }
  auto storage = std::make_shared<Storage>(data, static_cast<size_t>(extent) * ElementSize(dtype), device, nullptr);
  return Tensor(std::move(storage), Shape(shape.begin(), shape.end()), std::move(st), 0, dtype);
}

bool Tensor::is_pinned() const { return storage_ != nullptr && storage_->allocator() == &PinnedHostAllocator(); }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (shape_[i] == 0) return true;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

absl::StatusOr<Tensor> Tensor::Narrow(int64_t dim, int64_t start, int64_t length) const {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Narrow", dim, this->dim()));
  if (this->dim() == 0) return InvalidArg("Narrow", "cannot narrow a 0-d tensor");
  const int64_t n = shape_[d];
  if (start < 0) start += n;
  if (start < 0 || length < 0 || start + length > n) {
    return InvalidArg("Narrow", "range start ", start, " length ", length, " out of bounds for dim ", d, " of ",
                      ShapeString(shape_));
  }
  Tensor t = *this;
  t.shape_[d] = length;
  t.offset_ += start * strides_[d];
  t.numel_ = NumElements(t.shape_);
  return t;
}

absl::StatusOr<Tensor> Tensor::Slice(int64_t dim, int64_t start, int64_t end, int64_t step) const {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Slice", dim, this->dim()));
  if (this->dim() == 0) return InvalidArg("Slice", "cannot slice a 0-d tensor");
  if (step < 1) return InvalidArg("Slice", "step must be >= 1, got ", step);
  const int64_t n = shape_[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Tensor t = *this;
  t.shape_[d] = (end - start + step - 1) / step;
  t.strides_[d] = strides_[d] * step;
  t.offset_ += start * strides_[d];
  t.numel_ = NumElements(t.shape_);
  return t;
}

absl::StatusOr<Tensor> Tensor::Select(int64_t dim, int64_t index) const {
  if (this->dim() == 0) return InvalidArg("Select", "cannot select from a 0-d tensor");
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Select", dim, this->dim()));
  const int64_t n = shape_[d];
  if (index < -n || index >= n) {
    return InvalidArg("Select", "index ", index, " out of range for dim ", d, " of ", ShapeString(shape_));
  }
  if (index < 0) index += n;
  Tensor t = *this;
  t.offset_ += index * strides_[d];
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  t.numel_ = NumElements(t.shape_);
  return t;
}

absl::StatusOr<std::vector<Tensor>> Tensor::Chunk(int64_t chunks, int64_t dim) const {
  if (chunks < 1) return InvalidArg("Chunk", "chunks must be >= 1, got ", chunks);
  if (this->dim() == 0) return InvalidArg("Chunk", "cannot chunk a 0-d tensor");
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Chunk", dim, this->dim()));
  const int64_t n = shape_[d];
  const int64_t piece = (n + chunks - 1) / chunks;
  if (piece == 0) {  // torch.chunk of an empty dim returns `chunks` empty pieces
    return std::vector<Tensor>(static_cast<size_t>(chunks), *this);
  }
  return Split(piece, d);
}

absl::StatusOr<std::vector<Tensor>> Tensor::Split(int64_t split_size, int64_t dim) const {
  if (this->dim() == 0) return InvalidArg("Split", "cannot split a 0-d tensor");
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Split", dim, this->dim()));
  const int64_t n = shape_[d];
  if (split_size < 0 || (split_size == 0 && n != 0)) {
    return InvalidArg("Split", "split_size ", split_size, " invalid for dim ", d, " of ", ShapeString(shape_));
  }
  std::vector<Tensor> out;
  if (n == 0) {
    out.push_back(*this);
    return out;
  }
  for (int64_t s = 0; s < n; s += split_size) {
    DT_ASSIGN_OR_RETURN(Tensor piece, Narrow(d, s, std::min(split_size, n - s)));
    out.push_back(std::move(piece));
  }
  return out;
}

absl::StatusOr<std::vector<Tensor>> Tensor::SplitWithSizes(IntSpan sizes, int64_t dim) const {
  if (this->dim() == 0) return InvalidArg("SplitWithSizes", "cannot split a 0-d tensor");
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("SplitWithSizes", dim, this->dim()));
  int64_t total = 0;
  for (int64_t s : sizes) {
    if (s < 0) return InvalidArg("SplitWithSizes", "negative size in ", ShapeString(sizes));
    total += s;
  }
  if (total != shape_[d]) {
    return InvalidArg("SplitWithSizes", "sizes ", ShapeString(sizes), " sum to ", total, " but dim ", d, " of ",
                      ShapeString(shape_), " has ", shape_[d]);
  }
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t s : sizes) {
    DT_ASSIGN_OR_RETURN(Tensor piece, Narrow(d, start, s));
    out.push_back(std::move(piece));
    start += s;
  }
  return out;
}

absl::StatusOr<Tensor> Tensor::Transpose(int64_t dim0, int64_t dim1) const {
  DT_ASSIGN_OR_RETURN(int64_t a, NormalizeDim("Transpose", dim0, this->dim()));
  DT_ASSIGN_OR_RETURN(int64_t b, NormalizeDim("Transpose", dim1, this->dim()));
  if (this->dim() == 0) return *this;  // as torch: dims 0 / -1 only, and the tensor itself
  Tensor t = *this;
  std::swap(t.shape_[a], t.shape_[b]);
  std::swap(t.strides_[a], t.strides_[b]);
  return t;
}

absl::StatusOr<Tensor> Tensor::Permute(IntSpan dims) const {
  const int64_t n = dim();
  if (static_cast<int64_t>(dims.size()) != n) {
    return InvalidArg("Permute", "dims ", ShapeString(dims), " do not match a tensor of shape ", ShapeString(shape_));
  }
  Shape seen(n, 0), shape(n), strides(n);
  for (int64_t i = 0; i < n; ++i) {
    DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Permute", dims[i], n));
    if (seen[d]++) return InvalidArg("Permute", "dims ", ShapeString(dims), " repeat dim ", d);
    shape[i] = shape_[d];
    strides[i] = strides_[d];
  }
  Tensor t = *this;
  t.shape_ = std::move(shape);
  t.strides_ = std::move(strides);
  return t;
}

namespace {

// Strides for viewing (old_shape, old_strides) as new_shape without a copy, if possible.
// The classic algorithm: walk both shapes from the innermost dim, matching contiguous chunks.
std::optional<Shape> ViewStrides(IntSpan old_shape, IntSpan old_strides, IntSpan new_shape) {
  Shape new_strides(new_shape.size());
  if (old_shape.empty()) {
    for (auto& s : new_strides) s = 1;
    return new_strides;
  }
  if (NumElements(old_shape) == 0) {
    return ContiguousStrides(new_shape);
  }
  int64_t view_d = static_cast<int64_t>(new_shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1;
  int64_t view_numel = 1;
  for (int64_t tensor_d = static_cast<int64_t>(old_shape.size()) - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old_shape[tensor_d];
    if (tensor_d == 0 ||
        (old_shape[tensor_d - 1] != 1 && old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        new_strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (tensor_d > 0) {
        chunk_base_stride = old_strides[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

}  // namespace

absl::StatusOr<Shape> InferViewShape(const char* op, IntSpan shape, int64_t numel) {
  Shape out(shape.begin(), shape.end());
  int64_t infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      if (infer >= 0) return InvalidArg(op, "only one dim may be -1 in ", ShapeString(shape));
      infer = static_cast<int64_t>(i);
    } else if (out[i] < 0) {
      return InvalidArg(op, "invalid size in shape ", ShapeString(shape));
    } else {
      known *= out[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0) {
      return InvalidArg(op, "shape ", ShapeString(shape), " is invalid for ", numel, " elements");
    }
    out[infer] = numel / known;
  } else if (known != numel) {
    return InvalidArg(op, "shape ", ShapeString(shape), " is invalid for ", numel, " elements");
  }
  return out;
}

absl::StatusOr<Tensor> Tensor::View(IntSpan shape) const {
  DT_ASSIGN_OR_RETURN(Shape new_shape, InferViewShape("View", shape, numel_));
  DT_RETURN_IF_ERROR(CheckShape("View", new_shape));
  auto strides = ViewStrides(shape_, strides_, new_shape);
  if (!strides) {
    return InvalidArg("View", "cannot view shape ", ShapeString(shape_), " with strides ", ShapeString(strides_),
                      " as ", ShapeString(new_shape), " without a copy; use Reshape");
  }
  Tensor t = *this;
  t.shape_ = std::move(new_shape);
  t.strides_ = std::move(*strides);
  return t;
}

absl::StatusOr<Tensor> Tensor::Expand(IntSpan shape) const {
  const int64_t n = static_cast<int64_t>(shape.size());
  if (n < dim()) {
    return InvalidArg("Expand", "target ", ShapeString(shape), " has fewer dims than ", ShapeString(shape_));
  }
  DT_RETURN_IF_ERROR(CheckShape("Expand", Shape(n, 0)));
  Shape out_shape(n), out_strides(n);
  const int64_t lead = n - dim();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t want = shape[i];
    if (i < lead) {
      if (want < 0) return InvalidArg("Expand", "new leading dim ", i, " cannot be -1 in ", ShapeString(shape));
      out_shape[i] = want;
      out_strides[i] = 0;
      continue;
    }
    const int64_t have = shape_[i - lead];
    if (want == -1 || want == have) {
      out_shape[i] = have;
      out_strides[i] = strides_[i - lead];
    } else if (have == 1 && want >= 0) {
      out_shape[i] = want;
      out_strides[i] = 0;
    } else {
      return InvalidArg("Expand", "cannot expand ", ShapeString(shape_), " to ", ShapeString(shape), " (dim ", i, ")");
    }
  }
  Tensor t = *this;
  t.shape_ = std::move(out_shape);
  t.strides_ = std::move(out_strides);
  t.numel_ = NumElements(t.shape_);
  return t;
}

absl::StatusOr<Tensor> Tensor::Unsqueeze(int64_t dim) const {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Unsqueeze", dim, this->dim() + 1));
  if (this->dim() + 1 > kMaxDims) return InvalidArg("Unsqueeze", "would exceed ", kMaxDims, " dims");
  Tensor t = *this;
  const int64_t stride = d < this->dim() ? shape_[d] * strides_[d] : 1;
  t.shape_.insert(t.shape_.begin() + d, 1);
  t.strides_.insert(t.strides_.begin() + d, stride);
  return t;
}

absl::StatusOr<Tensor> Tensor::Squeeze(int64_t dim) const {
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim("Squeeze", dim, this->dim()));
  if (this->dim() == 0) return *this;  // as torch: dims 0 / -1 only, and the tensor itself
  if (shape_[d] != 1) return *this;    // as torch.squeeze(dim): no-op on a dim that is not 1
  Tensor t = *this;
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

absl::StatusOr<Tensor> Tensor::AsStrided(IntSpan shape, IntSpan strides, int64_t storage_offset) const {
  DT_RETURN_IF_ERROR(CheckShape("AsStrided", shape));
  if (strides.size() != shape.size()) {
    return InvalidArg("AsStrided", "strides ", ShapeString(strides), " do not match shape ", ShapeString(shape));
  }
  if (!defined()) return absl::FailedPreconditionError("[AsStrided] undefined tensor");
  int64_t lo = storage_offset, hi = storage_offset;
  if (NumElements(shape) > 0) {
    for (size_t i = 0; i < shape.size(); ++i) {
      const int64_t span = (shape[i] - 1) * strides[i];
      (span < 0 ? lo : hi) += span;
    }
    const int64_t capacity = static_cast<int64_t>(storage_->nbytes() / ElementSize(dtype_));
    if (lo < 0 || hi >= capacity) {
      return InvalidArg("AsStrided", "shape ", ShapeString(shape), " strides ", ShapeString(strides), " offset ",
                        storage_offset, " reaches outside a storage of ", capacity, " elements");
    }
  }
  Tensor t = *this;
  t.shape_ = Shape(shape.begin(), shape.end());
  t.strides_ = Shape(strides.begin(), strides.end());
  t.offset_ = storage_offset;
  t.numel_ = NumElements(t.shape_);
  return t;
}

std::string Tensor::ToString() const {
  if (!defined()) return "Tensor(undefined)";
  return absl::StrCat("Tensor(", DTypeName(dtype_), ", ", device_.ToString(), ", ", ShapeString(shape_), ")");
}

}  // namespace dtensor
