// obs: TensorBoard event files written directly (no protobuf, no TensorFlow). An event file is
// a sequence of TFRecords, each holding one hand-encoded `tensorboard.Event` protobuf; only
// the fields scalars and restarts need are written (Event.wall_time/step/file_version/summary/
// session_log, Summary.value, Summary.Value.tag/simple_value, SessionLog.status). Standard
// library only (no LibTorch).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dflash::obs {

// TFRecord's checksum: CRC-32C masked as ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t tfrecord_masked_crc(const void* data, size_t size);

// One TFRecord: uint64 length (LE), masked CRC of those 8 bytes, the data, masked CRC of it.
std::string tfrecord(std::string_view data);

// Writes scalars to `<dir>/events.out.tfevents.<unix seconds>.<hostname>.<pid>.dflash`, the
// name TensorBoard looks for (`tensorboard --logdir <dir>`). Not thread-safe: one writer per
// run directory, used from one thread.
//
// Durability: records go through a stdio buffer. flush() hands everything written so far to
// the OS, so it survives a crash of this process (not a power loss: there is no fsync);
// scalars added since the last flush() can be lost on a crash, and the file may then end in a
// partial record, which TensorBoard's readers skip. Flush after each logging step.
class TensorBoardWriter {
 public:
  // Creates `dir` (and parents) and the event file, and writes the header Event
  // (file_version "brain.Event:2"). Throws dflash::Error naming the path on failure.
  explicit TensorBoardWriter(const std::filesystem::path& dir);
  // Flushes and closes; errors here are swallowed (call close() to see them).
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event holding one scalar (stored by TensorBoard as float32). Throws dflash::Error on
  // an empty tag or a failed write.
  void add_scalar(const std::string& tag, double value, int64_t step);
  // One Event holding several scalars of the same step (e.g. loss, lr, accuracy).
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // An Event `session_log { status: START }` at `step`, the first step this process will
  // write, as TensorFlow writes at the start of every session. TensorBoard reads it as a
  // (re)start: with purge_orphaned_data (its default) it drops the events already read, from
  // earlier files of the directory, whose step is >= `step`; so after a crash and a resume from
  // step N, a START at N + 1 hides the killed process's steps past the checkpoint, which this
  // process writes again. TensorBoard's plugin accumulator (behind its UI) takes the first START
  // of a run as the initial one and purges only on later ones: write one at the start of every
  // process, fresh runs included.
  void add_session_start(int64_t step);

  // Hands buffered records to the OS (fflush). Throws dflash::Error on failure.
  void flush();
  // Flushes and closes the file; later writes throw. Throws dflash::Error on failure.
  void close();

  const std::filesystem::path& path() const { return path_; }

 private:
  void write_event(const std::string& event);

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace dflash::obs
