// JsonNesting: how deep the arrays and objects of a JSON text nest, read from the text alone
// (brackets outside strings), before a parser sees it. Files we read (checkpoint metadata,
// safetensors headers, plan files) nest a few levels; a hostile one nested 100,000 deep makes
// nlohmann-json's parse, copy, print and destruction recurse until the stack overflows, so
// readers refuse a text deeper than they need first:
//
//   if (JsonNesting(text) > 64) return DataLossError("... nests deeper than 64 levels");
#ifndef DTENSOR_TENSOR_JSON_NESTING_H_
#define DTENSOR_TENSOR_JSON_NESTING_H_

#include <algorithm>
#include <cstdint>
#include <string_view>

namespace dtensor {

// The greatest number of '[' / '{' open at once outside strings (0 for a scalar). Malformed
// text is measured as well as it can be; the parser reports what is wrong with it.
inline int64_t JsonNesting(std::string_view text) {
  int64_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (ch == '\\') {
        escaped = true;
      } else if (ch == '"') {
        in_string = false;
      }
      continue;
    }
    if (ch == '"') in_string = true;
    if (ch == '[' || ch == '{') deepest = std::max(deepest, ++depth);
    if (ch == ']' || ch == '}') --depth;
  }
  return deepest;
}

}  // namespace dtensor

#endif  // DTENSOR_TENSOR_JSON_NESTING_H_
