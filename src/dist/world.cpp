#include "dist/world.h"

#include <ATen/Context.h>

#include <charconv>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace dflash::dist {
namespace {

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

int parse_int(std::string_view text, std::string_view what) {
  int value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end) {
    fail("{}='{}' is not an integer", what, text);
  }
  return value;
}

int int_env(const char* name) {
  auto value = env(name);
  if (!value) fail("{} is not set (it is needed with the other rank variables)", name);
  return parse_int(*value, name);
}

// Slurm writes tasks per node compressed, one entry per node in node order: "2(x3),1" means
// three nodes with 2 tasks then one node with 1.
int tasks_on_node(const std::string& text, int node) {
  std::vector<int> per_node;
  std::string_view rest = text;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view entry = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    int repeat = 1;
    if (const size_t paren = entry.find("(x"); paren != std::string_view::npos) {
      if (entry.back() != ')') fail("SLURM_TASKS_PER_NODE='{}' is malformed", text);
      repeat = parse_int(entry.substr(paren + 2, entry.size() - paren - 3), "SLURM_TASKS_PER_NODE");
      entry = entry.substr(0, paren);
    }
    const int tasks = parse_int(entry, "SLURM_TASKS_PER_NODE");
    for (int i = 0; i < repeat; ++i) per_node.push_back(tasks);
  }
  if (node < 0 || node >= static_cast<int>(per_node.size())) {
    fail("SLURM_TASKS_PER_NODE='{}' has no entry for SLURM_NODEID={}", text, node);
  }
  return per_node[node];
}

void read_master(World& world, std::string_view launcher_hint) {
  auto addr = env("MASTER_ADDR");
  auto port = env("MASTER_PORT");
  if (world.world_size > 1 && (!addr || !port)) {
    fail("{} is not set: with {} ranks, every rank must know where rank 0 serves the rendezvous{}",
         addr ? "MASTER_PORT" : "MASTER_ADDR", world.world_size, launcher_hint);
  }
  if (addr) {
    if (addr->empty()) fail("MASTER_ADDR is empty");
    world.master_addr = *addr;
  }
  if (port) {
    world.master_port = parse_int(*port, "MASTER_PORT");
    if (world.master_port < 1 || world.master_port > 65535) {
      fail("MASTER_PORT={} is not a TCP port (1..65535)", world.master_port);
    }
  }
}

void check(const World& w, const char* rank_var, const char* size_var, const char* local_var,
           const char* local_size_var) {
  if (w.world_size < 1) fail("{}={} must be at least 1", size_var, w.world_size);
  if (w.rank < 0 || w.rank >= w.world_size) {
    fail("{}={} is outside the world of {}={} ranks", rank_var, w.rank, size_var, w.world_size);
  }
  if (w.local_world_size < 1 || w.local_world_size > w.world_size) {
    fail("{}={} must be between 1 and {}={}", local_size_var, w.local_world_size, size_var,
         w.world_size);
  }
  if (w.local_rank < 0 || w.local_rank >= w.local_world_size) {
    fail("{}={} is outside the {}={} ranks of this node", local_var, w.local_rank, local_size_var,
         w.local_world_size);
  }
}

}  // namespace

World world_from_env() {
  World world;
  if (env("RANK") || env("WORLD_SIZE")) {
    world.launcher = env("DFLASH_LAUNCHED") ? "local" : "torchrun";
    world.rank = int_env("RANK");
    world.world_size = int_env("WORLD_SIZE");
    world.local_rank = int_env("LOCAL_RANK");
    world.local_world_size = int_env("LOCAL_WORLD_SIZE");
    check(world, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    read_master(world, "");
    return world;
  }
  if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    world.launcher = "slurm";
    world.rank = int_env("SLURM_PROCID");
    world.world_size = int_env("SLURM_NTASKS");
    world.local_rank = int_env("SLURM_LOCALID");
    const char* local_size_var = "SLURM_NTASKS_PER_NODE";
    if (env("SLURM_NTASKS_PER_NODE")) {
      world.local_world_size = int_env("SLURM_NTASKS_PER_NODE");
    } else if (auto per_node = env("SLURM_TASKS_PER_NODE")) {
      local_size_var = "SLURM_TASKS_PER_NODE";
      const int node = env("SLURM_NODEID") ? int_env("SLURM_NODEID") : 0;
      world.local_world_size = tasks_on_node(*per_node, node);
    } else {
      fail("neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set");
    }
    check(world, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_size_var);
    read_master(world,
                " (an srun script must export MASTER_ADDR, e.g. the first of `scontrol show "
                "hostnames $SLURM_JOB_NODELIST`, and MASTER_PORT)");
    return world;
  }
  return world;
}

at::Device device_for(const World& world, const std::string& requested) {
  if (requested == "auto" || requested == "cuda") {
    if (!at::hasCUDA()) {
      if (requested == "auto") return at::Device(at::kCPU);
      fail("device 'cuda' requested but this process sees no CUDA device");
    }
    const int count = static_cast<int>(at::getNumGPUs());
    if (world.local_rank >= count) {
      fail("LOCAL_RANK={} needs GPU {} but this process sees only {} (CUDA_VISIBLE_DEVICES?)",
           world.local_rank, world.local_rank, count);
    }
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank));
  }
  try {
    return at::Device(requested);
  } catch (const c10::Error&) {
    fail("device '{}' is not one of auto, cpu, cuda, cuda:N", requested);
  }
}

}  // namespace dflash::dist
