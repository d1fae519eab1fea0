// common: whole-file reads and atomic writes (temp file, fsync, rename), used by every
// component that persists something a crash must not leave half-written.
#pragma once
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace dflash {

std::string read_file(const std::filesystem::path& path);

// Writes `bytes` to `path` so that readers see either the old file or the complete new one:
// the data goes to a temporary file beside it, is fsynced, renamed over `path`, and the
// directory is fsynced.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

// Streaming form for large files: `fill` gets a descriptor open on the temporary file.
void write_file_atomic(const std::filesystem::path& path, const std::function<void(int fd)>& fill);

// Writes all of `size` bytes at `data` to `fd`, retrying short writes; names `path` on error.
void write_all(int fd, const void* data, size_t size, const std::filesystem::path& path);

// fsyncs a directory so that a rename or unlink inside it survives a crash.
void fsync_dir(const std::filesystem::path& dir);

// Removes a file or directory tree, ignoring what is already gone. Not
// std::filesystem::remove_all: the copy libtorch.so exports (which the dynamic linker binds
// first in programs linked with it) crashes on non-empty directories.
void remove_tree(const std::filesystem::path& path);

}  // namespace dflash
