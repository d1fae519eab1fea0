// Tests of src/io/safetensors: bitwise agreement with files the Python safetensors and
// transformers writers produce, our writer read back by us and by Python, and one test per
// malformed input checking the error names the file and the tensor at fault.
#include "io/safetensors.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "common/error.h"
#include "common/file.h"
#include "test_util.h"

namespace dflash::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

fs::path fixtures() { return fs::path(DFLASH_FIXTURES) / "safetensors"; }

const json& manifest() {
  static const json m = json::parse(read_file(fixtures() / "manifest.json"));
  return m;
}

std::string hex_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous().cpu();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  std::string out;
  for (size_t i = 0; i < c.nbytes(); ++i) out += fmt::format("{:02x}", p[i]);
  return out;
}

at::ScalarType scalar_type(const std::string& name) {
  auto dtype = dtype_from_name(name);
  EXPECT_TRUE(dtype.has_value()) << name;
  return to_scalar_type(dtype.value_or(Dtype::kU8));
}

// Compares a tensor with its manifest entry: dtype, shape and every byte.
void expect_matches(const at::Tensor& t, const json& expected, const std::string& name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(t.scalar_type(), scalar_type(expected["dtype"].get<std::string>()));
  EXPECT_EQ(t.sizes().vec(), expected["shape"].get<std::vector<int64_t>>());
  EXPECT_EQ(hex_of(t), expected["hex"].get<std::string>());
}

// The error message of `f`, which must throw dflash::Error.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-dflash exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

// A fresh directory per test, removed afterwards. Lower case so that `ctest -R safetensors`
// selects these tests.
class safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = testing::fresh_temp_dir(std::string("safetensors_") + info->name());
  }
  void TearDown() override { remove_tree(dir_); }

  // A file with the given header text (length prefix added, no padding) and data bytes.
  fs::path raw(const std::string& name, const std::string& header, const std::string& data = "") {
    std::string bytes(8, '\0');
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return bytes_file(name, bytes + header + data);
  }
  fs::path bytes_file(const std::string& name, const std::string& bytes) {
    fs::path p = dir_ / name;
    write_file_atomic(p, bytes);
    return p;
  }
  // Asserts opening `path` fails with a message naming the file and each of `parts`.
  void expect_open_error(const fs::path& path, std::initializer_list<std::string> parts) {
    std::string message = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_THAT(message, HasSubstr(path.string()));
    for (const auto& part : parts) EXPECT_THAT(message, HasSubstr(part));
  }

  fs::path index_path() const { return dir_ / "model.safetensors.index.json"; }
  std::string checkpoint_error() const {
    return error_of([&] { Checkpoint::open(dir_); });
  }

  fs::path dir_;
};

// Random bit patterns of every supported dtype (booleans stay 0/1, as the format requires).
std::vector<std::pair<std::string, at::Tensor>> all_dtype_tensors() {
  at::manual_seed(7);
  std::vector<std::pair<std::string, at::Tensor>> out;
  const at::ScalarType types[] = {at::kBool,  at::kByte,   at::kChar,          at::kShort,
                                  at::kInt,   at::kLong,   at::kHalf,          at::kBFloat16,
                                  at::kFloat, at::kDouble, at::kFloat8_e4m3fn, at::kFloat8_e5m2};
  for (auto type : types) {
    at::Tensor t;
    if (type == at::kBool) {
      t = at::randint(0, 2, {3, 4}, at::kByte).to(at::kBool);
    } else {
      t = at::randint(0, 256, {3, 4 * static_cast<int64_t>(c10::elementSize(type))}, at::kByte)
              .view(type);
    }
    out.emplace_back(fmt::format("t.{}", c10::toString(type)), t);
  }
  out.emplace_back("scalar", at::tensor(3.25, at::kDouble).reshape({}));
  out.emplace_back("empty", at::empty({0, 5}, at::kHalf));
  out.emplace_back("transposed", at::arange(24, at::kFloat).reshape({4, 6}).t());
  out.emplace_back("strided", at::arange(40, at::kInt).reshape({4, 10}).narrow(1, 3, 4));
  out.emplace_back("expanded", at::arange(3, at::kLong).reshape({3, 1}).expand({3, 4}));
  return out;
}

// ---- files written by Python ----

TEST_F(safetensors, ReadsEveryDtypeWrittenByPython) {
  const json& m = manifest()["single"];
  auto file = SafetensorsFile::open(fixtures() / m["file"].get<std::string>());
  EXPECT_EQ(file->tensors().size(), m["tensors"].size());
  for (const auto& [name, expected] : m["tensors"].items()) {
    ASSERT_NE(file->find(name), nullptr) << name;
    expect_matches(file->tensor(name), expected, name);
  }
  using StringMap = std::map<std::string, std::string>;
  EXPECT_EQ(file->metadata(), m["metadata"].get<StringMap>());
  EXPECT_EQ(file->find("absent"), nullptr);
  // tensors() is in file order: offsets ascend and ranges do not overlap.
  for (size_t i = 1; i < file->tensors().size(); ++i) {
    const auto& a = file->tensors()[i - 1];
    EXPECT_LE(a.offset + a.nbytes, file->tensors()[i].offset);
  }
}

TEST_F(safetensors, ReadsShardedCheckpointWrittenByTransformers) {
  const json& m = manifest()["sharded"];
  Checkpoint ck = Checkpoint::open(fixtures() / "sharded");
  EXPECT_EQ(ck.files().size(), m["shards"].size());
  std::vector<std::string> expected_names;
  uint64_t total = 0;
  for (const auto& [name, expected] : m["tensors"].items()) {
    expected_names.push_back(name);
    ASSERT_TRUE(ck.contains(name)) << name;
    expect_matches(ck.tensor(name), expected, name);
    EXPECT_EQ(ck.info(name).name, name);
    total += ck.info(name).nbytes;
  }
  std::sort(expected_names.begin(), expected_names.end());
  EXPECT_EQ(ck.names(), expected_names);
  EXPECT_EQ(ck.total_bytes(), total);
  EXPECT_FALSE(ck.contains("model.nope"));
}

TEST_F(safetensors, LoadReadsSameBytesAsTheMapping) {
  const json& m = manifest()["sharded"];
  Checkpoint ck = Checkpoint::open(fixtures() / "sharded");
  // A tiny staging buffer forces tensors to be split over many chunks.
  auto loaded = ck.load(ck.names(), at::kCPU, at::kBFloat16, 256);
  ASSERT_EQ(loaded.size(), ck.names().size());
  for (const auto& [name, expected] : m["tensors"].items()) {
    expect_matches(loaded.at(name), expected, name);
  }
}

TEST_F(safetensors, LoadConvertsDtypeChunkByChunk) {
  auto file_path = fixtures() / manifest()["single"]["file"].get<std::string>();
  Checkpoint ck = Checkpoint::open(file_path);
  std::vector<std::string> names = {"f64.matrix",     "bf16.4d",    "f32.special", "i32.matrix",
                                    "f16.matrix",     "f32.scalar", "f16.empty",   "bool.matrix",
                                    "f8_e4m3.matrix", "bf16.4d"};  // a duplicate is loaded once
  for (size_t staging : {size_t{64}, size_t{1} << 20}) {
    auto loaded = ck.load(names, at::kCPU, at::kFloat, staging);
    EXPECT_EQ(loaded.size(), names.size() - 1);
    for (const auto& name : names) {
      SCOPED_TRACE(name + " staging " + std::to_string(staging));
      at::Tensor expected = ck.tensor(name).to(at::kFloat);
      const at::Tensor& got = loaded.at(name);
      EXPECT_EQ(got.scalar_type(), at::kFloat);
      EXPECT_EQ(got.sizes(), expected.sizes());
      EXPECT_TRUE(at::allclose(got, expected, 0, 0, /*equal_nan=*/true));
    }
  }
}

TEST_F(safetensors, LoadToCudaMatchesCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  Checkpoint ck = Checkpoint::open(fixtures() / "sharded");
  auto cpu = ck.load(ck.names(), at::kCPU, at::kFloat);
  for (size_t staging : {size_t{256}, size_t{4096}, size_t{256} << 20}) {
    for (auto dtype : {at::kBFloat16, at::kFloat}) {
      auto gpu = ck.load(ck.names(), at::Device(at::kCUDA, 0), dtype, staging);
      for (const auto& name : ck.names()) {
        SCOPED_TRACE(name);
        EXPECT_TRUE(gpu.at(name).is_cuda());
        EXPECT_EQ(gpu.at(name).scalar_type(), dtype);
        EXPECT_TRUE(at::equal(gpu.at(name).cpu().to(at::kFloat), cpu.at(name)));
      }
    }
  }
}

TEST_F(safetensors, ZeroCopyViewOutlivesFileAndCheckpoint) {
  at::Tensor view;
  const void* first = nullptr;
  {
    Checkpoint ck = Checkpoint::open(fixtures() / "sharded");
    view = ck.tensor("model.embed_tokens.weight");
    first = view.data_ptr();
    EXPECT_EQ(ck.tensor("model.embed_tokens.weight").data_ptr(), first);  // no copy
  }
  // The checkpoint is gone; the deleter's reference keeps the mapping readable.
  expect_matches(view, manifest()["sharded"]["tensors"]["model.embed_tokens.weight"],
                 "model.embed_tokens.weight");
}

TEST_F(safetensors, HeaderParserWorksOnAPrefix) {
  std::string bytes = read_file(fixtures() / "single.safetensors");
  uint64_t n = parse_header_length(bytes, bytes.size(), "single");
  ParsedHeader h = parse_safetensors_header(bytes.substr(0, 8 + n), bytes.size(), "single");
  EXPECT_EQ(h.data_start, 8 + n);
  EXPECT_EQ(h.tensors.size(), manifest()["single"]["tensors"].size());
  EXPECT_THAT(error_of([&] {
                parse_safetensors_header(bytes.substr(0, 8 + n - 1), bytes.size(), "single");
              }),
              HasSubstr("need the"));
}

TEST_F(safetensors, UnalignedTensorIsReturnedAsAlignedCopy) {
  float values[2] = {1.5f, -2.25f};
  std::string data = "abc" + std::string(reinterpret_cast<const char*>(values), sizeof(values));
  auto p = raw("unaligned.safetensors",
               R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
               R"("f":{"dtype":"F32","shape":[2],"data_offsets":[3,11]}})",
               data);
  auto file = SafetensorsFile::open(p);
  at::Tensor f = file->tensor("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data_ptr()) % 4, 0u);
  EXPECT_EQ(f[0].item<float>(), 1.5f);
  EXPECT_EQ(f[1].item<float>(), -2.25f);
  EXPECT_EQ(hex_of(file->tensor("a")), "616263");
}

TEST_F(safetensors, GapsBetweenTensorsAreAllowed) {
  auto p = raw("gap.safetensors",
               R"({"a":{"dtype":"I8","shape":[2],"data_offsets":[0,2]},)"
               R"("b":{"dtype":"I8","shape":[2],"data_offsets":[4,6]}})",
               std::string("\x01\x02\xff\xff\x03\x04", 6));
  auto file = SafetensorsFile::open(p);
  EXPECT_EQ(hex_of(file->tensor("b")), "0304");
}

// ---- our writer ----

TEST_F(safetensors, WriterRoundTripIsBitwise) {
  auto tensors = all_dtype_tensors();
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "12"}};
  fs::path p = dir_ / "round.safetensors";
  write_safetensors(p, tensors, meta);
  auto file = SafetensorsFile::open(p);
  EXPECT_EQ(file->metadata(), meta);
  EXPECT_EQ(file->data_start() % 8, 0u);  // header padded as the format requires
  ASSERT_EQ(file->tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    SCOPED_TRACE(name);
    EXPECT_EQ(file->tensors()[i].name, name);  // data written in the given order
    at::Tensor back = file->tensor(name);
    EXPECT_EQ(back.scalar_type(), t.scalar_type());
    EXPECT_EQ(back.sizes(), t.sizes());
    EXPECT_EQ(hex_of(back), hex_of(t));
  }
  // No temporary file is left beside the result.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1);
}

TEST_F(safetensors, WriterStreamsLargeNonContiguousTensors) {
  // Bigger than the 64 MiB write chunk: one is split by rows, one has rows over the chunk size.
  at::Tensor many_rows = at::arange(4100 * 4100, at::kFloat).reshape({4100, 4100}).t();
  at::Tensor long_rows = at::arange(2 * 17000000, at::kInt).reshape({17000000, 2}).t();
  fs::path p = dir_ / "large.safetensors";
  write_safetensors(p, {{"many_rows", many_rows}, {"long_rows", long_rows}});
  auto file = SafetensorsFile::open(p);
  EXPECT_TRUE(at::equal(file->tensor("many_rows"), many_rows));
  EXPECT_TRUE(at::equal(file->tensor("long_rows"), long_rows));
}

TEST_F(safetensors, WriteCheckpointShardsAndCleansUp) {
  auto tensors = all_dtype_tensors();
  tensors.emplace_back("big", at::arange(64, at::kDouble));  // 512 bytes: over the limit alone
  fs::path ck_dir = dir_ / "ck";
  write_checkpoint(ck_dir, tensors, 100, {{"producer", "test"}});
  ASSERT_TRUE(fs::exists(ck_dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(ck_dir / "model.safetensors"));
  json index = json::parse(read_file(ck_dir / "model.safetensors.index.json"));
  Checkpoint ck = Checkpoint::open(ck_dir);
  EXPECT_GT(ck.files().size(), 2u);
  uint64_t total = 0;
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(ck.contains(name));
    EXPECT_EQ(hex_of(ck.tensor(name)), hex_of(t));
    total += t.nbytes();
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_EQ(ck.total_bytes(), total);
  const size_t n = ck.files().size();
  for (size_t i = 0; i < n; ++i) {
    auto name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
    EXPECT_TRUE(fs::exists(ck_dir / name)) << name;
    EXPECT_EQ(ck.files()[i]->metadata().at("format"), "pt");  // transformers requires it
    EXPECT_EQ(ck.files()[i]->metadata().at("producer"), "test");
  }
  for (const auto& f : ck.files()) {
    // Each shard respects the limit unless one tensor alone exceeds it.
    if (f->tensors().size() > 1) {
      uint64_t bytes = 0;
      for (const auto& t : f->tensors()) bytes += t.nbytes;
      EXPECT_LE(bytes, 100u) << f->path();
    }
  }

  // Saving again as one file removes the index and the shards, so nothing stale is read.
  write_checkpoint(ck_dir, {{"only", at::ones({2})}});
  EXPECT_FALSE(fs::exists(ck_dir / "model.safetensors.index.json"));
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(ck_dir)) ++files;
  EXPECT_EQ(files, 1);
  EXPECT_EQ(Checkpoint::open(ck_dir).names(), std::vector<std::string>{"only"});

  // And sharding again removes the single file.
  write_checkpoint(ck_dir, tensors, 100);
  EXPECT_FALSE(fs::exists(ck_dir / "model.safetensors"));
  EXPECT_EQ(Checkpoint::open(ck_dir).names().size(), tensors.size());
}

std::string python_dtype(at::ScalarType type) {
  static const std::map<at::ScalarType, std::string> names = {{at::kBool, "bool"},
                                                              {at::kByte, "uint8"},
                                                              {at::kChar, "int8"},
                                                              {at::kShort, "int16"},
                                                              {at::kInt, "int32"},
                                                              {at::kLong, "int64"},
                                                              {at::kHalf, "float16"},
                                                              {at::kBFloat16, "bfloat16"},
                                                              {at::kFloat, "float32"},
                                                              {at::kDouble, "float64"},
                                                              {at::kFloat8_e4m3fn, "float8_e4m3fn"},
                                                              {at::kFloat8_e5m2, "float8_e5m2"}};
  return "torch." + names.at(type);
}

// Our files read by the reference implementation: the test runs Python on them.
TEST_F(safetensors, PythonReadsOurFiles) {
  const char* python = std::getenv("DFLASH_PYTHON");
  if (!python || !*python) GTEST_SKIP() << "DFLASH_PYTHON is not set";
  auto tensors = all_dtype_tensors();
  write_safetensors(dir_ / "single.safetensors", tensors, {{"k", "v"}});
  write_checkpoint(dir_ / "sharded", tensors, 64);
  fs::path script = dir_ / "read.py";
  write_file_atomic(script, R"(
import json, sys, pathlib, torch
from safetensors import safe_open

def describe(path):
    out = {}
    with safe_open(str(path), framework="pt") as f:
        out["__metadata__"] = f.metadata()
        for k in f.keys():
            t = f.get_tensor(k)
            out[k] = {"dtype": str(t.dtype), "shape": list(t.shape),
                      "hex": t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()}
    return out

d = pathlib.Path(sys.argv[1])
result = {"single": describe(d / "single.safetensors"), "sharded": {}}
index = json.loads((d / "sharded" / "model.safetensors.index.json").read_text())
for shard in sorted(set(index["weight_map"].values())):
    for k, v in describe(d / "sharded" / shard).items():
        if k != "__metadata__":
            assert index["weight_map"][k] == shard
            result["sharded"][k] = v
print(json.dumps(result))
)");
  std::string cmd = fmt::format("'{}' '{}' '{}' 2>&1", python, script.string(), dir_.string());
  FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  ASSERT_EQ(::pclose(pipe), 0) << output;
  json result = json::parse(output.substr(output.find('{')));
  EXPECT_EQ(result["single"]["__metadata__"]["k"], "v");
  for (const char* part : {"single", "sharded"}) {
    SCOPED_TRACE(part);
    for (const auto& [name, t] : tensors) {
      SCOPED_TRACE(name);
      const json& got = result[part][name];
      ASSERT_TRUE(got.is_object());
      EXPECT_EQ(got["dtype"].get<std::string>(), python_dtype(t.scalar_type()));
      EXPECT_EQ(got["shape"].get<std::vector<int64_t>>(), t.sizes().vec());
      EXPECT_EQ(got["hex"].get<std::string>(), hex_of(t));
    }
  }
}

// ---- malformed files: each error names the file and, where there is one, the tensor ----

TEST_F(safetensors, RejectsEmptyFile) {
  expect_open_error(bytes_file("empty.safetensors", ""), {"too short"});
}

TEST_F(safetensors, RejectsMissingFile) {
  expect_open_error(dir_ / "nope.safetensors", {"cannot open"});
}

TEST_F(safetensors, RejectsDirectory) { expect_open_error(dir_, {"not a regular file"}); }

TEST_F(safetensors, RejectsHeaderLengthPastEndOfFile) {
  std::string bytes(8, '\0');
  bytes[0] = 100;
  expect_open_error(bytes_file("short.safetensors", bytes + "{}"),
                    {"header length 100", "past the end"});
}

TEST_F(safetensors, RejectsHugeHeaderLength) {
  // A pickle (.bin) renamed to .safetensors starts like this.
  expect_open_error(
      bytes_file("pickle.safetensors", std::string("\x80\x02\x63torch\x0a", 8) + "xxxxxxxx"),
      {"exceeds the limit"});
}

TEST_F(safetensors, RejectsHeaderThatIsNotAnObject) {
  expect_open_error(raw("array.safetensors", "[1, 2]"), {"does not start with '{'"});
}

TEST_F(safetensors, RejectsMalformedJson) {
  expect_open_error(raw("bad.safetensors", R"({"w": {"dtype": "F32", "shape": [1],)"),
                    {"not valid JSON"});
}

TEST_F(safetensors, RejectsInvalidUtf8Name) {
  expect_open_error(raw("utf8.safetensors",
                        "{\"w\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "x"),
                    {"not valid JSON"});
}

TEST_F(safetensors, RejectsDuplicateTensorName) {
  expect_open_error(raw("dup.safetensors",
                        R"({"layers.0.w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                        R"("layers.0.w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                        "ab"),
                    {"\"layers.0.w\"", "twice"});
}

TEST_F(safetensors, RejectsEntryThatIsNotAnObject) {
  expect_open_error(raw("entry.safetensors", R"({"w": 3})"), {"\"w\"", "expected an object"});
}

TEST_F(safetensors, RejectsMissingDtype) {
  expect_open_error(raw("nodtype.safetensors", R"({"w":{"shape":[1],"data_offsets":[0,1]}})", "x"),
                    {"\"w\"", "missing \"dtype\""});
}

TEST_F(safetensors, RejectsMissingShape) {
  expect_open_error(raw("noshape.safetensors", R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", "x"),
                    {"\"w\"", "missing \"shape\""});
}

TEST_F(safetensors, RejectsMissingDataOffsets) {
  expect_open_error(raw("nooffsets.safetensors", R"({"w":{"dtype":"U8","shape":[1]}})", "x"),
                    {"\"w\"", "missing \"data_offsets\""});
}

TEST_F(safetensors, RejectsDtypeThatIsNotAString) {
  expect_open_error(
      raw("dtypeint.safetensors", R"({"w":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", "xxxx"),
      {"\"w\"", "dtype must be a string"});
}

TEST_F(safetensors, RejectsUnsupportedDtype) {
  expect_open_error(
      raw("u16.safetensors", R"({"w":{"dtype":"U16","shape":[1],"data_offsets":[0,2]}})", "xx"),
      {"\"w\"", "unsupported dtype \"U16\"", "supported: BOOL"});
  expect_open_error(
      raw("e8m0.safetensors", R"({"s":{"dtype":"F8_E8M0","shape":[1],"data_offsets":[0,1]}})", "x"),
      {"\"s\"", "F8_E8M0"});
}

TEST_F(safetensors, RejectsShapeThatIsNotAnArray) {
  expect_open_error(
      raw("shape.safetensors", R"({"w":{"dtype":"U8","shape":4,"data_offsets":[0,4]}})", "xxxx"),
      {"\"w\"", "shape must be an array"});
}

TEST_F(safetensors, RejectsNegativeDimension) {
  expect_open_error(
      raw("neg.safetensors", R"({"w":{"dtype":"U8","shape":[2,-1],"data_offsets":[0,2]}})", "xx"),
      {"\"w\"", "shape[1] must be a non-negative integer, got -1"});
}

TEST_F(safetensors, RejectsFractionalDimension) {
  expect_open_error(
      raw("frac.safetensors", R"({"w":{"dtype":"U8","shape":[1.5],"data_offsets":[0,2]}})", "xx"),
      {"\"w\"", "shape[0] must be a non-negative integer"});
}

TEST_F(safetensors, RejectsShapeWhoseSizeOverflows) {
  expect_open_error(
      raw("overflow.safetensors", R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4],)"
                                  R"("data_offsets":[0,0]}})"),
      {"\"w\"", "too many elements"});
}

TEST_F(safetensors, RejectsDataOffsetsOfWrongLength) {
  expect_open_error(
      raw("arity.safetensors", R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "x"),
      {"\"w\"", "data_offsets must be an array [begin, end]"});
}

TEST_F(safetensors, RejectsNegativeDataOffsets) {
  expect_open_error(
      raw("negoff.safetensors", R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", "x"),
      {"\"w\"", "two non-negative integers"});
}

TEST_F(safetensors, RejectsReversedDataOffsets) {
  expect_open_error(
      raw("rev.safetensors", R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[2,1]}})", "xxx"),
      {"\"w\"", "end before they begin"});
}

TEST_F(safetensors, RejectsSizeThatDoesNotMatchShape) {
  expect_open_error(
      raw("size.safetensors",
          R"({"q_proj.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "xxxx"),
      {"\"q_proj.weight\"", "needs 8 bytes", "span 4"});
}

TEST_F(safetensors, RejectsTruncatedFile) {
  // A valid file cut short: the last tensor now runs past the end.
  fs::path good = dir_ / "good.safetensors";
  write_safetensors(good, {{"a", at::ones({4})}, {"last.weight", at::ones({8})}});
  std::string bytes = read_file(good);
  expect_open_error(bytes_file("cut.safetensors", bytes.substr(0, bytes.size() - 3)),
                    {"\"last.weight\"", "extend past the end", "truncated"});
}

TEST_F(safetensors, RejectsOverlappingTensors) {
  expect_open_error(raw("overlap.safetensors",
                        R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                        std::string(12, 'x')),
                    {"\"a\"", "\"b\"", "overlap"});
}

TEST_F(safetensors, RejectsMetadataThatIsNotStrings) {
  expect_open_error(raw("meta.safetensors", R"({"__metadata__":{"step":12}})"),
                    {"__metadata__", "\"step\"", "must be a string"});
}

TEST_F(safetensors, RejectsAbsurdNesting) {
  expect_open_error(
      raw("deep.safetensors", "{\"w\":" + std::string(200, '[') + std::string(200, ']') + "}"),
      {"nests deeper"});
}

// ---- malformed checkpoints ----

// A two-shard checkpoint in the test directory, whose index a test then replaces.
void write_two_shards(const fs::path& dir) {
  write_checkpoint(dir, {{"a.weight", at::ones({8})}, {"b.weight", at::zeros({8})}}, 40);
  ASSERT_TRUE(fs::exists(dir / "model-00002-of-00002.safetensors"));
}

TEST_F(safetensors, CheckpointRejectsMissingShard) {
  write_two_shards(dir_);
  fs::remove(dir_ / "model-00002-of-00002.safetensors");
  EXPECT_THAT(checkpoint_error(),
              AllOf(HasSubstr(index_path().string()), HasSubstr("model-00002-of-00002.safetensors"),
                    HasSubstr("does not exist")));
}

TEST_F(safetensors, CheckpointRejectsIndexNamingTensorNotInShard) {
  write_two_shards(dir_);
  write_file_atomic(index_path(),
                    R"({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
      "b.weight": "model-00002-of-00002.safetensors",
      "c.weight": "model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(checkpoint_error(),
              AllOf(HasSubstr(index_path().string()), HasSubstr("\"c.weight\""),
                    HasSubstr("model-00002-of-00002.safetensors"), HasSubstr("no such tensor")));
}

TEST_F(safetensors, CheckpointRejectsMalformedIndex) {
  write_two_shards(dir_);
  write_file_atomic(index_path(), R"({"weight_map": {"a.weight": )");
  EXPECT_THAT(checkpoint_error(),
              AllOf(HasSubstr(index_path().string()), HasSubstr("not valid JSON")));
}

TEST_F(safetensors, CheckpointRejectsIndexWithoutWeightMap) {
  write_two_shards(dir_);
  write_file_atomic(index_path(), R"({"metadata": {"total_size": 64}})");
  EXPECT_THAT(checkpoint_error(),
              AllOf(HasSubstr(index_path().string()), HasSubstr("no \"weight_map\"")));
}

TEST_F(safetensors, CheckpointRejectsWeightMapEntryThatIsNotAString) {
  write_two_shards(dir_);
  write_file_atomic(index_path(), R"({"weight_map": {"a.weight": 1}})");
  EXPECT_THAT(checkpoint_error(), AllOf(HasSubstr(index_path().string()), HasSubstr("\"a.weight\""),
                                        HasSubstr("must be a shard file name")));
}

TEST_F(safetensors, CheckpointRejectsShardOutsideTheDirectory) {
  write_two_shards(dir_);
  write_file_atomic(index_path(), R"({"weight_map": {"a.weight": "../elsewhere/x.safetensors"}})");
  EXPECT_THAT(checkpoint_error(), AllOf(HasSubstr(index_path().string()), HasSubstr("\"a.weight\""),
                                        HasSubstr("not a plain file name")));
}

TEST_F(safetensors, CheckpointRejectsDuplicateTensorInIndex) {
  write_two_shards(dir_);
  write_file_atomic(index_path(),
                    R"({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
      "a.weight": "model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(checkpoint_error(), AllOf(HasSubstr(index_path().string()), HasSubstr("\"a.weight\""),
                                        HasSubstr("twice")));
}

TEST_F(safetensors, CheckpointRejectsCorruptShard) {
  write_two_shards(dir_);
  fs::path shard = dir_ / "model-00001-of-00002.safetensors";
  std::string bytes = read_file(shard);
  bytes[9] = '#';  // inside the header JSON
  write_file_atomic(shard, bytes);
  EXPECT_THAT(checkpoint_error(), AllOf(HasSubstr(shard.string()), HasSubstr("not valid JSON")));
}

TEST_F(safetensors, CheckpointRejectsDirectoryWithoutCheckpoint) {
  write_two_shards(dir_);
  fs::create_directories(dir_ / "empty");
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir_ / "empty"); }),
              AllOf(HasSubstr((dir_ / "empty").string()), HasSubstr("neither")));
  EXPECT_THAT(error_of([&] { Checkpoint::open(dir_ / "missing"); }),
              AllOf(HasSubstr((dir_ / "missing").string()), HasSubstr("does not exist")));
}

TEST_F(safetensors, CheckpointUnknownTensorIsNamed) {
  write_two_shards(dir_);
  Checkpoint ck = Checkpoint::open(dir_);
  EXPECT_THAT(error_of([&] { ck.info("layers.9.weight"); }),
              AllOf(HasSubstr(dir_.string()), HasSubstr("\"layers.9.weight\"")));
  EXPECT_THAT(error_of([&] { ck.tensor("layers.9.weight"); }), HasSubstr("\"layers.9.weight\""));
  EXPECT_THAT(error_of([&] {
                ck.load({"a.weight", "layers.9.weight"}, at::kCPU, at::kFloat);
              }),
              HasSubstr("\"layers.9.weight\""));
  auto file = SafetensorsFile::open(dir_ / "model-00001-of-00002.safetensors");
  EXPECT_THAT(error_of([&] { file->tensor("b.weight"); }),
              AllOf(HasSubstr(file->path().string()), HasSubstr("\"b.weight\"")));
}

// ---- writer refusals ----

TEST_F(safetensors, WriterRejectsDuplicateNames) {
  fs::path p = dir_ / "dup.safetensors";
  EXPECT_THAT(error_of([&] {
                write_safetensors(p, {{"w", at::ones({1})}, {"w", at::ones({1})}});
              }),
              AllOf(HasSubstr(p.string()), HasSubstr("\"w\""), HasSubstr("twice")));
  EXPECT_THAT(error_of([&] {
                write_checkpoint(dir_ / "ck", {{"w", at::ones({4})}, {"w", at::ones({4})}}, 8);
              }),
              AllOf(HasSubstr((dir_ / "ck").string()), HasSubstr("\"w\""), HasSubstr("twice")));
  EXPECT_FALSE(fs::exists(p));
}

TEST_F(safetensors, WriterRejectsUnsupportedDtype) {
  fs::path p = dir_ / "complex.safetensors";
  EXPECT_THAT(
      error_of([&] {
        write_safetensors(p, {{"z", at::ones({2}, at::kComplexFloat)}});
      }),
      AllOf(HasSubstr(p.string()), HasSubstr("\"z\""), HasSubstr("no safetensors equivalent")));
  EXPECT_THAT(error_of([&] {
                write_safetensors(p, {{"u", at::ones({2}, at::kUInt16)}});
              }),
              AllOf(HasSubstr("\"u\""), HasSubstr("UInt16")));
}

TEST_F(safetensors, WriterRejectsReservedAndUndefined) {
  fs::path p = dir_ / "bad.safetensors";
  EXPECT_THAT(error_of([&] {
                write_safetensors(p, {{"__metadata__", at::ones({1})}});
              }),
              AllOf(HasSubstr(p.string()), HasSubstr("__metadata__")));
  EXPECT_THAT(error_of([&] {
                write_safetensors(p, {{"w", at::Tensor()}});
              }),
              AllOf(HasSubstr(p.string()), HasSubstr("\"w\""), HasSubstr("undefined")));
}

}  // namespace
}  // namespace dflash::io
