#include "dtensor/nn/safetensors.h"

#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

// A fresh empty directory per test, removed with its contents at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "/safetensors_test.XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  operator std::string() const { return path_; }  // NOLINT: implicit on purpose, reads like a path

 private:
  std::string path_;
};
std::set<std::string> ListDir(const std::string& dir) {
  std::set<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.insert(n);
  }
  ::closedir(d);
  return names;
}

std::string FileBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Row-major bytes of x.
std::string TensorBytes(const Tensor& x) {
  Tensor c = Unwrap(Contiguous(x));
  return std::string(static_cast<const char*>(c.raw_data()), c.nbytes());
}

std::string Le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

template <typename T>
std::string Raw(T v) {
  std::string s(sizeof(T), '\0');
  std::memcpy(s.data(), &v, sizeof(T));
  return s;
}

// A file made of `header` (JSON text) and `data`.
std::string FileWith(const std::string& header, const std::string& data) { return Le64(header.size()) + header + data; }

TEST(SafetensorsTest, RoundTripsAllDTypesAndMetadata) {
  const TempDir tmp_dir;
  const std::string dir = tmp_dir;
  const std::string path = dir + "/all.safetensors";
  std::vector<std::pair<std::string, Tensor>> in = {
      {"f32", testing::Random({3, 5}, DType::kFloat32, 1)},
      {"bf16", testing::Random({4}, DType::kBFloat16, 2)},
      {"f16", testing::Random({2, 2, 3}, DType::kFloat16, 3)},
      {"i32", testing::FromDoubles({-7, 0, 2147483647.0 - 127, 5}, {2, 2}, DType::kInt32)},
      {"i64", Unwrap(Tensor::FromVector<int64_t>({int64_t{1} << 40, -3, 0}, {3}))},
      {"bool", testing::FromDoubles({1, 0, 0, 1, 1}, {5}, DType::kBool)},
      {"f8e4m3", testing::FromDoubles({0.5, -1.25, 3, 448, -0.0078125, 0}, {6}, DType::kFloat8E4M3)},
      {"f8e5m2", testing::FromDoubles({1, -2, 0.25, 57344, -3, 0.5}, {2, 3}, DType::kFloat8E5M2)},
      {"scalar", Unwrap(Tensor::FromVector<float>({3.25f}, {}))},
      {"empty", Unwrap(Tensor::Empty({0, 4}, DType::kFloat32))},
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "12"}, {"quote\"", "a\nb"}};
  ASSERT_TRUE(WriteSafetensors(path, in, meta).ok());
  NamedTensors out = Unwrap(ReadSafetensors(path));
  ASSERT_EQ(out.tensors.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    SCOPED_TRACE(in[i].first);
    EXPECT_EQ(out.tensors[i].first, in[i].first);  // order kept
    const Tensor& t = out.tensors[i].second;
    EXPECT_EQ(t.dtype(), in[i].second.dtype());
    EXPECT_EQ(Shape(t.shape().begin(), t.shape().end()),
              Shape(in[i].second.shape().begin(), in[i].second.shape().end()));
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(t.device(), Device::Cpu());
    EXPECT_EQ(TensorBytes(t), TensorBytes(in[i].second));  // bit-exact
  }
  EXPECT_EQ(out.metadata, meta);
  ASSERT_NE(out.Find("i64"), nullptr);
  EXPECT_EQ(out.Find("nope"), nullptr);
  // The data section starts 8-byte aligned (header padded).
  const std::string bytes = FileBytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(SafetensorsTest, WritesNonContiguousViewsAsRowMajor) {
  const TempDir tmp_dir;
  const std::string dir = tmp_dir;
  const std::string path = dir + "/views.safetensors";
  Tensor base = Unwrap(Tensor::FromVector<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4}));
  Tensor t = Unwrap(base.Transpose(0, 1));                      // [4, 3]
  Tensor s = Unwrap(base.Slice(1, 1, 4, 2));                    // [3, 2]: columns 1, 3
  Tensor e = Unwrap(Unwrap(base.Select(0, 2)).Expand({2, 4}));  // stride 0
  Tensor nc = testing::NonContiguous(testing::Random({2, 3, 4}, DType::kBFloat16, 9));
  ASSERT_FALSE(t.is_contiguous());
  ASSERT_FALSE(nc.is_contiguous());
  std::vector<std::pair<std::string, Tensor>> in = {{"t", t}, {"s", s}, {"e", e}, {"nc", nc}};
  ASSERT_TRUE(WriteSafetensors(path, in).ok());
  NamedTensors out = Unwrap(ReadSafetensors(path));
  ASSERT_EQ(out.tensors.size(), 4u);
  EXPECT_EQ(testing::Values(out.tensors[0].second), (std::vector<double>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  EXPECT_EQ(testing::Values(out.tensors[1].second), (std::vector<double>{1, 3, 5, 7, 9, 11}));
  EXPECT_EQ(testing::Values(out.tensors[2].second), (std::vector<double>{8, 9, 10, 11, 8, 9, 10, 11}));
  EXPECT_EQ(testing::Values(out.tensors[3].second), testing::Values(nc));
  EXPECT_TRUE(out.metadata.empty());
}

TEST(SafetensorsTest, ReadsAHandWrittenFile) {
  const TempDir tmp_dir;
  const std::string dir = tmp_dir;
  const std::string path = dir + "/hand.safetensors";
  // Header order differs from data order on purpose; trailing spaces are allowed padding.
  const std::string header =
      R"({"__metadata__":{"k":"v"},"b":{"dtype":"I64","shape":[],"data_offsets":[8,16]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"c":{"dtype":"BF16","shape":[1,1],)"
      R"("data_offsets":[16,18]}}   )";
  std::string data = Raw(1.5f) + Raw(-2.0f) + Raw(int64_t{-3}) + Raw(uint16_t{0x3fc0});  // bf16 1.5
  WriteBytes(path, FileWith(header, data));
  NamedTensors out = Unwrap(ReadSafetensors(path));
  ASSERT_EQ(out.tensors.size(), 3u);
  EXPECT_EQ(out.tensors[0].first, "b");
  EXPECT_EQ(out.tensors[1].first, "a");
  EXPECT_EQ(out.tensors[2].first, "c");
  EXPECT_EQ(out.tensors[0].second.dtype(), DType::kInt64);
  EXPECT_EQ(out.tensors[0].second.dim(), 0);
  EXPECT_EQ(testing::Values(out.tensors[0].second), (std::vector<double>{-3}));
  EXPECT_EQ(out.tensors[1].second.dtype(), DType::kFloat32);
  EXPECT_EQ(testing::Values(out.tensors[1].second), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(out.tensors[2].second.dtype(), DType::kBFloat16);
  EXPECT_EQ(testing::Values(out.tensors[2].second), (std::vector<double>{1.5}));
  EXPECT_EQ(out.metadata, (std::map<std::string, std::string>{{"k", "v"}}));

  // And the writer produces exactly the bytes a hand-made file of the same content has.
  const std::string path2 = dir + "/written.safetensors";
  std::vector<std::pair<std::string, Tensor>> in = {{"a", out.tensors[1].second}, {"b", out.tensors[0].second}};
  ASSERT_TRUE(WriteSafetensors(path2, in, {{"k", "v"}}).ok());
  std::string h2 = R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("b":{"dtype":"I64","shape":[],"data_offsets":[8,16]}})";
  h2.append((8 - h2.size() % 8) % 8, ' ');
  EXPECT_EQ(FileBytes(path2), FileWith(h2, Raw(1.5f) + Raw(-2.0f) + Raw(int64_t{-3})));
}

// Reads `bytes` as a file and expects an InvalidArgument whose message contains every `parts`.
void ExpectInvalid(const std::string& dir, const std::string& bytes, const std::vector<std::string>& parts) {
  const std::string path = dir + "/bad.safetensors";
  WriteBytes(path, bytes);
  auto r = ReadSafetensors(path);
  ASSERT_FALSE(r.ok()) << "expected an error for parts[0]=" << parts[0];
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  const std::string msg(r.status().message());
  EXPECT_NE(msg.find("[ReadSafetensors]"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

TEST(SafetensorsTest, CorruptedFilesGiveClearErrors) {
  const TempDir tmp_dir;
  const std::string dir = tmp_dir;
  const std::string ok_header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string ok_data = Raw(1.0f) + Raw(2.0f);
  {  // Sanity: the unmodified file reads.
    WriteBytes(dir + "/good.safetensors", FileWith(ok_header, ok_data));
    ASSERT_TRUE(ReadSafetensors(dir + "/good.safetensors").ok());
  }
  ExpectInvalid(dir, "", {"too short"});
  ExpectInvalid(dir, std::string("\x05\x00\x00", 3), {"too short"});
  ExpectInvalid(dir, Le64(1000) + ok_header + ok_data, {"header length 1000"});
  ExpectInvalid(dir, Le64(0) + ok_data, {"header length 0"});
  ExpectInvalid(dir, Le64(uint64_t{1} << 63) + ok_header, {"header length"});
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F32",)", ok_data), {"not valid JSON"});
  ExpectInvalid(dir, FileWith("[1, 2]", ""), {"not a JSON object"});
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", ok_data),
                {"'w'", "unknown dtype", "Q7"});
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", ok_data),
                {"'w'", "F64", "no such DType"});
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F32","shape":[2]}})", ok_data), {"'w'", "data_offsets"});
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", ok_data),
                {"'w'", "non-negative"});
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", ok_data),
                {"'w'", "data_offsets"});
  // Offsets not matching shape * element size.
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", ok_data),
                {"'w'", "span 8 bytes", "needs 12"});
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", ok_data),
                {"'w'", "end < begin"});
  // Out of range (file truncated).
  ExpectInvalid(dir, FileWith(ok_header, Raw(1.0f)), {"'w'", "past the end"});
  // Overlap and gap and trailing bytes.
  ExpectInvalid(dir,
                FileWith(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                         ok_data),
                {"'a'", "'b'", "overlap"});
  ExpectInvalid(dir,
                FileWith(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                         ok_data + Raw(3.0f)),
                {"bytes [4, 8)", "'b'"});
  ExpectInvalid(dir, FileWith(ok_header, ok_data + "xx"), {"10 bytes", "cover only 8"});
  ExpectInvalid(dir,
                FileWith(R"({"__metadata__":{"k":1},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", ok_data),
                {"__metadata__", "'k'"});
  ExpectInvalid(dir, FileWith(R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", std::string("\x01\x07", 2)),
                {"'m'", "BOOL"});
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,2],"data_offsets":[0,8]}})", ok_data),
                {"'w'", "dims"});
  // A shape nested 100000 deep: an error, not a stack overflow while reading or printing it;
  // one nested 10 deep is printed by size only.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,8]}})", ok_data),
                {"nests deeper than 64 levels"});
  const std::string ten = std::string(10, '[') + std::string(10, ']');
  ExpectInvalid(dir, FileWith(R"({"w":{"dtype":"F32","shape":)" + ten + R"(,"data_offsets":[0,8]}})", ok_data),
                {"'w'", "array of 1 entries"});
}

// Names and metadata must be UTF-8 (JSON text): InvalidArgument, not an exception.
TEST(SafetensorsTest, NonUtf8NamesAndMetadataAreInvalidArgument) {
  const TempDir tmp_dir;
  const std::string dir = tmp_dir;
  const Tensor t = Unwrap(Zeros({2}, DType::kFloat32));
  absl::Status s = WriteSafetensors(dir + "/a.safetensors", {{"caf\xe9", t}});
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "UTF-8")) << s;
  s = WriteSafetensors(dir + "/b.safetensors", {{"w", t}}, {{"note", "caf\xe9"}});
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_FALSE(std::filesystem::exists(dir + "/b.safetensors"));
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  const TempDir tmp_dir;
  const std::string dir = tmp_dir;
  auto r = ReadSafetensors(dir + "/absent.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("absent.safetensors"), absl::string_view::npos);
}

TEST(SafetensorsTest, WriteIsAtomicAndLeavesNoTemporaryFile) {
  const TempDir tmp_dir;
  const std::string dir = tmp_dir;
  const std::string path = dir + "/ckpt.safetensors";
  Tensor a = testing::Random({100}, DType::kFloat32, 1);
  ASSERT_TRUE(WriteSafetensors(path, {{"a", a}}).ok());
  EXPECT_EQ(ListDir(dir), (std::set<std::string>{"ckpt.safetensors"}));
  // Overwrite an existing file: replaced in full, still no leftovers.
  Tensor b = testing::Random({7}, DType::kFloat16, 2);
  ASSERT_TRUE(WriteSafetensors(path, {{"b", b}}, {{"x", "y"}}).ok());
  EXPECT_EQ(ListDir(dir), (std::set<std::string>{"ckpt.safetensors"}));
  NamedTensors out = Unwrap(ReadSafetensors(path));
  ASSERT_EQ(out.tensors.size(), 1u);
  EXPECT_EQ(out.tensors[0].first, "b");
  EXPECT_EQ(TensorBytes(out.tensors[0].second), TensorBytes(b));
  // The file has the permissions of a plain file (not mkstemp's 0600).
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  mode_t mask = ::umask(0);
  ::umask(mask);
  EXPECT_EQ(st.st_mode & 0777, 0666 & ~mask);
  // A failing write (bad arguments) leaves the old file untouched and no temporary file.
  const std::string before = FileBytes(path);
  EXPECT_FALSE(WriteSafetensors(path, {{"a", a}, {"a", b}}).ok());
  EXPECT_FALSE(WriteSafetensors(path, {{"", a}}).ok());
  EXPECT_FALSE(WriteSafetensors(path, {{"__metadata__", a}}).ok());
  EXPECT_FALSE(WriteSafetensors(path, {{"u", Tensor()}}).ok());
  EXPECT_EQ(FileBytes(path), before);
  EXPECT_EQ(ListDir(dir), (std::set<std::string>{"ckpt.safetensors"}));
  // A directory that does not exist: an error naming the path.
  auto st2 = WriteSafetensors(dir + "/no/such/dir/x.safetensors", {{"a", a}});
  EXPECT_FALSE(st2.ok());
  EXPECT_NE(st2.message().find("[WriteSafetensors]"), absl::string_view::npos) << st2;
}

}  // namespace
}  // namespace dtensor
