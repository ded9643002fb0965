#include "dtensor/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "dtensor/collectives/agree.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/json_nesting.h"
#include "dtensor/tensor/status.h"
#include "nlohmann/json.hpp"

namespace dtensor {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
constexpr const char* kMetadata = "metadata.json";
constexpr const char* kFormat = "dtensor-checkpoint";

std::string Errno() { return std::strerror(errno); }

std::vector<int64_t> Vec(IntSpan s) { return std::vector<int64_t>(s.begin(), s.end()); }

// An entry's tensor shape, and the shape it is stored in (checked: dims 0 and 1 merged).
absl::StatusOr<std::pair<Shape, Shape>> Shapes(const StateEntry& e) {
  const DTensor* d = std::get_if<DTensor>(&e.tensor);
  const Tensor& x = d != nullptr ? d->ToLocal() : std::get<Tensor>(e.tensor);
  const Shape shape =
      d != nullptr ? Shape(d->shape().begin(), d->shape().end()) : Shape(x.shape().begin(), x.shape().end());
  if (e.stored_shape.empty()) return std::make_pair(shape, shape);
  Shape merged;
  if (shape.size() >= 2) {
    merged.push_back(shape[0] * shape[1]);
    for (size_t i = 2; i < shape.size(); ++i) merged.push_back(shape[i]);
  }
  const Shape stored(e.stored_shape.begin(), e.stored_shape.end());
  if (merged != stored) {
    return absl::InvalidArgumentError(absl::StrCat("[Checkpoint] tensor ", e.name, " of shape ", ShapeString(shape),
                                                   " cannot be stored as ", ShapeString(stored),
                                                   " (only dims 0 and 1 merged)"));
  }
  return std::make_pair(shape, stored);
}

// A box of the tensor as boxes of the stored shape (dims 0 and 1 merged): one per index of
// its dim 0, in order, each holding box.shape[1..] elements.
std::vector<LocalBox> StoredBoxes(const LocalBox& box, const Shape& shape, const Shape& stored) {
  if (shape == stored) return {box};
  std::vector<LocalBox> out;
  for (int64_t i = 0; i < box.shape[0]; ++i) {
    LocalBox b{.offset = {(box.offset[0] + i) * shape[1] + box.offset[1]}, .shape = {box.shape[1]}};
    for (size_t d = 2; d < box.shape.size(); ++d) {
      b.offset.push_back(box.offset[d]);
      b.shape.push_back(box.shape[d]);
    }
    out.push_back(std::move(b));
  }
  return out;
}

absl::StatusOr<DType> ParseDType(const std::string& name) {
  // Every DType (kFloat8E5M2 is the last): a save writes any of them.
  for (int i = 0; i <= static_cast<int>(DType::kFloat8E5M2); ++i) {
    const DType t = static_cast<DType>(i);
    if (name == DTypeName(t)) return t;
  }
  return absl::DataLossError(absl::StrCat("unknown dtype '", name, "'"));
}

uint32_t Crc(const char* data, int64_t n) {
  uLong c = crc32(0L, Z_NULL, 0);
  while (n > 0) {  // crc32 takes a uInt length
    const uInt step = static_cast<uInt>(std::min<int64_t>(n, 1 << 30));
    c = crc32(c, reinterpret_cast<const Bytef*>(data), step);
    data += step;
    n -= step;
  }
  return static_cast<uint32_t>(c);
}

absl::Status WriteAll(int fd, const char* data, int64_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)));
    if (w < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("[SaveCheckpoint] writing ", path, ": ", Errno()));
    }
    data += w;
    n -= w;
  }
  return absl::OkStatus();
}

absl::Status FsyncPath(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) return absl::InternalError(absl::StrCat("[SaveCheckpoint] opening ", path, ": ", Errno()));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat("[SaveCheckpoint] fsync ", path, ": ", Errno()));
  return absl::OkStatus();
}

// `root` normalised lexically ("a//b/./c/" -> "a/b/c"), without a trailing separator.
fs::path NormalRoot(const std::string& root) {
  fs::path p = fs::path(root).lexically_normal();
  if (p.has_relative_path() && !p.has_filename()) p = p.parent_path();
  return p;
}

// An open directory, flock'ed (exclusively) while this object lives: a save holds its
// temporary directory so, and the removal of stale ones skips a directory a live save holds.
class DirLock {
 public:
  DirLock() = default;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  ~DirLock() { Release(); }
  // Takes the lock on `dir` without waiting: true when it is held now, or when the
  // filesystem has no flock (then nothing is held); false when another holds it or `dir`
  // cannot be opened.
  bool TryLock(const std::string& dir) {
    Release();
    fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd_ < 0) return false;
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return true;
    const bool held_by_another = errno == EWOULDBLOCK;
    Release();
    return !held_by_another;
  }
  void Release() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// The name a .tmp- directory is for: ".tmp-<name>.<16 hex digits>" (".tmp-<name>" as older
// versions named it).
std::string TemporaryOf(const std::string& dir_name) {
  std::string of = dir_name.substr(5);
  if (of.size() > 17 && of[of.size() - 17] == '.' &&
      of.find_first_not_of("0123456789abcdef", of.size() - 16) == std::string::npos) {
    of.resize(of.size() - 17);
  }
  return of;
}

// All ranks stop together when any failed (AgreeOnStatus); a peer's failure is named as such.
absl::Status Agree(Communicator& world, const absl::Status& mine, const char* what) {
  absl::Status all = AgreeOnStatus(world, mine, absl::StrCat("[SaveCheckpoint] ", what));
  if (all.ok() || !mine.ok()) return all;
  return absl::Status(all.code(), absl::StrCat(all.message(), " (nothing was committed)"));
}

// Whether two boxes (offset, shape) of one tensor share an element.
bool BoxesOverlap(const Shape& a_offset, const Shape& a_box, const Shape& b_offset, const Shape& b_box) {
  if (a_box.size() != b_box.size()) return false;
  for (size_t d = 0; d < a_box.size(); ++d) {
    if (a_box[d] == 0 || b_box[d] == 0) return false;
    if (a_offset[d] >= b_offset[d] + b_box[d] || b_offset[d] >= a_offset[d] + a_box[d]) return false;
  }
  return true;
}

// The elements two boxes share.
int64_t OverlapElements(const Shape& a_offset, const Shape& a_box, const Shape& b_offset, const Shape& b_box) {
  if (a_box.size() != b_box.size()) return 0;
  int64_t n = 1;
  for (size_t d = 0; d < a_box.size(); ++d) {
    const int64_t lo = std::max(a_offset[d], b_offset[d]);
    const int64_t hi = std::min(a_offset[d] + a_box[d], b_offset[d] + b_box[d]);
    if (hi <= lo) return 0;
    n *= hi - lo;
  }
  return n;
}

// Names in the order their numbers count: runs of digits compare as numbers (step-100000000
// after step-99999999), the rest as text.
bool NaturalLess(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      size_t ie = i, je = j;
      while (ie < a.size() && digit(a[ie])) ++ie;
      while (je < b.size() && digit(b[je])) ++je;
      size_t is = i, js = j;  // leading zeros aside
      while (is + 1 < ie && a[is] == '0') ++is;
      while (js + 1 < je && b[js] == '0') ++js;
      if (ie - is != je - js) return ie - is < je - js;
      const int c = a.compare(is, ie - is, b, js, je - js);
      if (c != 0) return c < 0;
      if (ie - i != je - j) return ie - i < je - j;  // equal numbers: fewer zeros first
      i = ie;
      j = je;
      continue;
    }
    if (a[i] != b[j]) return a[i] < b[j];
    ++i;
    ++j;
  }
  return a.size() - i < b.size() - j;
}

// A name with each run of digits as '#': checkpoints of one series share it (step-00000010).
std::string NameForm(const std::string& name) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!digit(name[i])) {
      out.push_back(name[i]);
    } else if (i == 0 || !digit(name[i - 1])) {
      out.push_back('#');
    }
  }
  return out;
}

// One piece this rank writes: a box of a tensor, its bytes on the CPU.
struct Piece {
  std::string tensor = "";
  Shape global = {};
  DType dtype = DType::kFloat32;
  LocalBox box = {};
  Tensor data = Tensor();  // contiguous, CPU
};

// The pieces this rank owns (Partial values reduced first: collective over their meshes).
absl::StatusOr<std::vector<Piece>> PiecesOf(Communicator& world, const CheckpointState& state, bool copy) {
  std::vector<Piece> pieces;
  for (const StateEntry& e : state) {
    const std::string& name = e.name;
    const StateTensor& t = e.tensor;
    DT_ASSIGN_OR_RETURN(auto shapes, Shapes(e));
    Piece p{.tensor = name};
    if (const DTensor* d = std::get_if<DTensor>(&t)) {
      DTensor v = *d;
      if (v.layout().has_partial()) {
        Layout r = v.layout();
        for (int m = 0; m < r.ndim(); ++m) {
          if (r[m].is_partial()) r = r.WithPlacement(m, Replicate());
        }
        DT_ASSIGN_OR_RETURN(v, v.Redistribute(r));
      }
      bool writer = true;  // one rank per distinct piece: coordinate 0 where not sharded
      for (int m = 0; m < v.layout().ndim(); ++m) {
        if (!v.layout()[m].is_shard() && v.mesh().coordinate(m) != 0) writer = false;
      }
      if (!writer) continue;
      p.global = Shape(v.shape().begin(), v.shape().end());
      p.dtype = v.dtype();
      p.box = LocalBoxOf(v.shape(), v.mesh().shape(), v.layout(), v.mesh().coordinate());
      p.data = v.ToLocal();
    } else {
      if (world.rank() != 0) continue;
      const Tensor& x = std::get<Tensor>(t);
      p.global = Shape(x.shape().begin(), x.shape().end());
      p.dtype = x.dtype();
      p.box = LocalBox{.offset = Shape(x.shape().size(), 0), .shape = p.global};
      p.data = x;
    }
    if (p.box.numel() == 0) continue;
    const bool on_cpu = p.data.device().is_cpu();
    if (!on_cpu) {  // device -> host into pinned staging memory (at full bus speed)
      DT_ASSIGN_OR_RETURN(Tensor staged, Tensor::EmptyPinned(p.data.shape(), p.data.dtype()));
      DT_RETURN_IF_ERROR(Copy_(staged, p.data));
      p.data = std::move(staged);
    }
    DT_ASSIGN_OR_RETURN(p.data, Contiguous(p.data));
    if (copy && on_cpu) {  // staged: training may change the tensor while the copy is written
      DT_ASSIGN_OR_RETURN(p.data, Clone(p.data));
    }
    if (shapes.first == shapes.second) {
      pieces.push_back(std::move(p));
      continue;
    }
    // Stored with dims 0 and 1 merged: one piece per index of the box's dim 0.
    const std::vector<LocalBox> boxes = StoredBoxes(p.box, shapes.first, shapes.second);
    for (size_t i = 0; i < boxes.size(); ++i) {
      DT_ASSIGN_OR_RETURN(Tensor slice, p.data.Select(0, static_cast<int64_t>(i)));
      pieces.push_back(
          Piece{.tensor = name, .global = shapes.second, .dtype = p.dtype, .box = boxes[i], .data = slice});
    }
  }
  return pieces;
}

// Writes this rank's pieces into `dir`/rank-<r>.bin (fsynced) and describes them.
absl::StatusOr<Json> WritePieces(int rank, const std::string& dir, const std::vector<Piece>& pieces,
                                 int64_t block_bytes) {
  Json out = Json::array();
  if (pieces.empty()) return out;
  const std::string file = absl::StrFormat("rank-%05d.bin", rank);
  const std::string path = dir + "/" + file;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("[SaveCheckpoint] creating ", path, ": ", Errno()));
  absl::Status s;
  int64_t offset = 0;
  for (const Piece& p : pieces) {
    const char* bytes = static_cast<const char*>(p.data.raw_data());
    const int64_t n = static_cast<int64_t>(p.data.nbytes());
    s = WriteAll(fd, bytes, n, path);
    if (!s.ok()) break;
    std::vector<uint32_t> crcs;
    for (int64_t b = 0; b < n; b += block_bytes) crcs.push_back(Crc(bytes + b, std::min(block_bytes, n - b)));
    out.push_back({{"tensor", p.tensor},
                   {"shape", Vec(p.global)},
                   {"dtype", DTypeName(p.dtype)},
                   {"offset", Vec(p.box.offset)},
                   {"box", Vec(p.box.shape)},
                   {"file", file},
                   {"file_offset", offset},
                   {"bytes", n},
                   {"crc32", crcs}});
    offset += n;
  }
  if (s.ok() && ::fsync(fd) != 0) s = absl::InternalError(absl::StrCat("[SaveCheckpoint] fsync ", path, ": ", Errno()));
  ::close(fd);
  if (!s.ok()) return s;
  return out;
}

// The metadata is read defensively: it is a file, so any value may have any JSON type (reading
// one as another would throw), and numbers are checked before they are used as sizes.

// `j` as an int64 when it is an integer that fits, else `fallback`.
int64_t IntOr(const Json& j, int64_t fallback) {
  if (j.is_number_unsigned()) {
    const uint64_t v = j.get<uint64_t>();
    return v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? fallback : static_cast<int64_t>(v);
  }
  return j.is_number_integer() ? j.get<int64_t>() : fallback;
}

// The integer member `key` of the object `j` (see IntOr), or `fallback` when it has none.
int64_t IntMemberOr(const Json& j, const char* key, int64_t fallback) {
  return j.contains(key) ? IntOr(j[key], fallback) : fallback;
}

// `j` as a shape or box (an array of non-negative int64s), when it is one.
std::optional<Shape> AsShape(const Json& j) {
  if (!j.is_array() || j.size() > 64) return std::nullopt;
  Shape out;
  for (const Json& e : j) {
    const int64_t v = IntOr(e, -1);
    if (v < 0) return std::nullopt;
    out.push_back(v);
  }
  return out;
}

// Rank 0: the metadata from every rank's pieces (a piece two ranks wrote, e.g. a DTensor on
// sub-meshes that replicate it, is kept once), checked for agreement.
// Every tensor's name, stored shape and dtype, as this rank holds them (rank 0's become the
// metadata), with no pieces yet.
absl::StatusOr<Json> Skeleton(const CheckpointState& state) {
  Json tensors = Json::object();
  std::map<std::string, size_t> index;  // name -> its entry
  for (size_t i = 0; i < state.size(); ++i) {
    const StateEntry& e = state[i];
    if (auto [it, fresh] = index.emplace(e.name, i); !fresh) {
      return absl::InvalidArgumentError(absl::StrCat("[SaveCheckpoint] tensor name \"", absl::CHexEscape(e.name),
                                                     "\" is given twice (entries ", it->second, " and ", i, ")"));
    }
    // Names go into JSON, which holds UTF-8 only (printing another name throws).
    try {
      (void)Json(e.name).dump();
    } catch (const Json::exception&) {
      return absl::InvalidArgumentError(
          absl::StrCat("[SaveCheckpoint] tensor name \"", absl::CHexEscape(e.name), "\" is not UTF-8"));
    }
    const DTensor* d = std::get_if<DTensor>(&e.tensor);
    const Tensor& x = d != nullptr ? d->ToLocal() : std::get<Tensor>(e.tensor);
    DT_ASSIGN_OR_RETURN(auto shapes, Shapes(e));
    tensors[e.name] = {{"shape", Vec(shapes.second)}, {"dtype", DTypeName(x.dtype())}, {"pieces", Json::array()}};
  }
  return tensors;
}

absl::StatusOr<Json> BuildMetadata(Json tensors, const std::vector<std::string>& texts, int64_t block_bytes) {
  std::map<std::pair<std::string, std::string>, bool> seen;  // (tensor, box) written
  for (size_t r = 0; r < texts.size(); ++r) {
    Json pieces = Json::parse(texts[r], nullptr, false);
    if (pieces.is_discarded()) return absl::InternalError(absl::StrCat("[SaveCheckpoint] rank ", r, "'s description"));
    for (Json& p : pieces) {
      const std::string name = p["tensor"];
      if (!tensors.contains(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("[SaveCheckpoint] rank ", r, " saves tensor ", name, ", which rank 0's state does not name"));
      }
      Json& t = tensors[name];
      if (t["shape"] != p["shape"] || t["dtype"] != p["dtype"]) {
        return absl::InvalidArgumentError(absl::StrCat("[SaveCheckpoint] tensor ", name, " is ", t["shape"].dump(), " ",
                                                       t["dtype"].dump(), " on one rank and ", p["shape"].dump(), " ",
                                                       p["dtype"].dump(), " on rank ", r));
      }
      const auto key = std::make_pair(name, p["offset"].dump() + p["box"].dump());
      if (seen[key]) continue;
      seen[key] = true;
      p.erase("tensor");
      p.erase("shape");
      p.erase("dtype");
      p["rank"] = r;  // for the check below (dropped after it)
      t["pieces"].push_back(p);
    }
  }
  // Every tensor's pieces must cover it exactly: disjoint boxes whose elements add up to its
  // own (ranks that disagree on a DTensor's layout, or a rank that leaves a sharded tensor
  // out, would otherwise commit a checkpoint that cannot load, and `keep` would prune the
  // good one before it).
  for (auto& [name, t] : tensors.items()) {
    auto shape_of = [](const Json& j) {  // (the ranks' own descriptions: valid)
      Shape out;
      if (std::optional<Shape> s = AsShape(j); s.has_value()) out = *s;
      return out;
    };
    const Shape shape = shape_of(t["shape"]);
    int64_t covered = 0;
    std::vector<std::pair<Shape, Shape>> boxes;  // (offset, box)
    for (const Json& p : t["pieces"]) boxes.emplace_back(shape_of(p["offset"]), shape_of(p["box"]));
    for (size_t a = 0; a < boxes.size(); ++a) {
      covered += NumElements(boxes[a].second);
      for (size_t b = a + 1; b < boxes.size(); ++b) {
        if (!BoxesOverlap(boxes[a].first, boxes[a].second, boxes[b].first, boxes[b].second)) continue;
        return absl::InvalidArgumentError(absl::StrCat(
            "[SaveCheckpoint] tensor ", name, ": rank ", t["pieces"][a]["rank"].get<int64_t>(), "'s piece (offset ",
            ShapeString(boxes[a].first), ", box ", ShapeString(boxes[a].second), ") and rank ",
            t["pieces"][b]["rank"].get<int64_t>(), "'s (offset ", ShapeString(boxes[b].first), ", box ",
            ShapeString(boxes[b].second), ") overlap: do the ranks give it the same layout?"));
      }
    }
    if (covered != NumElements(shape)) {
      return absl::InvalidArgumentError(
          absl::StrCat("[SaveCheckpoint] tensor ", name, " ", ShapeString(shape), ": the ranks' pieces hold ", covered,
                       " of its ", NumElements(shape), " elements: does every rank save it, with the same layout?"));
    }
    for (Json& p : t["pieces"]) p.erase("rank");
  }
  return Json{{"format", kFormat}, {"version", 1}, {"block_bytes", block_bytes}, {"tensors", tensors}};
}

absl::Status CommitMetadata(const std::string& tmp, const std::string& final_dir, const std::string& root,
                            const Json& metadata) {
  const std::string path = tmp + "/" + kMetadata, part = path + ".part";
  {
    std::ofstream out(part, std::ios::trunc);
    out << metadata.dump(1) << "\n";
    if (!out.flush()) return absl::InternalError(absl::StrCat("[SaveCheckpoint] writing ", part));
  }
  DT_RETURN_IF_ERROR(FsyncPath(part, false));
  if (::rename(part.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("[SaveCheckpoint] renaming ", part, ": ", Errno()));
  }
  DT_RETURN_IF_ERROR(FsyncPath(tmp, true));
  // Never over another checkpoint: a save of the same name by another job may have committed
  // since this one began (a filesystem without RENAME_NOREPLACE still refuses to rename a
  // directory over a non-empty one, as a checkpoint is).
  int rc = ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_NOREPLACE);
  if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) rc = ::rename(tmp.c_str(), final_dir.c_str());
  if (rc != 0) {
    if (errno == EEXIST || errno == ENOTEMPTY) {
      return absl::AlreadyExistsError(
          absl::StrCat("[SaveCheckpoint] ", final_dir, " exists (another save of that name committed first)"));
    }
    return absl::InternalError(absl::StrCat("[SaveCheckpoint] renaming ", tmp, " to ", final_dir, ": ", Errno()));
  }
  return FsyncPath(root, true);
}

// The complete checkpoints under root, oldest first.
std::vector<std::string> Complete(const std::string& root) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n.empty() || n[0] == '.' || !e.is_directory(ec)) continue;
    if (fs::is_regular_file(e.path() / kMetadata, ec)) names.push_back(n);
  }
  std::sort(names.begin(), names.end(), NaturalLess);
  return names;
}

// ---- Loading ----

class Files {
 public:
  explicit Files(std::string dir, LoadStats* stats) : dir_(std::move(dir)), stats_(stats) {}
  ~Files() {
    for (auto& [name, fd] : fds_) ::close(fd);
  }
  // Reads exactly n bytes at `offset` of `file`; NotFound / DataLoss naming file and tensor.
  absl::Status Read(const std::string& file, int64_t offset, int64_t n, char* out, const std::string& tensor) {
    auto it = fds_.find(file);
    if (it == fds_.end()) {
      const std::string path = dir_ + "/" + file;
      const int fd = ::open(path.c_str(), O_RDONLY);
      if (fd < 0) {
        return absl::NotFoundError(
            absl::StrCat("[LoadCheckpoint] tensor ", tensor, ": cannot open ", path, ": ", Errno()));
      }
      it = fds_.emplace(file, fd).first;
      if (stats_ != nullptr) ++stats_->files_opened;
    }
    int64_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(it->second, out + done, static_cast<size_t>(n - done), offset + done);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        return absl::DataLossError(absl::StrCat("[LoadCheckpoint] tensor ", tensor, ": ", dir_, "/", file,
                                                " is truncated or unreadable: wanted bytes [", offset, ", ", offset + n,
                                                "), got ", done, r < 0 ? ": " + Errno() : ""));
      }
      done += r;
    }
    if (stats_ != nullptr) stats_->bytes_read += n;
    return absl::OkStatus();
  }

 private:
  std::string dir_;
  LoadStats* stats_;
  std::map<std::string, int> fds_;
};

// One stored piece, validated against its tensor's stored shape.
struct PieceInfo {
  Shape offset;  // in the stored shape
  Shape box;
  std::string file;  // a file name in the checkpoint directory
  int64_t file_offset = 0;
  int64_t bytes = 0;
  std::vector<uint32_t> crcs;  // one per block_bytes
};

bool BoxesOverlap(const PieceInfo& a, const PieceInfo& b) { return BoxesOverlap(a.offset, a.box, b.offset, b.box); }

absl::StatusOr<PieceInfo> ParsePiece(const Json& j, const Shape& stored, int64_t elem, int64_t block_bytes,
                                     const std::string& tensor, const std::string& dir) {
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("[LoadCheckpoint] tensor ", tensor, " in ", dir, ": a piece with ", what));
  };
  if (!j.is_object()) return bad("a JSON " + std::string(j.type_name()) + " for a piece");
  PieceInfo p;
  const std::optional<Shape> offset = j.contains("offset") ? AsShape(j["offset"]) : std::nullopt;
  const std::optional<Shape> box = j.contains("box") ? AsShape(j["box"]) : std::nullopt;
  if (!offset.has_value() || !box.has_value() || offset->size() != stored.size() || box->size() != stored.size()) {
    return bad(absl::StrCat("no offset and box of ", stored.size(), " non-negative integers"));
  }
  p.offset = *offset;
  p.box = *box;
  int64_t numel = 1;
  for (size_t d = 0; d < stored.size(); ++d) {
    if (p.offset[d] > stored[d] || p.box[d] > stored[d] - p.offset[d]) {
      return bad(absl::StrCat("offset ", ShapeString(p.offset), " and box ", ShapeString(p.box), " outside ",
                              ShapeString(stored)));
    }
    numel *= p.box[d];  // <= the stored tensor's element count
  }
  if (!j.contains("file") || !j["file"].is_string()) return bad("no file name");
  p.file = j["file"].get<std::string>();
  if (p.file.empty() || p.file == "." || p.file == ".." || p.file.find('/') != std::string::npos ||
      p.file.find('\0') != std::string::npos) {
    return bad(absl::StrCat("file \"", absl::CHexEscape(p.file), "\" (not a file name in the checkpoint directory)"));
  }
  p.file_offset = IntMemberOr(j, "file_offset", -1);
  p.bytes = IntMemberOr(j, "bytes", -1);
  if (p.file_offset < 0 || p.bytes < 0 || p.bytes > std::numeric_limits<int64_t>::max() - p.file_offset) {
    return bad("no valid file_offset and bytes");
  }
  if (numel > std::numeric_limits<int64_t>::max() / elem || p.bytes != numel * elem) {
    return bad(absl::StrCat(p.bytes, " bytes for a box ", ShapeString(p.box), " of ", elem, "-byte elements"));
  }
  const int64_t blocks = p.bytes / block_bytes + (p.bytes % block_bytes != 0 ? 1 : 0);
  if (!j.contains("crc32") || !j["crc32"].is_array() || static_cast<int64_t>(j["crc32"].size()) != blocks) {
    return bad(absl::StrCat("no crc32 array of ", blocks, " checksums"));
  }
  for (const Json& c : j["crc32"]) {
    const int64_t v = IntOr(c, -1);
    if (v < 0 || v > int64_t{0xffffffff}) return bad("a crc32 that is not a 32-bit checksum");
    p.crcs.push_back(static_cast<uint32_t>(v));
  }
  return p;
}

// Copies the part of a stored piece that overlaps `box` into `out` (box-shaped, row-major),
// reading and verifying only the checksum blocks that hold it; returns the elements copied.
absl::StatusOr<int64_t> CopyOverlap(Files& files, const PieceInfo& piece, const LocalBox& box, int64_t elem,
                                    int64_t block_bytes, const std::string& tensor, char* out) {
  const Shape& po = piece.offset;
  const Shape& ps = piece.box;
  const size_t nd = box.shape.size();
  if (po.size() != nd || ps.size() != nd) {
    return absl::DataLossError(absl::StrCat("[LoadCheckpoint] tensor ", tensor, ": a piece of the wrong rank"));
  }
  Shape lo(nd), ext(nd);
  for (size_t d = 0; d < nd; ++d) {
    lo[d] = std::max(po[d], box.offset[d]);
    const int64_t hi = std::min(po[d] + ps[d], box.offset[d] + box.shape[d]);
    if (hi <= lo[d]) return int64_t{0};
    ext[d] = hi - lo[d];
  }
  // Runs: the innermost dims the overlap spans whole in both boxes, plus the next one's extent.
  size_t inner = nd;
  int64_t run = 1;
  while (inner > 0 && ext[inner - 1] == ps[inner - 1] && ext[inner - 1] == box.shape[inner - 1]) {
    run *= ext[--inner];
  }
  if (inner > 0) run *= ext[--inner];  // the dims [inner, nd) form one contiguous run
  const std::string& file = piece.file;
  const int64_t file_offset = piece.file_offset, bytes = piece.bytes;
  const std::vector<uint32_t>& crcs = piece.crcs;
  // The last verified block of this piece: the copy below reads the piece front to back, so
  // a block once left is not needed again (memory: one block, not the piece).
  int64_t cached = -1;
  std::vector<char> data;
  auto block = [&](int64_t b) -> absl::StatusOr<const std::vector<char>*> {
    if (b == cached) return &data;
    const int64_t begin = b * block_bytes, n = std::min(block_bytes, bytes - begin);
    if (b < 0 || n <= 0 || static_cast<size_t>(b) >= crcs.size()) {
      return absl::DataLossError(
          absl::StrCat("[LoadCheckpoint] tensor ", tensor, ": block ", b, " of ", file, " is outside the piece"));
    }
    cached = -1;
    data.resize(static_cast<size_t>(n));
    DT_RETURN_IF_ERROR(files.Read(file, file_offset + begin, n, data.data(), tensor));
    if (Crc(data.data(), n) != crcs[static_cast<size_t>(b)]) {
      return absl::DataLossError(absl::StrCat("[LoadCheckpoint] tensor ", tensor, ": checksum mismatch in ", file,
                                              " bytes [", file_offset + begin, ", ", file_offset + begin + n, ")"));
    }
    cached = b;
    return &data;
  };
  // Every index of the dims before `inner`, row-major.
  Shape idx(inner, 0);
  int64_t copied = 0;
  while (true) {
    int64_t src = 0, dst = 0;  // element offsets in the piece and in the box
    for (size_t d = 0; d < nd; ++d) {
      const int64_t g = lo[d] + (d < inner ? idx[d] : 0);
      src = src * ps[d] + (g - po[d]);
      dst = dst * box.shape[d] + (g - box.offset[d]);
    }
    int64_t s = src * elem, n = run * elem;
    char* o = out + dst * elem;
    while (n > 0) {  // across blocks
      const int64_t b = s / block_bytes, in = s - b * block_bytes;
      DT_ASSIGN_OR_RETURN(const std::vector<char>* bytes_of_b, block(b));
      const int64_t take = std::min<int64_t>(n, static_cast<int64_t>(bytes_of_b->size()) - in);
      if (take <= 0) {
        return absl::DataLossError(absl::StrCat("[LoadCheckpoint] tensor ", tensor, ": ", file,
                                                " holds fewer bytes "
                                                "than its piece"));
      }
      std::memcpy(o, bytes_of_b->data() + in, static_cast<size_t>(take));
      o += take;
      s += take;
      n -= take;
    }
    copied += run;
    if (inner == 0) break;
    size_t d = inner;
    while (d > 0 && ++idx[d - 1] == ext[d - 1]) idx[--d] = 0;
    if (d == 0) break;
  }
  return copied;
}

}  // namespace

// One save: Begin (collective: the directory, the pieces on the host), Write (this rank's
// files, no communication: a background thread may run it), Finish (collective: agree, the
// metadata, the rename).
struct AsyncCheckpointSave::Job {
  Communicator* world = nullptr;
  std::string root = "", name = "", tmp = "", final_dir = "";
  DirLock tmp_lock = {};  // rank 0: on tmp, from Begin to Finish
  SaveOptions options = {};
  Json skeleton = Json::object();
  std::vector<Piece> pieces = {};
  absl::StatusOr<Json> written = absl::UnknownError("not written");
};

namespace {

using SaveJob = AsyncCheckpointSave::Job;

// Rank 0, after every rank has stopped writing to it: removes this save's directory.
void Abandon(SaveJob& job) {
  if (job.world->rank() != 0 || job.tmp.empty()) return;
  std::error_code ec;
  fs::remove_all(job.tmp, ec);
  job.tmp_lock.Release();
}

absl::Status Begin(SaveJob& job, const CheckpointState& state, bool copy) {
  const std::string& name = job.name;
  if (name.empty() || name[0] == '.' || name.find('/') != std::string::npos || job.options.block_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat("[SaveCheckpoint] name '", name,
                                                   "' (non-empty, no '/', not starting with '.') or block_bytes ",
                                                   job.options.block_bytes, " (>= 1)"));
  }
  if (job.root.empty()) return absl::InvalidArgumentError("[SaveCheckpoint] the root is empty");
  job.root = NormalRoot(job.root).string();
  job.final_dir = job.root + "/" + name;
  Communicator& world = *job.world;
  absl::Status prepared;
  std::string tmp_name;  // rank 0's: the ranks write where it says
  if (world.rank() == 0) {
    std::error_code ec;
    prepared = MakeCheckpointRoot(job.root);
    if (prepared.ok() && fs::exists(job.final_dir, ec)) {
      prepared = absl::AlreadyExistsError(absl::StrCat("[SaveCheckpoint] ", job.final_dir, " exists"));
    } else if (prepared.ok()) {
      // A directory of this save's own (another job may save the same name into this root at
      // the same time), never one that exists.
      std::random_device device;
      std::mt19937_64 random((uint64_t{device()} << 32) ^ device() ^ (static_cast<uint64_t>(::getpid()) << 20) ^
                             static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
      prepared = absl::InternalError(absl::StrCat("[SaveCheckpoint] no free temporary name in ", job.root));
      for (int attempt = 0; attempt < 16; ++attempt) {
        tmp_name = absl::StrFormat(".tmp-%s.%016x", name, random());
        const std::string tmp = job.root + "/" + tmp_name;
        if (::mkdir(tmp.c_str(), 0777) == 0) {
          if (!job.tmp_lock.TryLock(tmp)) {
            prepared =
                absl::InternalError(absl::StrCat("[SaveCheckpoint] locking ", tmp, " (removed by another save?)"));
            ::rmdir(tmp.c_str());
          } else {
            prepared = absl::OkStatus();
          }
          break;
        }
        if (errno != EEXIST) {
          prepared = absl::InternalError(absl::StrCat("[SaveCheckpoint] creating ", tmp, ": ", Errno()));
          break;
        }
      }
    }
  }
  DT_RETURN_IF_ERROR(Agree(world, prepared, "preparing the directory"));
  DT_ASSIGN_OR_RETURN(const std::vector<std::string> tmp_names, AllGatherText(world, tmp_name));
  job.tmp = job.root + "/" + tmp_names[0];
  // Partial values are reduced here (collective), before any rank can fail alone.
  absl::StatusOr<std::vector<Piece>> pieces = PiecesOf(world, state, copy);
  absl::StatusOr<Json> skeleton = Skeleton(state);
  absl::Status staged = pieces.ok() ? skeleton.status() : pieces.status();
  if (absl::Status agreed = Agree(world, staged, "staging the pieces"); !agreed.ok()) {
    Abandon(job);
    return agreed;
  }
  job.pieces = *std::move(pieces);
  job.skeleton = *std::move(skeleton);
  return absl::OkStatus();
}

// Keeps `keep` complete checkpoints of `root`: the one just committed (`name`) and the newest
// of those before it (by name, as LatestCheckpoint orders them); those after it (another
// run's) are left alone. Each one removed is first renamed to a dot name, which no reader
// picks, so a crash while removing it never leaves a checkpoint that looks complete but is
// missing files; such leftovers are removed by the next prune.
absl::Status Prune(const std::string& root, const std::string& name, int64_t keep) {
  std::vector<std::string> older;
  const std::string form = NameForm(name);
  for (const std::string& n : Complete(root)) {
    if (NaturalLess(n, name) && NameForm(n) == form) older.push_back(n);
  }
  std::error_code ec;
  std::vector<std::string> doomed;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".pruned-", 0) == 0) doomed.push_back(n);
  }
  for (size_t i = 0; i + static_cast<size_t>(keep - 1) < older.size(); ++i) {
    const std::string gone = ".pruned-" + older[i];
    fs::remove_all(root + "/" + gone, ec);
    fs::rename(root + "/" + older[i], root + "/" + gone, ec);
    if (ec)
      return absl::InternalError(absl::StrCat("[SaveCheckpoint] pruning ", root, "/", older[i], ": ", ec.message()));
    doomed.push_back(gone);
  }
  if (doomed.empty()) return absl::OkStatus();
  DT_RETURN_IF_ERROR(FsyncPath(root, true));  // the renames first: then the removals are safe
  for (const std::string& n : doomed) fs::remove_all(root + "/" + n, ec);
  return absl::OkStatus();
}

// Removes what saves of this series that never committed left (<root>/.tmp-<name>.<suffix>,
// where a crash interrupted them): names up to `name` only, so a later save in flight is left
// alone, and none that a live save holds (its lock), such as an earlier name's async save of
// this run or a save of `name` by another job, which will fail to commit.
void RemoveStaleTemporaries(const std::string& root, const std::string& name) {
  const std::string form = NameForm(name);
  std::error_code ec;
  std::vector<std::string> stale;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".tmp-", 0) != 0) continue;
    const std::string of = TemporaryOf(n);
    if (NameForm(of) == form && !NaturalLess(name, of)) stale.push_back(n);
  }
  for (const std::string& n : stale) {
    DirLock lock;
    if (lock.TryLock(root + "/" + n)) fs::remove_all(root + "/" + n, ec);
  }
}

void Write(SaveJob& job) {
  job.written = WritePieces(job.world->rank(), job.tmp, job.pieces, job.options.block_bytes);
  job.pieces.clear();  // the staging memory
}

absl::Status Finish(SaveJob& job) {
  Communicator& world = *job.world;
  if (absl::Status written = Agree(world, job.written.status(), "writing the pieces"); !written.ok()) {
    Abandon(job);
    return written;
  }
  DT_ASSIGN_OR_RETURN(std::vector<std::string> texts, AllGatherText(world, job.written->dump()));
  absl::Status committed;
  if (world.rank() == 0) {
    absl::StatusOr<Json> metadata = BuildMetadata(job.skeleton, texts, job.options.block_bytes);
    committed = metadata.ok() ? CommitMetadata(job.tmp, job.final_dir, job.root, *metadata) : metadata.status();
    if (committed.ok() && job.options.keep > 0) committed = Prune(job.root, job.name, job.options.keep);
    if (committed.ok()) RemoveStaleTemporaries(job.root, job.name);
  }
  absl::Status agreed = Agree(world, committed, "committing the metadata");
  if (!agreed.ok()) Abandon(job);  // (a committed directory is no longer there)
  job.tmp_lock.Release();
  return agreed;
}

}  // namespace

absl::Status SaveCheckpoint(Communicator& world, const std::string& root, const std::string& name,
                            const CheckpointState& state, const SaveOptions& options) {
  SaveJob job{.world = &world, .root = root, .name = name, .options = options};
  DT_RETURN_IF_ERROR(Begin(job, state, /*copy=*/false));
  Write(job);
  return Finish(job);
}

absl::StatusOr<std::unique_ptr<AsyncCheckpointSave>> AsyncCheckpointSave::Start(Communicator& world,
                                                                                const std::string& root,
                                                                                const std::string& name,
                                                                                const CheckpointState& state,
                                                                                const SaveOptions& options) {
  std::unique_ptr<AsyncCheckpointSave> save(new AsyncCheckpointSave());
  save->job_ = std::make_unique<Job>();
  Job& job = *save->job_;
  job.world = &world;
  job.root = root;
  job.name = name;
  job.options = options;
  DT_RETURN_IF_ERROR(Begin(job, state, /*copy=*/true));
  save->thread_ = std::thread([&job] { Write(job); });
  return save;
}

absl::Status AsyncCheckpointSave::Finish() {
  if (finished_) return absl::FailedPreconditionError("[AsyncCheckpointSave] Finish called twice");
  finished_ = true;
  if (thread_.joinable()) thread_.join();
  return dtensor::Finish(*job_);
}

AsyncCheckpointSave::AsyncCheckpointSave() = default;

AsyncCheckpointSave::~AsyncCheckpointSave() {
  if (thread_.joinable()) thread_.join();
}

absl::Status MakeCheckpointRoot(const std::string& root) {
  if (root.empty()) return absl::InvalidArgumentError("[MakeCheckpointRoot] the root is empty");
  const fs::path dir = NormalRoot(root);
  std::vector<fs::path> missing;  // innermost first
  for (fs::path p = dir;;) {
    struct stat st;
    if (::stat(p.c_str(), &st) == 0) break;
    if (errno != ENOENT) return absl::InternalError(absl::StrCat("[MakeCheckpointRoot] ", p.string(), ": ", Errno()));
    missing.push_back(p);
    const fs::path up = p.parent_path();
    if (up.empty() || up == p) break;
    p = up;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0777) != 0 && errno != EEXIST) {  // (EEXIST: another rank or job made it)
      return absl::InternalError(absl::StrCat("[MakeCheckpointRoot] creating ", it->string(), ": ", Errno()));
    }
    const fs::path parent = it->has_parent_path() ? it->parent_path() : fs::path(".");
    DT_RETURN_IF_ERROR(FsyncPath(parent.string(), true));  // the new directory's entry
  }
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::FailedPreconditionError(absl::StrCat("[MakeCheckpointRoot] ", root, " is not a directory"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root) {
  std::vector<std::string> all = Complete(root);
  if (all.empty()) return absl::NotFoundError(absl::StrCat("[LatestCheckpoint] no complete checkpoint in ", root));
  return root + "/" + all.back();
}

namespace {

// The metadata of checkpoint `dir` (checked: a dtensor checkpoint's, with a tensors object).
absl::StatusOr<Json> ReadMetadata(const std::string& dir, const char* op) {
  const std::string path = dir + "/" + kMetadata;
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("[", op, "] no ", path, ": not a complete checkpoint"));
  }
  std::stringstream text;
  text << in.rdbuf();
  // Metadata nests 6 deep; far deeper would make parsing and printing it overflow the stack.
  constexpr int64_t kMaxNesting = 64;
  if (JsonNesting(text.str()) > kMaxNesting) {
    return absl::DataLossError(
        absl::StrCat("[", op, "] ", path, " nests deeper than ", kMaxNesting, " levels: not a checkpoint's metadata"));
  }
  Json meta = Json::parse(text.str(), nullptr, false);
  if (meta.is_discarded() || !meta.is_object() || !meta.contains("format") || meta["format"] != kFormat ||
      !meta.contains("tensors") || !meta["tensors"].is_object()) {
    return absl::DataLossError(absl::StrCat("[", op, "] ", path, " is not a dtensor checkpoint's metadata"));
  }
  return meta;
}

}  // namespace

absl::StatusOr<std::vector<CheckpointTensor>> CheckpointTensors(const std::string& dir) {
  DT_ASSIGN_OR_RETURN(const Json meta, ReadMetadata(dir, "CheckpointTensors"));
  std::vector<CheckpointTensor> out;
  for (const auto& [name, t] : meta["tensors"].items()) {
    std::optional<Shape> shape = t.is_object() && t.contains("shape") ? AsShape(t["shape"]) : std::nullopt;
    absl::StatusOr<DType> dtype = t.is_object() && t.contains("dtype") && t["dtype"].is_string()
                                      ? ParseDType(t["dtype"].get<std::string>())
                                      : absl::DataLossError("no dtype");
    if (!shape.has_value() || !dtype.ok()) {
      return absl::DataLossError(
          absl::StrCat("[CheckpointTensors] tensor ", name, " in ", dir, "/", kMetadata, ": no valid shape and dtype"));
    }
    out.push_back({.name = name, .shape = *std::move(shape), .dtype = *dtype});
  }
  return out;
}

absl::Status LoadCheckpoint(const std::string& dir, const CheckpointState& state, LoadStats* stats) {
  const std::string path = dir + "/" + kMetadata;
  DT_ASSIGN_OR_RETURN(const Json meta, ReadMetadata(dir, "LoadCheckpoint"));
  const Json& tensors = meta["tensors"];
  const int64_t block_bytes = IntMemberOr(meta, "block_bytes", 0);
  if (block_bytes < 1) return absl::DataLossError(absl::StrCat("[LoadCheckpoint] ", path, ": bad block_bytes"));
  // First every target is checked against the metadata (names, shapes, dtypes, layouts, the
  // pieces' coverage of this rank's box), so that such an error changes no target; then the
  // bytes are read.
  struct Planned {
    const StateEntry* entry = nullptr;
    Shape shape = {}, stored = {};
    LocalBox box = {};
    bool zeros = false;  // Partial(sum) off coordinate 0: this rank's part is zero
    std::vector<PieceInfo> pieces = {};
  };
  std::vector<Planned> plan;
  for (const StateEntry& e : state) {
    const std::string& name = e.name;
    const StateTensor& t = e.tensor;
    if (!tensors.contains(name)) {
      std::vector<std::string> have;
      for (const auto& [k, v] : tensors.items()) {
        if (have.size() == 8) {
          have.push_back(absl::StrCat("... (", tensors.size(), " in all)"));
          break;
        }
        have.push_back(k);
      }
      return absl::NotFoundError(absl::StrCat("[LoadCheckpoint] tensor ", name, " is not in ", dir, " (it holds ",
                                              absl::StrJoin(have, ", "), ")"));
    }
    const Json& tm = tensors[name];
    if (!tm.is_object() || !tm.contains("shape") || !tm.contains("dtype") || !tm["dtype"].is_string() ||
        !tm.contains("pieces") || !tm["pieces"].is_array()) {
      return absl::DataLossError(absl::StrCat("[LoadCheckpoint] tensor ", name, " in ", path,
                                              ": no shape, dtype and pieces in ",
                                              tm.dump(-1, ' ', false, Json::error_handler_t::replace).substr(0, 200)));
    }
    const DTensor* d = std::get_if<DTensor>(&t);
    const Tensor& local = d != nullptr ? d->ToLocal() : std::get<Tensor>(t);
    DT_ASSIGN_OR_RETURN(auto shapes, Shapes(e));
    Planned p{.entry = &e, .shape = shapes.first, .stored = shapes.second};
    absl::StatusOr<DType> stored = ParseDType(tm["dtype"].get<std::string>());
    if (!stored.ok() || AsShape(tm["shape"]) != p.stored || *stored != local.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "[LoadCheckpoint] tensor ", name, " is ", tm["shape"].dump(-1, ' ', false, Json::error_handler_t::replace),
          " ", absl::CHexEscape(tm["dtype"].get<std::string>()), " in ", dir, ", the target ", ShapeString(p.stored),
          " ", DTypeName(local.dtype())));
    }
    p.box = LocalBox{.offset = Shape(p.shape.size(), 0), .shape = p.shape};
    if (d != nullptr) {
      p.box = LocalBoxOf(p.shape, d->mesh().shape(), d->layout(), d->mesh().coordinate());
      for (int m = 0; m < d->layout().ndim(); ++m) {
        const Placement& pl = d->layout()[m];
        if (pl.is_partial() && pl.partial_op() == PartialOp::kSum && d->mesh().coordinate(m) != 0) p.zeros = true;
      }
    }
    if (local.shape() != IntSpan(p.box.shape)) {
      return absl::InvalidArgumentError(absl::StrCat("[LoadCheckpoint] tensor ", name,
                                                     ": the target's local tensor is ", ShapeString(local.shape()),
                                                     ", its layout's box ", ShapeString(p.box.shape)));
    }
    if (p.box.numel() == 0) continue;
    if (!p.zeros) {
      const int64_t elem = static_cast<int64_t>(ElementSize(local.dtype()));
      for (const Json& j : tm["pieces"]) {
        DT_ASSIGN_OR_RETURN(PieceInfo piece, ParsePiece(j, p.stored, elem, block_bytes, name, dir));
        p.pieces.push_back(std::move(piece));
      }
      // Saved pieces are disjoint; two that overlap would count their common elements twice
      // below and so hide elements no piece holds.
      const std::vector<PieceInfo>& pieces = p.pieces;
      for (size_t a = 0; a < pieces.size(); ++a) {
        for (size_t b = a + 1; b < pieces.size(); ++b) {
          if (!BoxesOverlap(pieces[a], pieces[b])) continue;
          return absl::DataLossError(absl::StrCat(
              "[LoadCheckpoint] tensor ", name, " in ", dir, ": pieces ", a, " (offset ", ShapeString(pieces[a].offset),
              ", box ", ShapeString(pieces[a].box), ") and ", b, " (offset ", ShapeString(pieces[b].offset), ", box ",
              ShapeString(pieces[b].box), ") overlap"));
        }
      }
      int64_t covered = 0;
      for (const LocalBox& sb : StoredBoxes(p.box, p.shape, p.stored)) {
        for (const PieceInfo& piece : pieces) covered += OverlapElements(piece.offset, piece.box, sb.offset, sb.shape);
      }
      if (covered != p.box.numel()) {
        return absl::DataLossError(absl::StrCat("[LoadCheckpoint] tensor ", name, ": the pieces in ", dir, " cover ",
                                                covered, " of the ", p.box.numel(), " elements this rank needs"));
      }
    }
    plan.push_back(std::move(p));
  }
  Files files(dir, stats);
  for (const Planned& p : plan) {
    const std::string& name = p.entry->name;
    const DTensor* d = std::get_if<DTensor>(&p.entry->tensor);
    const Tensor& local = d != nullptr ? d->ToLocal() : std::get<Tensor>(p.entry->tensor);
    DT_ASSIGN_OR_RETURN(Tensor buffer, Tensor::Empty(p.box.shape, local.dtype(), Device::Cpu()));
    if (p.zeros) {
      DT_RETURN_IF_ERROR(Fill_(buffer, 0.0));
    } else {
      int64_t filled = 0;
      const int64_t elem = static_cast<int64_t>(ElementSize(local.dtype()));
      char* out = static_cast<char*>(buffer.raw_data());
      for (const LocalBox& sb : StoredBoxes(p.box, p.shape, p.stored)) {  // in order, back to back
        for (const PieceInfo& piece : p.pieces) {
          DT_ASSIGN_OR_RETURN(int64_t n, CopyOverlap(files, piece, sb, elem, block_bytes, name, out));
          filled += n;
        }
        out += sb.numel() * elem;
      }
      if (filled != p.box.numel()) {  // checked above; kept against a reader's slip
        return absl::DataLossError(absl::StrCat("[LoadCheckpoint] tensor ", name, ": the pieces in ", dir, " cover ",
                                                filled, " of the ", p.box.numel(), " elements this rank needs"));
      }
    }
    DT_ASSIGN_OR_RETURN(buffer, To(buffer, local.device()));
    DT_RETURN_IF_ERROR(Copy_(local, buffer));
  }
  return absl::OkStatus();
}

}  // namespace dtensor
