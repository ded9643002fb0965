#include "dtensor/nn/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "dtensor/nn/file_io.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/json_nesting.h"
#include "dtensor/tensor/status.h"
#include "nlohmann/json.hpp"

namespace dtensor {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts need "
              "byte swapping, which is not implemented");

using Json = nlohmann::ordered_json;  // keeps the header's key order (= the tensors' order)

constexpr const char* kMetadataKey = "__metadata__";
// The reference implementation refuses headers over 100 MB; so do we (a corrupted length
// must not make us allocate gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeEntry {
  const char* name;
  DType dtype;
};
constexpr DTypeEntry kDTypes[] = {
    {"F32", DType::kFloat32},        {"BF16", DType::kBFloat16},      {"F16", DType::kFloat16},
    {"I32", DType::kInt32},          {"I64", DType::kInt64},          {"BOOL", DType::kBool},
    {"F8_E4M3", DType::kFloat8E4M3}, {"F8_E5M2", DType::kFloat8E5M2},
};
// Valid safetensors dtypes that dtensor has no DType for.
constexpr const char* kUnsupportedDTypes[] = {"F64", "U8",      "I8", "I16",     "U16",     "U32",
                                              "U64", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"};

absl::Status ErrnoError(const char* op, const std::string& what, const std::string& path, int err) {
  return absl::ErrnoToStatus(err, absl::StrCat("[", op, "] ", what, " '", path, "'"));
}

// Reads exactly n bytes at `offset`; false with errno set (0 for an unexpected end of file).
bool ReadAllAt(int fd, void* data, size_t n, uint64_t offset) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (r == 0) {
      errno = 0;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return true;
}

// Prefix for read errors: "[ReadSafetensors] <path>: ".
std::string ReadPrefix(const std::string& path) { return absl::StrCat("[ReadSafetensors] ", path, ": "); }

template <typename... Args>
absl::Status ReadError(const std::string& path, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(ReadPrefix(path), args...));
}

// Parses one JSON number that must be a non-negative integer into `out`.
bool AsUint64(const Json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer()) {
    int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    *out = static_cast<uint64_t>(v);
    return true;
  }
  return false;
}

// A short description of a JSON value for an error message: scalars as written (invalid
// UTF-8 replaced), arrays and objects by their size only (dumping them whole recurses as deep
// as the input nests: a hostile header could overflow the stack).
std::string Excerpt(const Json& j) {
  const bool flat_array = j.is_array() && j.size() <= 16 &&
                          std::none_of(j.begin(), j.end(), [](const Json& e) { return e.is_structured(); });
  if (j.is_structured() && !flat_array) return absl::StrCat(j.type_name(), " of ", j.size(), " entries");
  std::string s = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin;
  uint64_t end;
};

// Validates one tensor entry of the header.
absl::Status ParseEntry(const std::string& path, const std::string& name, const Json& j, Entry* e) {
  e->name = name;
  if (!j.is_object()) return ReadError(path, "tensor '", name, "': entry is not a JSON object: ", Excerpt(j));
  auto dt = j.find("dtype");
  auto sh = j.find("shape");
  auto off = j.find("data_offsets");
  if (dt == j.end() || sh == j.end() || off == j.end()) {
    return ReadError(path, "tensor '", name, "': entry needs \"dtype\", \"shape\" and \"data_offsets\": ", Excerpt(j));
  }
  if (!dt->is_string()) return ReadError(path, "tensor '", name, "': dtype is not a string: ", Excerpt(*dt));
  const std::string dname = dt->get<std::string>();
  bool found = false;
  for (const DTypeEntry& d : kDTypes) {
    if (dname == d.name) {
      e->dtype = d.dtype;
      found = true;
    }
  }
  if (!found) {
    for (const char* u : kUnsupportedDTypes) {
      if (dname == u) {
        return ReadError(path, "tensor '", name, "': dtype ", dname,
                         " is valid safetensors but dtensor has no such DType (supported: F32, BF16, F16, I32, I64, "
                         "BOOL, F8_E4M3, F8_E5M2)");
      }
    }
    return ReadError(path, "tensor '", name, "': unknown dtype \"", dname, "\"");
  }
  if (!sh->is_array()) return ReadError(path, "tensor '", name, "': shape is not an array: ", Excerpt(*sh));
  if (sh->size() > static_cast<size_t>(kMaxDims)) {
    return ReadError(path, "tensor '", name, "': shape ", Excerpt(*sh), " has more than ", kMaxDims, " dims");
  }
  uint64_t numel = 1;
  bool overflow = false;
  e->shape.clear();
  for (const Json& d : *sh) {
    uint64_t v;
    if (!AsUint64(d, &v) || v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return ReadError(path, "tensor '", name, "': shape ", Excerpt(*sh), " is not a list of non-negative integers");
    }
    e->shape.push_back(static_cast<int64_t>(v));
    if (v != 0 && numel > std::numeric_limits<uint64_t>::max() / v) overflow = true;
    numel *= v;
  }
  const uint64_t esize = ElementSize(e->dtype);
  if (overflow || numel > std::numeric_limits<uint64_t>::max() / esize) {
    return ReadError(path, "tensor '", name, "': shape ", Excerpt(*sh), " overflows 64-bit byte counts");
  }
  if (!off->is_array() || off->size() != 2 || !AsUint64((*off)[0], &e->begin) || !AsUint64((*off)[1], &e->end)) {
    return ReadError(path, "tensor '", name, "': data_offsets ", Excerpt(*off),
                     " is not a pair [begin, end] of non-negative integers");
  }
  if (e->end < e->begin) {
    return ReadError(path, "tensor '", name, "': data_offsets [", e->begin, ", ", e->end, "] has end < begin");
  }
  if (e->end - e->begin != numel * esize) {
    return ReadError(path, "tensor '", name, "': data_offsets [", e->begin, ", ", e->end, "] span ", e->end - e->begin,
                     " bytes but shape ", ShapeString(e->shape), " of ", dname, " needs ", numel * esize);
  }
  return absl::OkStatus();
}

}  // namespace

const Tensor* NamedTensors::Find(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

const char* SafetensorsDTypeName(DType dtype) {
  for (const DTypeEntry& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

absl::Status WriteSafetensors(const std::string& path, absl::Span<const std::pair<std::string, Tensor>> tensors,
                              const std::map<std::string, std::string>& metadata) {
  constexpr const char* kOp = "WriteSafetensors";
  // Contiguous host copies, and the header in the given order.
  std::vector<Tensor> host;
  host.reserve(tensors.size());
  std::set<std::string> names;
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header[kMetadataKey] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name.empty() || name == kMetadataKey) {
      return InvalidArg(kOp, "invalid tensor name '", name, "' for '", path, "'");
    }
    if (!names.insert(name).second) return InvalidArg(kOp, "tensor name '", name, "' repeats, writing '", path, "'");
    if (!t.defined()) return InvalidArg(kOp, "tensor '", name, "' is undefined, writing '", path, "'");
    DT_ASSIGN_OR_RETURN(Tensor cpu, To(t, Device::Cpu()));
    DT_ASSIGN_OR_RETURN(Tensor c, Contiguous(cpu));
    Json shape = Json::array();
    for (int64_t d : c.shape()) shape.push_back(d);
    const uint64_t nbytes = c.nbytes();
    header[name] = Json{{"dtype", SafetensorsDTypeName(c.dtype())},
                        {"shape", std::move(shape)},
                        {"data_offsets", Json::array({offset, offset + nbytes})}};
    offset += nbytes;
    host.push_back(std::move(c));
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::type_error& e) {  // a name or metadata value that is not UTF-8
    return absl::InvalidArgumentError(
        absl::StrCat("[WriteSafetensors] ", path, ": names and metadata must be UTF-8 text (", e.what(), ")"));
  }
  // Pad with spaces (allowed by the format) so that the data section starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));

  std::vector<absl::string_view> pieces = {absl::string_view(reinterpret_cast<const char*>(len), 8), text};
  for (const Tensor& t : host) pieces.emplace_back(static_cast<const char*>(t.raw_data()), t.nbytes());
  DT_RETURN_IF_ERROR(WriteFileAtomically(kOp, path, pieces));
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> ReadSafetensors(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("[ReadSafetensors] no such file '", path, "'"));
    return ErrnoError("ReadSafetensors", "cannot open", path, errno);
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError("ReadSafetensors", "cannot stat", path, errno);
  if (!S_ISREG(st.st_mode)) return ReadError(path, "not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) return ReadError(path, "file is ", file_size, " bytes, too short for the 8-byte header length");

  uint8_t len[8];
  if (!ReadAllAt(fd, len, 8, 0)) return ErrnoError("ReadSafetensors", "cannot read", path, errno ? errno : EIO);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len[i]) << (8 * i);
  if (header_len == 0 || header_len > file_size - 8 || header_len > kMaxHeaderBytes) {
    return ReadError(path, "header length ", header_len, " is invalid for a file of ", file_size,
                     " bytes (must be in [1, min(file size - 8, ", kMaxHeaderBytes, ")])");
  }
  std::string text(header_len, '\0');
  if (!ReadAllAt(fd, text.data(), header_len, 8)) {
    return ErrnoError("ReadSafetensors", "cannot read", path, errno ? errno : EIO);
  }
  // A safetensors header nests 3 deep; a hostile one nested deeper would make parsing,
  // copying and printing it recurse until the stack overflows.
  constexpr int kMaxDepth = 64;
  if (JsonNesting(text) > kMaxDepth) return ReadError(path, "header nests deeper than ", kMaxDepth, " levels");
  Json header;
  try {
    header = Json::parse(text);
  } catch (const Json::exception& e) {
    return ReadError(path, "header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) return ReadError(path, "header is not a JSON object");

  NamedTensors result;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) return ReadError(path, "__metadata__ is not a JSON object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) return ReadError(path, "__metadata__ value of '", mk, "' is not a string: ", Excerpt(mv));
        result.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    Entry e;
    DT_RETURN_IF_ERROR(ParseEntry(path, key, value, &e));
    entries.push_back(std::move(e));
  }

  // The tensors must tile the data section exactly: no overlap, no gap, nothing past the end.
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = file_size - data_start;
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  std::stable_sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : by_offset) {
    if (e->end > data_size) {
      return ReadError(path, "tensor '", e->name, "': data_offsets [", e->begin, ", ", e->end,
                       "] go past the end of the data section (", data_size, " bytes)");
    }
    if (e->begin < covered) {
      return ReadError(path, "tensors '", prev->name, "' [", prev->begin, ", ", prev->end, ") and '", e->name, "' [",
                       e->begin, ", ", e->end, ") overlap");
    }
    if (e->begin > covered) {
      return ReadError(path, "bytes [", covered, ", ", e->begin, ") of the data section belong to no tensor (before '",
                       e->name, "')");
    }
    covered = e->end;
    prev = e;
  }
  if (covered != data_size) {
    return ReadError(path, "the data section has ", data_size, " bytes but the tensors cover only ", covered);
  }

  for (const Entry& e : entries) {
    auto t = Tensor::Empty(e.shape, e.dtype, Device::Cpu());
    if (!t.ok()) return ReadError(path, "tensor '", e.name, "': ", t.status().message());
    const size_t n = static_cast<size_t>(e.end - e.begin);
    if (n > 0 && !ReadAllAt(fd, t->raw_data(), n, data_start + e.begin)) {
      return ErrnoError("ReadSafetensors", absl::StrCat("cannot read tensor '", e.name, "' of"), path,
                        errno ? errno : EIO);
    }
    if (e.dtype == DType::kBool) {
      const uint8_t* b = static_cast<const uint8_t*>(t->raw_data());
      for (size_t i = 0; i < n; ++i) {
        if (b[i] > 1) return ReadError(path, "tensor '", e.name, "': BOOL element ", i, " is ", int{b[i]}, ", not 0/1");
      }
    }
    result.tensors.emplace_back(e.name, *std::move(t));
  }
  return result;
}

}  // namespace dtensor
