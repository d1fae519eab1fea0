#include "dist/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/error.h"

extern char** environ;

namespace dflash::dist {
namespace {

using Clock = std::chrono::steady_clock;

volatile sig_atomic_t g_forward_signal = 0;

extern "C" void on_launcher_signal(int signal) { g_forward_signal = signal; }

int parse_positive(std::string_view text, std::string_view what) {
  int value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end || value < 1) {
    fail("{} needs a positive integer, got '{}'", what, text);
  }
  return value;
}

double kill_grace_seconds() {
  const char* text = std::getenv("DFLASH_KILL_GRACE_S");
  if (text == nullptr || *text == '\0') return 30.0;
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (*end != '\0' || !(value >= 0)) {
    fail("DFLASH_KILL_GRACE_S='{}' is not a number of seconds", text);
  }
  return value;
}

std::vector<std::string> child_environment(int rank, int nproc, int port) {
  const std::vector<std::pair<std::string, std::string>> ours = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(nproc)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(port)},
      {"DFLASH_LAUNCHED", "1"},
  };
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    bool replaced = false;
    for (const auto& [key, value] : ours) replaced = replaced || name == key;
    if (!replaced) env.emplace_back(entry);
  }
  for (const auto& [key, value] : ours) env.push_back(key + "=" + value);
  return env;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> result;
  for (auto& s : strings) result.push_back(s.data());
  result.push_back(nullptr);
  return result;
}

struct Child {
  pid_t pid = -1;
  bool running = false;
};

void signal_all(std::vector<Child>& children, int signal) {
  for (const auto& child : children) {
    if (child.running) ::kill(child.pid, signal);
  }
}

// Restores the caller's SIGINT/SIGTERM handling however launch_local returns.
class ForwardSignals {
 public:
  ForwardSignals() {
    g_forward_signal = 0;
    struct sigaction sa = {};
    sa.sa_handler = on_launcher_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
  }
  ~ForwardSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  ForwardSignals(const ForwardSignals&) = delete;
  ForwardSignals& operator=(const ForwardSignals&) = delete;

 private:
  struct sigaction old_int_ = {};
  struct sigaction old_term_ = {};
};

}  // namespace

// Released again before rank 0 binds it, which leaves a short window for another process to
// take it (as torchrun's standalone mode).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail("launcher: socket: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    fail("launcher: finding a free port on 127.0.0.1: {}", std::strerror(err));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::optional<int> take_nproc_option(std::vector<std::string>& argv) {
  static constexpr std::string_view kOption = "--nproc-per-node";
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg == kOption) {
      if (i + 1 >= argv.size()) fail("{} needs a value (the number of processes)", kOption);
      const int n = parse_positive(argv[i + 1], kOption);
      argv.erase(argv.begin() + i, argv.begin() + i + 2);
      return n;
    }
    if (arg.starts_with(kOption) && arg.size() > kOption.size() && arg[kOption.size()] == '=') {
      const int n = parse_positive(arg.substr(kOption.size() + 1), kOption);
      argv.erase(argv.begin() + i);
      return n;
    }
  }
  return std::nullopt;
}

int launch_local(int nproc, const std::vector<std::string>& argv, const std::string& program,
                 const std::string& continue_hint) {
  if (nproc < 1) fail("--nproc-per-node needs a positive integer, got {}", nproc);
  if (argv.empty()) fail("launcher: empty argv (argv[0] is the program name)");
  const double grace = kill_grace_seconds();
  int port = 0;
  if (const char* text = std::getenv("MASTER_PORT"); text != nullptr && *text != '\0') {
    port = parse_positive(text, "MASTER_PORT");
    if (port > 65535) fail("MASTER_PORT={} is not a TCP port (1..65535)", port);
  } else {
    port = free_port();
  }

  ForwardSignals forward;
  std::vector<Child> children(nproc);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  // Children must stop on the signals we forward even if this process was started ignoring them.
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
  for (int rank = 0; rank < nproc; ++rank) {
    std::vector<std::string> args = argv;
    std::vector<std::string> env = child_environment(rank, nproc, port);
    auto arg_ptrs = pointers(args);
    auto env_ptrs = pointers(env);
    pid_t pid = -1;
    const int err =
        ::posix_spawn(&pid, program.c_str(), nullptr, &attr, arg_ptrs.data(), env_ptrs.data());
    if (err != 0) {
      signal_all(children, SIGKILL);
      for (auto& child : children) {
        if (child.running) ::waitpid(child.pid, nullptr, 0);
      }
      posix_spawnattr_destroy(&attr);
      fail("launcher: starting rank {} ({}): {}", rank, program, std::strerror(err));
    }
    children[rank] = {pid, true};
  }
  posix_spawnattr_destroy(&attr);

  int first_failure = 0;
  int forwarded = 0;  // the signal passed on to the ranks, if any
  int running = nproc;
  auto kill_at = Clock::time_point::max();  // after a failure: when SIGTERM turns into SIGKILL
  while (running > 0) {
    if (const int signal = g_forward_signal; signal != 0) {
      g_forward_signal = 0;
      forwarded = signal;
      signal_all(children, signal);
    }
    for (int rank = 0; rank < nproc; ++rank) {
      Child& child = children[rank];
      if (!child.running) continue;
      int status = 0;
      const pid_t done = ::waitpid(child.pid, &status, WNOHANG);
      if (done == 0 || (done < 0 && errno == EINTR)) continue;
      child.running = false;
      --running;
      int code = 0;
      std::string how;
      if (done < 0) {
        code = 1;
        how = fmt::format("could not be waited for: {}", std::strerror(errno));
      } else if (WIFEXITED(status)) {
        code = WEXITSTATUS(status);
        how = fmt::format("exited with code {}", code);
      } else if (WIFSIGNALED(status)) {
        code = 128 + WTERMSIG(status);
        how = fmt::format("was killed by signal {} ({})", WTERMSIG(status),
                          strsignal(WTERMSIG(status)));
      }
      if (code == 0 || first_failure != 0) continue;
      first_failure = code;
      if (forwarded != 0 && code == 128 + forwarded) continue;  // stopped as asked
      fmt::print(stderr, "dflash: rank {} {}{}\n", rank, how,
                 running > 0 ? "; stopping the other ranks" : "");
      if (!continue_hint.empty()) fmt::print(stderr, "dflash: {}\n", continue_hint);
      std::fflush(stderr);
      signal_all(children, SIGTERM);
      kill_at = Clock::now() +
                std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace));
    }
    if (running > 0 && Clock::now() >= kill_at) {
      for (int rank = 0; rank < nproc; ++rank) {
        if (!children[rank].running) continue;
        fmt::print(stderr,
                   "dflash: rank {} still running {:.0f} s after SIGTERM; sending SIGKILL\n", rank,
                   grace);
        ::kill(children[rank].pid, SIGKILL);
      }
      std::fflush(stderr);
      kill_at = Clock::time_point::max();
    }
    if (running > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return first_failure;
}

}  // namespace dflash::dist
