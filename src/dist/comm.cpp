#include "dist/comm.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <utility>

#include "common/clock.h"
#include "common/error.h"

namespace dflash::dist {

struct Comm::Impl {
  World world;
  at::Device device{at::kCPU};
  CommOptions options;
  std::string backend = "none";
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> group;
};

namespace {

constexpr const char* kPeerHint = " (a peer rank may have died; see its log)";

std::string message_of(const std::exception& e) {
  // c10's what() carries a C++ backtrace that buries the one line that matters.
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

// Runs one c10d step and turns whatever it throws into a dflash::Error that says which rank,
// which operation of which stage, and how long it had been waiting.
template <class F>
auto guarded(int rank, std::string_view op, std::string_view stage, std::string_view hint, F&& f) {
  const auto start = Clock::now();
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("rank {}: {} in stage '{}' failed after {:.1f} s: {}{}", rank, op, stage,
         seconds_since(start), message_of(e), hint);
  }
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::shared_ptr<gloo::transport::Device> gloo_device(const World& world) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    std::string first(ifname);
    first = first.substr(0, first.find(','));
    return c10d::ProcessGroupGloo::createDeviceForInterface(first);
  }
  // On one machine, stay on loopback whatever this host's name resolves to.
  if (is_loopback(world.master_addr)) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

std::string pick_backend(const std::string& requested, at::Device device) {
  if (requested == "auto") return device.is_cuda() ? "nccl" : "gloo";
  if (requested == "gloo") return requested;
  if (requested == "nccl") {
    if (!device.is_cuda()) fail("backend 'nccl' needs a cuda device, got {}", device.str());
    return requested;
  }
  fail("communication backend '{}' is not one of auto, gloo, nccl", requested);
}

// PyTorch 2.11's flight recorder (c10d's ring of recent collectives, kept for debugging hangs)
// races in its recording: about 2 in 5 multi-rank test runs crashed with SIGSEGV in it.
// TORCH_FR_BUFFER_SIZE=0, set before the first group reads it, turns it off; a value the user
// set is kept (overwrite 0). Once per process, before any group: setenv is not safe beside
// other threads' getenv.
void disable_flight_recorder() {
  [[maybe_unused]] static const bool once = [] {
    return setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0;
  }();
}

// The process group of impl.world's ranks over impl.store.
c10::intrusive_ptr<c10d::Backend> make_group(const Comm::Impl& impl) {
  const World& world = impl.world;
  const CommOptions& options = impl.options;
  return guarded(world.rank, fmt::format("{} process group setup", impl.backend), "rendezvous",
                 kPeerHint, [&]() -> c10::intrusive_ptr<c10d::Backend> {
                   if (impl.backend == "gloo") {
                     auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
                     gloo_options->devices.push_back(gloo_device(world));
                     return c10::make_intrusive<c10d::ProcessGroupGloo>(
                         impl.store, world.rank, world.world_size, gloo_options);
                   }
#ifdef USE_C10D_NCCL
                   auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
                   nccl_options->timeout = options.timeout;
                   // Not bound to the device (no eager init): NCCL then gives each pair of ranks
                   // its own communicator for send/recv, which can overlap collectives instead
                   // of being serialised with them. The store already saw every rank arrive.
                   return c10::make_intrusive<c10d::ProcessGroupNCCL>(
                       impl.store, world.rank, world.world_size, nccl_options);
#else
        fail("unreachable: no NCCL in this build");
#endif
                 });
}

}  // namespace

std::unique_ptr<Comm> Comm::create(const World& world, at::Device device, CommOptions options) {
  if (world.world_size < 1 || world.rank < 0 || world.rank >= world.world_size) {
    fail("rank {} is outside a world of {} ranks", world.rank, world.world_size);
  }
  if (options.timeout <= std::chrono::milliseconds::zero()) {
    fail("communication timeout must be positive, got {} ms", options.timeout.count());
  }
  disable_flight_recorder();
  auto impl = std::make_unique<Impl>();
  impl->world = world;
  impl->device = device;
  impl->options = options;
  if (device.is_cuda()) {
    if (!device.has_index()) fail("communication device must name its index, got {}", device.str());
    c10::cuda::set_device(device.index());
  }
  const std::string backend = pick_backend(options.backend, device);
  if (world.world_size == 1) return std::unique_ptr<Comm>(new Comm(std::move(impl)));

  impl->backend = backend;
#ifndef USE_C10D_NCCL
  if (impl->backend == "nccl") fail("this build of dflash has no NCCL support (USE_C10D_NCCL)");
#endif
  const std::string where = fmt::format("{}:{}", world.master_addr, world.master_port);
  impl->store = guarded(
      world.rank, fmt::format("rendezvous at {}", where), "rendezvous",
      world.rank == 0 ? " (did every rank start, with the same MASTER_ADDR/MASTER_PORT?)"
                      : " (is rank 0 running, and MASTER_ADDR/MASTER_PORT the same everywhere?)",
      [&]() -> c10::intrusive_ptr<c10d::Store> {
        c10d::TCPStoreOptions store_options;
        store_options.port = static_cast<uint16_t>(world.master_port);
        store_options.isServer = world.rank == 0;
        store_options.numWorkers = world.world_size;
        store_options.waitWorkers = true;
        store_options.timeout = options.timeout;
        return c10::make_intrusive<c10d::TCPStore>(world.master_addr, store_options);
      });
  impl->group = make_group(*impl);
  return std::unique_ptr<Comm>(new Comm(std::move(impl)));
}

Comm::Comm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Comm::~Comm() {
  if (impl_->group) {
    try {
      // NCCL warns (and leaks its communicators) when a group is destroyed without shutdown.
      impl_->group->shutdown();
    } catch (const std::exception&) {
    }
  }
}

int Comm::rank() const { return impl_->world.rank; }
int Comm::size() const { return impl_->world.world_size; }
const std::string& Comm::backend() const { return impl_->backend; }
at::Device Comm::device() const { return impl_->device; }

namespace {

void check_tensor(const Comm::Impl& impl, const at::Tensor& t, std::string_view op,
                  std::string_view stage) {
  if (!t.defined()) fail("rank {}: {} in stage '{}': undefined tensor", impl.world.rank, op, stage);
  if (t.device() != impl.device) {
    fail("rank {}: {} in stage '{}': tensor on {}, communicator on {}", impl.world.rank, op, stage,
         t.device().str(), impl.device.str());
  }
  if (!t.is_contiguous()) {
    fail("rank {}: {} in stage '{}': tensor of shape {} is not contiguous", impl.world.rank, op,
         stage, t.sizes());
  }
}

void check_peer(const Comm::Impl& impl, int peer, std::string_view op, std::string_view stage) {
  if (peer < 0 || peer >= impl.world.world_size || peer == impl.world.rank) {
    fail("rank {}: {} in stage '{}': peer rank {} is not another rank of {}", impl.world.rank, op,
         stage, peer, impl.world.world_size);
  }
}

// Gloo bounds each wait by the group's timeout; an NCCL wait only enqueues a stream dependency
// (a timeout would make it block the host), and its watchdog enforces the timeout instead.
void wait_work(const Comm::Impl& impl, const c10::intrusive_ptr<c10d::Work>& work) {
  if (impl.backend == "nccl") {
    work->wait();
    return;
  }
  if (!work->wait(impl.options.timeout)) {
    fail("timed out after {} ms", impl.options.timeout.count());
  }
}

void wait_all(const Comm::Impl& impl, const std::vector<c10::intrusive_ptr<c10d::Work>>& works,
              std::string_view op, std::string_view stage, Clock::time_point start) {
  try {
    for (const auto& work : works) wait_work(impl, work);
  } catch (const std::exception& e) {
    fail("rank {}: {} in stage '{}' failed after {:.1f} s: {}{}", impl.world.rank, op, stage,
         seconds_since(start), message_of(e), kPeerHint);
  }
}

}  // namespace

void Comm::all_reduce_sum(std::vector<at::Tensor>& tensors, std::string_view stage) {
  const Impl& impl = *impl_;
  for (const auto& t : tensors) check_tensor(impl, t, "all_reduce", stage);
  if (!impl.group || tensors.empty()) return;
  // One coalesced call per dtype (c10d coalesces only tensors of one dtype), in order of first
  // appearance so every rank issues the same sequence.
  std::vector<std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return g.front().scalar_type() == t.scalar_type();
    });
    if (it == groups.end()) {
      groups.push_back({t});
    } else {
      it->push_back(t);
    }
  }
  const auto start = Clock::now();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  guarded(impl.world.rank, "all_reduce", stage, kPeerHint, [&] {
    for (auto& group : groups) {
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      if (group.size() == 1) {
        works.push_back(impl.group->allreduce(group, opts));
      } else {
        c10d::AllreduceCoalescedOptions coalesced;
        coalesced.reduceOp = c10d::ReduceOp::SUM;
        works.push_back(impl.group->allreduce_coalesced(group, coalesced));
      }
    }
  });
  wait_all(impl, works, "all_reduce", stage, start);
}

void Comm::all_reduce_sum(at::Tensor& tensor, std::string_view stage) {
  std::vector<at::Tensor> one{tensor};
  all_reduce_sum(one, stage);
}

void Comm::broadcast(std::vector<at::Tensor>& tensors, int root, std::string_view stage) {
  const Impl& impl = *impl_;
  if (root < 0 || root >= impl.world.world_size) {
    fail("rank {}: broadcast in stage '{}': root {} is not a rank of {}", impl.world.rank, stage,
         root, impl.world.world_size);
  }
  for (const auto& t : tensors) check_tensor(impl, t, "broadcast", stage);
  if (!impl.group || tensors.empty()) return;
  const auto start = Clock::now();
  const std::string op = fmt::format("broadcast from rank {}", root);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  guarded(impl.world.rank, op, stage, kPeerHint, [&] {
    // One call per tensor: c10d reads several tensors in one call as one per GPU.
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      c10d::BroadcastOptions opts;
      opts.rootRank = root;
      works.push_back(impl.group->broadcast(one, opts));
    }
  });
  wait_all(impl, works, op, stage, start);
}

void Comm::barrier(std::string_view stage) {
  const Impl& impl = *impl_;
  if (!impl.group) return;
  const auto start = Clock::now();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  guarded(impl.world.rank, "barrier", stage, kPeerHint, [&] {
    c10d::BarrierOptions opts;
    // NCCL would otherwise guess the GPU from the global rank.
    if (impl.device.is_cuda()) opts.device_ids = {impl.device.index()};
    works.push_back(impl.group->barrier(opts));
  });
  wait_all(impl, works, "barrier", stage, start);
}

std::vector<at::Tensor> Comm::all_gather(const at::Tensor& local, std::string_view stage) {
  const Impl& impl = *impl_;
  check_tensor(impl, local, "all_gather", stage);
  if (!impl.group) return {local};
  const auto start = Clock::now();
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < impl.world.world_size; ++r) outputs[0].push_back(at::empty_like(local));
  std::vector<at::Tensor> inputs{local};
  c10::intrusive_ptr<c10d::Work> work;
  guarded(impl.world.rank, "all_gather", stage, kPeerHint,
          [&] { work = impl.group->allgather(outputs, inputs); });
  wait_all(impl, {work}, "all_gather", stage, start);
  return outputs[0];
}

std::vector<std::vector<int64_t>> Comm::all_gather_int64(const std::vector<int64_t>& local,
                                                         std::string_view stage) {
  const Impl& impl = *impl_;
  const int n = impl.world.world_size;
  if (!impl.group) return {local};
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(impl.device);
  auto gather = [&](const at::Tensor& input) { return at::stack(all_gather(input, stage)).cpu(); };
  // Lengths first, so ranks may contribute different numbers of values.
  const at::Tensor lengths =
      gather(at::full({1}, static_cast<int64_t>(local.size()), on_device)).flatten();
  const int64_t longest = lengths.max().item<int64_t>();
  std::vector<std::vector<int64_t>> result(n);
  if (longest == 0) return result;
  at::Tensor padded = at::zeros({longest}, at::kLong);
  std::copy(local.begin(), local.end(), padded.data_ptr<int64_t>());
  const at::Tensor values = gather(padded.to(impl.device));
  for (int r = 0; r < n; ++r) {
    const int64_t* row = values[r].data_ptr<int64_t>();
    result[r].assign(row, row + lengths[r].item<int64_t>());
  }
  return result;
}

struct Comm::Pending::State {
  const Impl* impl = nullptr;
  c10::intrusive_ptr<c10d::Work> work;
  std::string op;
  std::string stage;
  Clock::time_point start;
};

Comm::Pending::Pending() = default;
Comm::Pending::Pending(Pending&&) noexcept = default;
Comm::Pending& Comm::Pending::operator=(Pending&& other) noexcept {
  if (this != &other) {
    try {
      wait();
    } catch (const std::exception&) {
    }
    state_ = std::move(other.state_);
  }
  return *this;
}
Comm::Pending::~Pending() {
  try {
    wait();
  } catch (const std::exception&) {
  }
}

void Comm::Pending::wait() {
  if (!state_) return;
  auto state = std::move(state_);
  if (!state->work) return;
  wait_all(*state->impl, {state->work}, state->op, state->stage, state->start);
}

template <class Launch>
Comm::Pending Comm::start(const Impl& impl, std::string op, std::string_view stage,
                          Launch&& launch) {
  Pending pending;
  if (!impl.group) return pending;
  pending.state_ = std::make_unique<Pending::State>();
  auto& s = *pending.state_;
  s = {&impl, {}, std::move(op), std::string(stage), Clock::now()};
  guarded(impl.world.rank, s.op, stage, kPeerHint, [&] { s.work = launch(); });
  return pending;
}

Comm::Pending Comm::iall_reduce_sum(at::Tensor& tensor, std::string_view stage) {
  check_tensor(*impl_, tensor, "all_reduce", stage);
  return start(*impl_, "all_reduce", stage, [&] {
    std::vector<at::Tensor> one{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return impl_->group->allreduce(one, opts);
  });
}

Comm::Pending Comm::isend(const at::Tensor& tensor, int dst, int tag, std::string_view stage) {
  const std::string op = fmt::format("send to rank {}", dst);
  check_peer(*impl_, dst, op, stage);
  check_tensor(*impl_, tensor, op, stage);
  return start(*impl_, op, stage, [&] {
    std::vector<at::Tensor> one{tensor};
    return impl_->group->send(one, dst, tag);
  });
}

Comm::Pending Comm::irecv(at::Tensor& tensor, int src, int tag, std::string_view stage) {
  const std::string op = fmt::format("receive from rank {}", src);
  check_peer(*impl_, src, op, stage);
  check_tensor(*impl_, tensor, op, stage);
  return start(*impl_, op, stage, [&] {
    std::vector<at::Tensor> one{tensor};
    return impl_->group->recv(one, src, tag);
  });
}

void Comm::send(const at::Tensor& tensor, int dst, int tag, std::string_view stage) {
  isend(tensor, dst, tag, stage).wait();
}

void Comm::recv(at::Tensor& tensor, int src, int tag, std::string_view stage) {
  irecv(tensor, src, tag, stage).wait();
}

std::unique_ptr<Comm> Comm::subgroup(const std::vector<int>& ranks, const std::string& name,
                                     std::optional<std::chrono::milliseconds> timeout) {
  const auto me = std::find(ranks.begin(), ranks.end(), rank());
  if (me == ranks.end()) fail("rank {}: not a member of group '{}'", rank(), name);
  auto impl = std::make_unique<Impl>(*impl_);
  if (timeout) impl->options.timeout = *timeout;
  impl->world.rank = static_cast<int>(me - ranks.begin());
  impl->world.world_size = static_cast<int>(ranks.size());
  impl->group.reset();
  if (ranks.size() == 1) {
    impl->backend = "none";
    impl->store.reset();
    return std::unique_ptr<Comm>(new Comm(std::move(impl)));
  }
  // The members' own rendezvous, under a prefix of the job's store.
  impl->store = c10::make_intrusive<c10d::PrefixStore>(name, impl_->store);
  impl->group = make_group(*impl);
  return std::unique_ptr<Comm>(new Comm(std::move(impl)));
}

std::unique_ptr<Comm> consecutive_group(Comm& world, int size, const std::string& name,
                                        std::optional<std::chrono::milliseconds> timeout) {
  if (size < 1 || world.size() % size != 0) {
    fail("{}: groups of {} ranks do not divide the {} ranks", name, size, world.size());
  }
  const int first = world.rank() / size * size;
  std::vector<int> ranks(static_cast<size_t>(size));
  std::iota(ranks.begin(), ranks.end(), first);
  return world.subgroup(ranks, fmt::format("{}_{}", name, first / size), timeout);
}

}  // namespace dflash::dist
