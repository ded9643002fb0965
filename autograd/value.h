// Value: what flows through autograd and the op dispatcher — a plain local Tensor or a DTensor.
//
//   Value a = tensor;                       // a local tensor (no mesh)
//   Value b = dtensor;                      // a distributed tensor
//   a.shape();                              // the global shape (the tensor's own for a plain one)
//   b.local();                              // this rank's piece
//   if (b.is_dtensor()) b.dtensor().layout();
//
// Ops that mix the two treat a plain Tensor as Replicate on the DTensor's mesh (it must then
// hold the full value on every rank, as in PyTorch's implicit replication).
#ifndef DTENSOR_AUTOGRAD_VALUE_H_
#define DTENSOR_AUTOGRAD_VALUE_H_

#include <string>
#include <utility>

#include "dtensor/core/dtensor.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {

class Value {
 public:
  Value() = default;
  Value(Tensor t);   // NOLINT: implicit on purpose
  Value(DTensor d);  // NOLINT: implicit on purpose (out of line: keeps GCC's uninitialised-
                     // member analysis of the unused half quiet)

  bool defined() const { return local_.defined() || dist_.defined(); }
  bool is_dtensor() const { return dist_.defined(); }
  // This rank's piece (the tensor itself for a plain Tensor).
  const Tensor& local() const { return dist_.defined() ? dist_.ToLocal() : local_; }
  // Precondition: is_dtensor().
  const DTensor& dtensor() const { return dist_; }
  IntSpan shape() const { return dist_.defined() ? dist_.shape() : local_.shape(); }
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t numel() const { return NumElements(shape()); }
  DType dtype() const { return local().dtype(); }
  Device device() const { return local().device(); }
  std::string ToString() const { return dist_.defined() ? dist_.ToString() : local_.ToString(); }

 private:
  Tensor local_;
  DTensor dist_;
};

}  // namespace dtensor

#endif  // DTENSOR_AUTOGRAD_VALUE_H_
