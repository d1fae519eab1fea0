#include "obs/tensorboard.h"

#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>

#include "common/crc32c.h"
#include "common/error.h"

namespace dflash::obs {
namespace {

// Protobuf wire format, just what Event needs. Wire types: 0 varint, 1 fixed64, 2 length-
// delimited, 5 fixed32. Scalars are written in field-number order, as protobuf does.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, uint32_t field, uint32_t wire_type) {
  put_varint(out, (uint64_t{field} << 3) | wire_type);
}

template <class UInt>
void put_le(std::string& out, UInt v) {
  for (size_t i = 0; i < sizeof(UInt); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Event{ double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
// SessionLog session_log = 7; }  (file_version, summary and session_log are a oneof; 6 is the
// deprecated LogMessage log_message.) A step of 0 is left out, as proto3 does for a default;
// the oneof members are always written.
std::string event_header(int64_t step) {
  std::string event;
  put_key(event, 1, 1);
  put_le(event, std::bit_cast<uint64_t>(unix_seconds()));
  if (step != 0) {
    put_key(event, 2, 0);
    put_varint(event, static_cast<uint64_t>(step));  // negative: 10-byte two's complement
  }
  return event;
}

// Summary{ repeated Value value = 1; }  Value{ string tag = 1; float simple_value = 2; }
std::string scalar_summary(const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, value] : values) {
    if (tag.empty()) fail("TensorBoard: empty scalar tag");
    std::string v;
    put_bytes(v, 1, tag);
    put_key(v, 2, 5);
    put_le(v, std::bit_cast<uint32_t>(static_cast<float>(value)));
    put_bytes(summary, 1, v);
  }
  return summary;
}

std::string hostname() {
  std::array<char, 256> name{};
  if (::gethostname(name.data(), name.size() - 1) != 0 || name[0] == '\0') return "localhost";
  std::string host(name.data());
  for (char& c : host) {
    if (c == '/') c = '_';
  }
  return host;
}

}  // namespace

uint32_t tfrecord_masked_crc(const void* data, size_t size) {
  uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string record;
  record.reserve(data.size() + 16);
  put_le(record, uint64_t{data.size()});
  put_le(record, tfrecord_masked_crc(record.data(), 8));
  record.append(data);
  put_le(record, tfrecord_masked_crc(data.data(), data.size()));
  return record;
}

TensorBoardWriter::TensorBoardWriter(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("TensorBoard: cannot create log directory {}: {}", dir.string(), ec.message());
  const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  const std::string base =
      fmt::format("events.out.tfevents.{}.{}.{}.dflash", now, hostname(), ::getpid());
  // Exclusive create ("x"), so two writers started in the same second never share a file;
  // a clash gets a numeric suffix (TensorBoard reads any name containing "tfevents").
  for (int attempt = 0; !file_; ++attempt) {
    path_ = dir / (attempt == 0 ? base : fmt::format("{}.{}", base, attempt));
    file_ = std::fopen(path_.c_str(), "wbx");
    if (!file_ && (errno != EEXIST || attempt >= 100)) {
      fail("TensorBoard: cannot create event file {}: {}", path_.string(), std::strerror(errno));
    }
  }
  std::setvbuf(file_, nullptr, _IOFBF, 1 << 16);
  std::string event = event_header(0);
  put_bytes(event, 3, "brain.Event:2");
  try {
    write_event(event);
    flush();  // the file is valid (and visible to TensorBoard) from the start
  } catch (...) {
    std::fclose(file_);
    throw;
  }
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);  // fclose flushes; a failure cannot be reported from here
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  add_scalars(step, {{tag, value}});
}

void TensorBoardWriter::add_scalars(int64_t step,
                                    const std::vector<std::pair<std::string, double>>& values) {
  if (values.empty()) return;
  std::string summary = scalar_summary(values);  // validates before anything is written
  std::string event = event_header(step);
  put_bytes(event, 5, summary);
  write_event(event);
}

void TensorBoardWriter::add_session_start(int64_t step) {
  // SessionLog{ SessionStatus status = 1; string checkpoint_path = 2; string msg = 3; },
  // SessionStatus{ STATUS_UNSPECIFIED = 0; START = 1; STOP = 2; CHECKPOINT = 3; }
  std::string session_log;
  put_key(session_log, 1, 0);
  put_varint(session_log, 1);
  std::string event = event_header(step);
  put_bytes(event, 7, session_log);
  write_event(event);
}

void TensorBoardWriter::write_event(const std::string& event) {
  if (!file_) fail("TensorBoard: {} is closed", path_.string());
  std::string record = tfrecord(event);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size()) {
    fail("TensorBoard: cannot write {}: {}", path_.string(), std::strerror(errno));
  }
}

void TensorBoardWriter::flush() {
  if (!file_) fail("TensorBoard: {} is closed", path_.string());
  if (std::fflush(file_) != 0) {
    fail("TensorBoard: cannot write {}: {}", path_.string(), std::strerror(errno));
  }
}

void TensorBoardWriter::close() {
  if (!file_) return;
  std::FILE* file = file_;
  file_ = nullptr;
  if (std::fclose(file) != 0) {
    fail("TensorBoard: cannot write {}: {}", path_.string(), std::strerror(errno));
  }
}

}  // namespace dflash::obs
