// One rank of the multi-process dist tests (started by dist::launch_local from launch_test.cpp,
// with the rank in the environment). Usage: dist_worker SCENARIO OUT_DIR [TIMEOUT_MS [DEVICE]]
// (DEVICE "cpu" by default: Gloo; "cuda": cuda:LOCAL_RANK and NCCL). Each rank
// writes OUT_DIR/rank<R>.txt ("ok checks=N", or "error seconds=S" and the error message) and
// OUT_DIR/pid<R>.txt, so the test can check every rank's outcome, not just the exit codes.
#include <ATen/ATen.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "common/error.h"
#include "dist/comm.h"
#include "dist/world.h"

namespace {

using dflash::dist::Comm;
using Clock = std::chrono::steady_clock;

constexpr int kMismatch = 10;
constexpr int kCommError = 2;

std::string g_out_dir;
int g_rank = -1;

void write_file(const std::string& name, const std::string& text) {
  std::ofstream(g_out_dir + "/" + name) << text;
}

void write_result(const std::string& text) { write_file(fmt::format("rank{}.txt", g_rank), text); }

[[noreturn]] void sleep_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// Survivors must outlive the launcher's SIGTERM to show that they fail on their own.
void ignore_sigterm() { ::signal(SIGTERM, SIG_IGN); }

class Checker {
 public:
  explicit Checker(int rank) : rank_(rank) {}
  void equal(const std::string& name, const at::Tensor& on_device, const at::Tensor& expected) {
    ++count_;
    const at::Tensor actual = on_device.cpu();
    if (actual.sizes() != expected.sizes() || actual.scalar_type() != expected.scalar_type() ||
        !at::equal(actual, expected)) {
      fmt::print(stderr, "rank {}: check '{}' failed:\n got {}\n expected {}\n", rank_, name,
                 actual.toString(), expected.toString());
      std::cerr << actual << "\n" << expected << "\n";
      ok_ = false;
    }
  }
  void values(const std::string& name, const std::vector<int64_t>& actual,
              const std::vector<int64_t>& expected) {
    ++count_;
    if (actual != expected) {
      fmt::print(stderr, "rank {}: check '{}' failed: got [{}], expected [{}]\n", rank_, name,
                 fmt::join(actual, ", "), fmt::join(expected, ", "));
      ok_ = false;
    }
  }
  bool ok() const { return ok_; }
  int count() const { return count_; }

 private:
  int rank_;
  int count_ = 0;
  bool ok_ = true;
};

at::Tensor arange(int64_t n, at::ScalarType dtype) { return at::arange(n, at::kDouble).to(dtype); }

int collectives(Comm& comm) {
  const int r = comm.rank(), n = comm.size();
  const at::Device device = comm.device();
  const bool nccl = comm.backend() == "nccl";
  const double tri = n * (n - 1) / 2.0;  // sum of the ranks
  Checker check(r);

  // Several dtypes and shapes in one call (two float tensors share a coalesced call).
  std::vector<at::Tensor> tensors = {
      arange(5, at::kFloat) + r,
      (arange(6, at::kLong) + 100 * r).reshape({2, 3}),
      at::full({3}, 0.5 * (r + 1), at::kDouble),
      at::full({2}, static_cast<float>(r), at::kFloat),
      arange(4, at::kBFloat16) * (r + 1),
  };
  for (auto& t : tensors) t = t.to(device);
  comm.all_reduce_sum(tensors, "test_all_reduce");
  check.equal("all_reduce float", tensors[0], arange(5, at::kFloat) * n + tri);
  check.equal("all_reduce int64", tensors[1],
              (arange(6, at::kLong) * n + static_cast<int64_t>(100 * tri)).reshape({2, 3}));
  check.equal("all_reduce double", tensors[2], at::full({3}, 0.5 * (tri + n), at::kDouble));
  check.equal("all_reduce float 2", tensors[3], at::full({2}, static_cast<float>(tri), at::kFloat));
  check.equal("all_reduce bf16", tensors[4], arange(4, at::kBFloat16) * (tri + n));

  at::Tensor single = at::full({7}, static_cast<int64_t>(1) << (2 * r), at::kLong).to(device);
  comm.all_reduce_sum(single, "test_all_reduce_single");
  int64_t bits = 0;
  for (int i = 0; i < n; ++i) bits += static_cast<int64_t>(1) << (2 * i);
  check.equal("all_reduce single", single, at::full({7}, bits, at::kLong));

  const int root = n - 1;
  std::vector<at::Tensor> broadcast = {arange(4, at::kFloat) + 10 * r,
                                       at::full({1}, static_cast<int64_t>(r), at::kLong)};
  for (auto& t : broadcast) t = t.to(device);
  comm.broadcast(broadcast, root, "test_broadcast");
  check.equal("broadcast float", broadcast[0], arange(4, at::kFloat) + 10 * root);
  check.equal("broadcast int64", broadcast[1],
              at::full({1}, static_cast<int64_t>(root), at::kLong));

  // A ring: everyone sends to the next rank while receiving from the previous one. An NCCL send
  // holds its stream until the peer receives, so there odd ranks receive first.
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  at::Tensor outgoing = (arange(3, at::kFloat) + 1000 * r).to(device);
  at::Tensor incoming = at::full({3}, -1.0f, at::kFloat).to(device);
  if (nccl && r % 2 == 1) {
    comm.irecv(incoming, prev, 7, "test_ring").wait();
    comm.isend(outgoing, next, 7, "test_ring").wait();
  } else {
    auto sent = comm.isend(outgoing, next, 7, "test_ring");
    auto received = comm.irecv(incoming, prev, 7, "test_ring");
    received.wait();
    sent.wait();
  }
  check.equal("ring", incoming, arange(3, at::kFloat) + 1000 * prev);

  // Blocking pair between ranks 0 and 1, two messages told apart by tag (Gloo: received out of
  // order; NCCL ignores tags and matches in order).
  const auto doubles = at::TensorOptions().dtype(at::kDouble).device(device);
  if (r == 0) {
    comm.send(at::full({2}, 11.0, doubles), 1, 21, "test_pair");
    comm.send(at::full({2}, 22.0, doubles), 1, 22, "test_pair");
  } else if (r == 1) {
    at::Tensor second = at::zeros({2}, doubles), first = at::zeros({2}, doubles);
    if (nccl) {
      comm.recv(first, 0, 21, "test_pair");
      comm.recv(second, 0, 22, "test_pair");
    } else {
      auto later = comm.irecv(second, 0, 22, "test_pair");
      comm.recv(first, 0, 21, "test_pair");
      later.wait();
    }
    check.equal("pair tag 21", first, at::full({2}, 11.0, at::kDouble));
    check.equal("pair tag 22", second, at::full({2}, 22.0, at::kDouble));
  }

  comm.barrier("test_barrier");

  auto gathered = comm.all_gather_int64({r, r * r, 42}, "test_all_gather");
  check.values("all_gather size", {static_cast<int64_t>(gathered.size())}, {n});
  for (int i = 0; i < n && i < static_cast<int>(gathered.size()); ++i) {
    check.values(fmt::format("all_gather rank {}", i), gathered[i], {i, i * i, 42});
  }
  // Lengths differ between ranks.
  auto ragged = comm.all_gather_int64(std::vector<int64_t>(r + 1, 7 * r), "test_all_gather_ragged");
  for (int i = 0; i < n && i < static_cast<int>(ragged.size()); ++i) {
    check.values(fmt::format("ragged rank {}", i), ragged[i], std::vector<int64_t>(i + 1, 7 * i));
  }
  auto empty = comm.all_gather_int64({}, "test_all_gather_empty");
  check.values("empty", {static_cast<int64_t>(empty.size())}, {n});

  comm.barrier("test_end");
  if (!check.ok()) return kMismatch;
  write_result(fmt::format("ok checks={}\n", check.count()));
  return 0;
}

// Runs `body`, which must throw dflash::Error; records how long that took and the message.
template <class F>
int expect_error(F&& body) {
  const auto start = Clock::now();
  try {
    body();
  } catch (const dflash::Error& e) {
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    fmt::print(stderr, "rank {}: caught as expected: {}\n", g_rank, e.what());
    write_result(fmt::format("error seconds={:.2f}\n{}\n", seconds, e.what()));
    return kCommError;
  }
  write_result("no error\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fmt::print(stderr, "usage: dist_worker SCENARIO OUT_DIR [TIMEOUT_MS [DEVICE]]\n");
    return 64;
  }
  const std::string scenario = argv[1];
  g_out_dir = argv[2];
  const int timeout_ms = argc > 3 ? std::stoi(argv[3]) : 20000;
  const std::string device_name = argc > 4 ? argv[4] : "cpu";
  try {
    const auto world = dflash::dist::world_from_env();
    g_rank = world.rank;
    write_file(fmt::format("pid{}.txt", g_rank), std::to_string(::getpid()));
    const int last = world.world_size - 1;
    dflash::dist::CommOptions options;
    options.timeout = std::chrono::milliseconds(timeout_ms);

    if (scenario == "collectives") {
      auto comm = Comm::create(world, dflash::dist::device_for(world, device_name), options);
      return collectives(*comm);
    }
    if (scenario == "dead_peer" || scenario == "hung_peer") {
      // The last rank disappears (SIGKILL) or stops responding after a first collective.
      auto comm = Comm::create(world, dflash::dist::device_for(world, device_name), options);
      comm->barrier("warmup");
      if (world.rank == last) {
        if (scenario == "dead_peer") ::raise(SIGKILL);
        ignore_sigterm();
        sleep_forever();
      }
      ignore_sigterm();
      std::vector<at::Tensor> grads = {at::ones({1000}, at::kFloat).to(comm->device())};
      // The copy to the host waits for an NCCL all-reduce, which only its watchdog can end.
      return expect_error([&] {
        comm->all_reduce_sum(grads, "grad_all_reduce");
        (void)grads[0].cpu();
      });
    }
    if (scenario == "missing_at_rendezvous") {
      // The last rank leaves only once the others ignore SIGTERM: on a loaded machine the
      // launcher's SIGTERM after its exit could otherwise end a rank still starting up, before
      // its rendezvous had the chance to time out.
      if (world.rank == last) {
        const auto give_up = Clock::now() + std::chrono::seconds(30);
        for (int r = 0; r < last && Clock::now() < give_up; ++r) {
          while (!std::ifstream(fmt::format("{}/ignoring{}.txt", g_out_dir, r)) &&
                 Clock::now() < give_up) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }
        return 3;
      }
      ignore_sigterm();
      write_file(fmt::format("ignoring{}.txt", g_rank), "");
      return expect_error([&] { Comm::create(world, at::Device(at::kCPU), options); });
    }
    if (scenario == "fail_and_hang") {
      // Rank 0 fails; rank 1 ignores SIGTERM and must be SIGKILLed; the rest stop on SIGTERM.
      if (world.rank == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        return 5;
      }
      if (world.rank == 1) ignore_sigterm();
      sleep_forever();
    }
    if (scenario == "wait_for_sigterm") {
      // Exits 0 on the first SIGTERM, as the trainer checkpoints and returns.
      sigset_t set;
      sigemptyset(&set);
      sigaddset(&set, SIGTERM);
      sigprocmask(SIG_BLOCK, &set, nullptr);
      write_result("ready\n");
      int signal = 0;
      sigwait(&set, &signal);
      write_result(fmt::format("got signal {}\n", signal));
      return 0;
    }
    fmt::print(stderr, "dist_worker: unknown scenario '{}'\n", scenario);
    return 64;
  } catch (const std::exception& e) {
    fmt::print(stderr, "rank {}: {}\n", g_rank, e.what());
    write_result(fmt::format("exception\n{}\n", e.what()));
    return 1;
  }
}
