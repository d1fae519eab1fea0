#include "common/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/error.h"

namespace dflash {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open {}: {}", path.string(), std::strerror(errno));
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) fail("error reading {}", path.string());
  return std::move(out).str();
}

void write_all(int fd, const void* data, size_t size, const std::filesystem::path& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write to {} failed: {}", path.string(), std::strerror(errno));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void write_file_atomic(const std::filesystem::path& path, const std::function<void(int fd)>& fill) {
  std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  std::string tmpl = (dir / ("." + path.filename().string() + ".tmp.XXXXXX")).string();
  int fd = ::mkstemp(tmpl.data());
  if (fd < 0)
    fail("cannot create a temporary file beside {}: {}", path.string(), std::strerror(errno));
  try {
    // mkstemp creates the file 0600; a written file should be as readable as any other.
    if (::fchmod(fd, 0644) != 0) fail("chmod of {} failed: {}", tmpl, std::strerror(errno));
    fill(fd);
    if (::fsync(fd) != 0) fail("fsync of {} failed: {}", tmpl, std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmpl.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmpl.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmpl.c_str());
    fail("cannot rename {} to {}: {}", tmpl, path.string(), std::strerror(err));
  }
  fsync_dir(dir);
}

void fsync_dir(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void remove_tree(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(std::filesystem::symlink_status(path, ec))) {
    for (const auto& e : std::filesystem::directory_iterator(path, ec)) remove_tree(e.path());
  }
  std::filesystem::remove(path, ec);
}

void write_file_atomic(const std::filesystem::path& path, std::string_view bytes) {
  write_file_atomic(path, [&](int fd) { write_all(fd, bytes.data(), bytes.size(), path); });
}

}  // namespace dflash
