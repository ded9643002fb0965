#include "dtensor/autograd/value.h"

namespace dtensor {

Value::Value(Tensor t) : local_(std::move(t)) {}
Value::Value(DTensor d) : dist_(std::move(d)) {}

}  // namespace dtensor
