// Multi-process dist tests: dist::launch_local starts 2-3 dist_worker ranks on 127.0.0.1 (Gloo),
// and each test checks the launcher's return code, every rank's own result file, the error
// messages, and how long failures took to surface.
#include "dist/launch.h"

#include <ATen/Context.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// A scratch folder removed with plain POSIX calls (libtorch.so's std::filesystem::remove_all
// crashes).
class TempDir {
 public:
  TempDir() {
    std::string pattern = "/tmp/dflash_dist_XXXXXX";
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    if (DIR* dir = ::opendir(path_.c_str())) {
      while (dirent* e = ::readdir(dir)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") ::unlink((path_ + "/" + name).c_str());
      }
      ::closedir(dir);
    }
    ::rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct Outcome {
  int code = -1;
  double seconds = 0;
  std::map<int, std::string> results;  // rank -> its rank<R>.txt
  std::map<int, pid_t> pids;
  std::string stderr_text;  // the launcher's and the ranks' stderr
};

// Runs `nproc` dist_worker ranks through launch_local with the launcher's stderr (which the
// ranks share) captured to a file; `during` runs on another thread meanwhile.
Outcome launch(int nproc, const std::string& scenario, int timeout_ms, double grace_s,
               const std::function<void(const std::string& dir)>& during = nullptr,
               const std::string& device = "cpu") {
  TempDir dir;
  ::unsetenv("MASTER_PORT");
  ::setenv("DFLASH_KILL_GRACE_S", std::to_string(grace_s).c_str(), 1);
  ::setenv("OMP_NUM_THREADS", "1", 1);
  const std::string log = dir.path() + "/stderr.log";
  std::fflush(stderr);
  const int saved = ::dup(2);
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(fd, 2);
  ::close(fd);
  Outcome run;
  const auto start = Clock::now();
  std::thread helper;
  if (during) helper = std::thread([&] { during(dir.path()); });
  try {
    run.code = dflash::dist::launch_local(
        nproc, {"dist_worker", scenario, dir.path(), std::to_string(timeout_ms), device},
        DFLASH_DIST_WORKER);
  } catch (...) {
    ::dup2(saved, 2);
    if (helper.joinable()) helper.join();
    throw;
  }
  run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  if (helper.joinable()) helper.join();
  run.stderr_text = read_text(log);
  for (int r = 0; r < nproc; ++r) {
    const std::string result = dir.path() + "/rank" + std::to_string(r) + ".txt";
    if (exists(result)) run.results[r] = read_text(result);
    const std::string pid = dir.path() + "/pid" + std::to_string(r) + ".txt";
    if (exists(pid)) run.pids[r] = std::stoi(read_text(pid));
  }
  std::cerr << "--- ranks' and launcher's stderr (" << run.seconds << " s, code " << run.code
            << ") ---\n"
            << run.stderr_text << "---\n";
  return run;
}

double seconds_in(const std::string& result) {
  // "error seconds=S\n..."
  const auto at = result.find("seconds=");
  return at == std::string::npos ? -1 : std::stod(result.substr(at + 8));
}

bool process_gone(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

void expect_collectives_pass(int nproc, const std::string& device = "cpu") {
  Outcome run = launch(nproc, "collectives", 60000, 5, nullptr, device);
  EXPECT_EQ(run.code, 0);
  ASSERT_EQ(run.results.size(), static_cast<size_t>(nproc));
  // Every rank ran every check (the count depends on whether the rank is in the 0-1 pair).
  for (int r = 0; r < nproc; ++r) {
    const int pair_checks = r == 1 ? 2 : 0;
    EXPECT_EQ(run.results[r], "ok checks=" + std::to_string(11 + pair_checks + 2 * nproc) + "\n")
        << "rank " << r;
  }
}

TEST(DistLaunch, CollectivesTwoRanks) { expect_collectives_pass(2); }

TEST(DistLaunch, CollectivesThreeRanks) { expect_collectives_pass(3); }

TEST(DistLaunch, CollectivesNcclGpu) {
  const int gpus = static_cast<int>(at::getNumGPUs());
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs, has " << gpus;
  expect_collectives_pass(std::min(gpus, 3), "cuda");
}

TEST(DistLaunch, DeadPeerFailsTheOthersQuicklyNamingTheStage) {
  // Rank 2 is SIGKILLed after the warm-up barrier; ranks 0 and 1 (which ignore the launcher's
  // SIGTERM) must fail their all-reduce on their own, well before the 60 s kill grace.
  const int timeout_ms = 8000;
  Outcome run = launch(3, "dead_peer", timeout_ms, 60);
  EXPECT_EQ(run.code, 128 + SIGKILL);
  EXPECT_NE(run.stderr_text.find("dflash: rank 2 was killed by signal 9"), std::string::npos);
  for (int r = 0; r < 2; ++r) {
    const std::string& result = run.results[r];
    EXPECT_EQ(result.rfind("error", 0), 0u) << "rank " << r << ": " << result;
    EXPECT_NE(result.find("rank " + std::to_string(r) + ": all_reduce in stage 'grad_all_reduce'"),
              std::string::npos)
        << result;
    EXPECT_NE(result.find("a peer rank may have died"), std::string::npos) << result;
    EXPECT_GE(seconds_in(result), 0);
    EXPECT_LE(seconds_in(result), timeout_ms / 1000.0 + 5) << result;
  }
  EXPECT_LT(run.seconds, 40);
}

TEST(DistLaunch, HungPeerTimesOutAndIsKilled) {
  // Rank 1 stops responding (and ignores SIGTERM): rank 0's all-reduce must time out after about
  // the configured 4 s, then the launcher SIGKILLs rank 1 after its 1 s grace.
  const int timeout_ms = 4000;
  Outcome run = launch(2, "hung_peer", timeout_ms, 1);
  EXPECT_EQ(run.code, 2);  // rank 0's exit code after catching the error
  const std::string& result = run.results[0];
  EXPECT_EQ(result.rfind("error", 0), 0u) << result;
  EXPECT_NE(result.find("rank 0: all_reduce in stage 'grad_all_reduce' failed after"),
            std::string::npos)
      << result;
  EXPECT_GE(seconds_in(result), timeout_ms / 1000.0 - 0.5) << result;
  EXPECT_LE(seconds_in(result), timeout_ms / 1000.0 + 10) << result;
  EXPECT_NE(run.stderr_text.find("dflash: rank 0 exited with code 2; stopping the other ranks"),
            std::string::npos);
  EXPECT_NE(run.stderr_text.find("dflash: rank 1 still running 1 s after SIGTERM; sending SIGKILL"),
            std::string::npos);
  ASSERT_TRUE(run.pids.count(1));
  EXPECT_TRUE(process_gone(run.pids[1]));
  EXPECT_LT(run.seconds, 40);
}

TEST(DistLaunch, HungPeerNcclGpu) {
  // NCCL cannot throw at the call: the all-reduce is enqueued and the host waits in the copy to
  // the CPU. The group's watchdog must take rank 0 down after the timeout, and the launcher the
  // rest.
  if (at::getNumGPUs() < 2) GTEST_SKIP() << "needs 2 GPUs";
  const int timeout_ms = 10000;
  Outcome run = launch(2, "hung_peer", timeout_ms, 1, nullptr, "cuda");
  EXPECT_NE(run.code, 0);
  EXPECT_EQ(run.results.count(0), 0u) << run.results[0];  // rank 0 did not get past the wait
  EXPECT_NE(run.stderr_text.find("dflash: rank 0 "), std::string::npos);
  EXPECT_GE(run.seconds, timeout_ms / 1000.0);
  EXPECT_LT(run.seconds, timeout_ms / 1000.0 + 90);
}

TEST(DistLaunch, MissingRankFailsTheRendezvous) {
  const int timeout_ms = 4000;
  Outcome run = launch(2, "missing_at_rendezvous", timeout_ms, 30);
  EXPECT_EQ(run.code, 3);
  const std::string& result = run.results[0];
  EXPECT_EQ(result.rfind("error", 0), 0u) << result;
  EXPECT_NE(result.find("rank 0: rendezvous at 127.0.0.1:"), std::string::npos) << result;
  EXPECT_NE(result.find("in stage 'rendezvous'"), std::string::npos) << result;
  EXPECT_LE(seconds_in(result), timeout_ms / 1000.0 + 10) << result;
  EXPECT_LT(run.seconds, 30);
}

TEST(DistLaunch, HungRankIsKilledAfterAnotherFails) {
  // Rank 0 exits 5; rank 1 ignores SIGTERM and sleeps forever, rank 2 sleeps forever.
  Outcome run = launch(3, "fail_and_hang", 0, 1);
  EXPECT_EQ(run.code, 5);
  EXPECT_NE(run.stderr_text.find("dflash: rank 0 exited with code 5; stopping the other ranks"),
            std::string::npos);
  EXPECT_NE(run.stderr_text.find("dflash: rank 1 still running 1 s after SIGTERM; sending SIGKILL"),
            std::string::npos);
  // Rank 2 stopped on SIGTERM, so only rank 1 needed SIGKILL.
  EXPECT_EQ(run.stderr_text.find("dflash: rank 2 still running"), std::string::npos);
  ASSERT_EQ(run.pids.size(), 3u);
  for (const auto& [rank, pid] : run.pids) EXPECT_TRUE(process_gone(pid)) << "rank " << rank;
  EXPECT_GE(run.seconds, 1.0);
  EXPECT_LT(run.seconds, 20);
}

TEST(DistLaunch, ForwardsSigtermToEveryRank) {
  Outcome run = launch(2, "wait_for_sigterm", 0, 30, [](const std::string& dir) {
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline && !(exists(dir + "/rank0.txt") && exists(dir + "/rank1.txt"))) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // To the launcher, which forwards it (not if the ranks never got ready: nothing would
    // catch it then).
    if (exists(dir + "/rank0.txt") && exists(dir + "/rank1.txt")) ::kill(::getpid(), SIGTERM);
  });
  EXPECT_EQ(run.code, 0);
  EXPECT_EQ(run.results[0], "got signal " + std::to_string(SIGTERM) + "\n");
  EXPECT_EQ(run.results[1], "got signal " + std::to_string(SIGTERM) + "\n");
}

}  // namespace
