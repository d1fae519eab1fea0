// dist: collectives and point-to-point transfers between ranks through PyTorch's c10d (TCPStore
// rendezvous, ProcessGroupGloo on the CPU, ProcessGroupNCCL on CUDA). The c10d headers stay in
// comm.cpp: they are heavy to compile.
#pragma once
#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dist/world.h"

namespace dflash::dist {

struct CommOptions {
  std::string backend = "auto";  // "auto": nccl for a cuda device, gloo for cpu; or "gloo", "nccl"
  // Bounds the rendezvous (connecting to rank 0's store, every rank joining) and every operation;
  // past it the operation throws (Gloo) or the NCCL watchdog takes the process down.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

// Every operation names a `stage` ("grad_all_reduce", "config_check") that appears in its error
// message. Failures (a c10d error, a timeout, a dead peer) throw dflash::Error: "rank 1:
// all_reduce in stage 'grad_all_reduce' failed after 5.0 s: <c10d message> (a peer rank may have
// died; see its log)". Collectives must be called by every rank in the same order.
class Comm {
 public:
  struct Impl;

  // Rendezvous through a c10d::TCPStore at world.master_addr:master_port (rank 0 hosts it), then
  // the process group. With one rank there is no store and every operation is a local no-op.
  // For a CUDA device this makes it the current device.
  static std::unique_ptr<Comm> create(const World& world, at::Device device,
                                      CommOptions options = {});
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // A group of some of this group's ranks (`ranks` in this group's numbering; this rank must
  // be one), with its own process group: e.g. the trainer ranks of a disaggregated job. Only
  // the members call it, in the same order everywhere. `timeout` bounds the group's operations
  // (default: this group's), e.g. a tensor-parallel group's per-step collectives far tighter
  // than a world whose closing barrier waits for ranks that finish hours apart.
  std::unique_ptr<Comm> subgroup(const std::vector<int>& ranks, const std::string& name,
                                 std::optional<std::chrono::milliseconds> timeout = {});

  int rank() const;
  int size() const;
  const std::string& backend() const;  // "gloo", "nccl", or "none" for one rank
  at::Device device() const;

  // In place, each tensor summed over ranks (tensors may differ in shape and dtype; all must be
  // contiguous and on this Comm's device). Returns when done; for NCCL "done" means enqueued on
  // the current CUDA stream (no host synchronisation), as work.wait() in PyTorch.
  void all_reduce_sum(std::vector<at::Tensor>& tensors, std::string_view stage);
  void all_reduce_sum(at::Tensor& tensor, std::string_view stage);
  // Every rank's tensors become root's.
  void broadcast(std::vector<at::Tensor>& tensors, int root, std::string_view stage);
  void barrier(std::string_view stage);

  // Every rank's `local` (contiguous, of the same shape and dtype on every rank), indexed by
  // rank: e.g. the vocabulary slices of a tensor-parallel LM head's logits.
  std::vector<at::Tensor> all_gather(const at::Tensor& local, std::string_view stage);
  // Every rank's `local` (its length may differ between ranks), indexed by rank. For checks that
  // all ranks agree (a config hash), not for bulk data.
  std::vector<std::vector<int64_t>> all_gather_int64(const std::vector<int64_t>& local,
                                                     std::string_view stage);

  // A point-to-point transfer in flight; wait() returns when it is done and throws as the
  // blocking operations do. Destroying one that was not waited on waits (and swallows errors).
  class Pending {
   public:
    Pending();
    Pending(Pending&&) noexcept;
    Pending& operator=(Pending&&) noexcept;
    ~Pending();
    void wait();

   private:
    friend class Comm;
    struct State;
    std::unique_ptr<State> state_;
  };
  // All-reduce (sum) of one contiguous tensor, in flight: for overlapping a reduction with
  // other work (gradient buckets during the backward). Every rank starts the same sequence.
  Pending iall_reduce_sum(at::Tensor& tensor, std::string_view stage);
  // One contiguous tensor each; a matching isend/irecv pair has the same tag. NCCL ignores tags
  // (transfers between two ranks match in issue order) and a send holds its stream until the
  // peer receives, so two ranks must not both send to each other first.
  Pending isend(const at::Tensor& tensor, int dst, int tag, std::string_view stage);
  Pending irecv(at::Tensor& tensor, int src, int tag, std::string_view stage);
  void send(const at::Tensor& tensor, int dst, int tag, std::string_view stage);
  void recv(at::Tensor& tensor, int src, int tag, std::string_view stage);

 private:
  explicit Comm(std::unique_ptr<Impl> impl);
  // A point-to-point or collective operation started by `launch` (which returns its c10d
  // work), wrapped with the messages of `op` in `stage`; an empty Pending for one rank.
  template <class Launch>
  static Pending start(const Impl& impl, std::string op, std::string_view stage, Launch&& launch);
  std::unique_ptr<Impl> impl_;
};

// The group of `size` consecutive ranks of `world` that this rank belongs to, a subgroup named
// `name`_k for the k-th (--target-tp's tensor-parallel groups); `size` must divide the world.
std::unique_ptr<Comm> consecutive_group(Comm& world, int size, const std::string& name,
                                        std::optional<std::chrono::milliseconds> timeout = {});

}  // namespace dflash::dist
