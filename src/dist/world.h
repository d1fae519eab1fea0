// dist: where this process sits among the ranks of a run (from torchrun's, Slurm's or our own
// launcher's environment) and which device it drives.
#pragma once
#include <c10/core/Device.h>

#include <string>

namespace dflash::dist {

struct World {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // rank among the processes on this node; picks the GPU
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";  // host of rank 0, which serves the rendezvous store
  int master_port = 29500;
  // Where the values came from: "torchrun", "local" (dflash --nproc-per-node), "slurm", "single".
  std::string launcher = "single";
};

// Reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), which `dflash --nproc-per-node` also sets; without RANK, an srun step's
// (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE)
// with MASTER_ADDR and MASTER_PORT, which the srun script must export; otherwise one process.
// A missing or malformed variable, or a rank outside its world, throws dflash::Error naming it.
World world_from_env();

// "auto": cuda:LOCAL_RANK when CUDA is available, else cpu; "cuda": cuda:LOCAL_RANK; anything
// with an explicit index ("cuda:3") or "cpu" is kept as given.
at::Device device_for(const World& world, const std::string& requested);
// What a --device option accepts, for its help.
inline constexpr const char* kDeviceHelp =
    "auto (cuda:LOCAL_RANK when there is a GPU, else cpu), cpu, cuda or cuda:N";

}  // namespace dflash::dist
