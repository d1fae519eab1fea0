// dist, in one process: the rank variables of torchrun, Slurm and a plain run (and their bad
// values), the device choice, the --nproc-per-node option, and a one-rank Comm. The
// multi-process tests are tests/dist/.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "common/error.h"
#include "dist/comm.h"
#include "dist/launch.h"
#include "dist/world.h"

namespace dflash {
namespace {

using dist::World;

// Sets exactly the rank-related variables given (clearing the others) and restores the
// originals when done.
class RankEnv {
 public:
  explicit RankEnv(const std::map<std::string, std::string>& values) {
    for (const char* name : kNames) {
      const char* old = std::getenv(name);
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      ::unsetenv(name);
    }
    for (const auto& [name, value] : values) ::setenv(name.c_str(), value.c_str(), 1);
  }
  ~RankEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }

 private:
  static constexpr const char* kNames[] = {"RANK",
                                           "WORLD_SIZE",
                                           "LOCAL_RANK",
                                           "LOCAL_WORLD_SIZE",
                                           "MASTER_ADDR",
                                           "MASTER_PORT",
                                           "SLURM_PROCID",
                                           "SLURM_NTASKS",
                                           "SLURM_LOCALID",
                                           "SLURM_NTASKS_PER_NODE",
                                           "SLURM_TASKS_PER_NODE",
                                           "SLURM_NODEID",
                                           "DFLASH_LAUNCHED"};
  std::map<std::string, std::optional<std::string>> saved_;
};

std::string error_of(const std::map<std::string, std::string>& values) {
  RankEnv env(values);
  try {
    dist::world_from_env();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

const std::map<std::string, std::string> kTorchrun = {{"RANK", "5"},
                                                      {"WORLD_SIZE", "8"},
                                                      {"LOCAL_RANK", "1"},
                                                      {"LOCAL_WORLD_SIZE", "4"},
                                                      {"MASTER_ADDR", "node07"},
                                                      {"MASTER_PORT", "29611"}};

const std::map<std::string, std::string> kSlurm = {
    {"SLURM_PROCID", "6"},          {"SLURM_NTASKS", "8"},     {"SLURM_LOCALID", "2"},
    {"SLURM_NTASKS_PER_NODE", "4"}, {"MASTER_ADDR", "gpu-a1"}, {"MASTER_PORT", "29400"}};

std::map<std::string, std::string> with(std::map<std::string, std::string> base,
                                        const std::map<std::string, std::string>& changes) {
  for (const auto& [name, value] : changes) base[name] = value;
  return base;
}

std::map<std::string, std::string> without(std::map<std::string, std::string> base,
                                           const std::string& name) {
  base.erase(name);
  return base;
}

TEST(DistWorld, SingleProcessWithoutVariables) {
  RankEnv env({});
  const World w = dist::world_from_env();
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.world_size, 1);
  EXPECT_EQ(w.local_rank, 0);
  EXPECT_EQ(w.local_world_size, 1);
  EXPECT_EQ(w.launcher, "single");
}

TEST(DistWorld, Torchrun) {
  RankEnv env(kTorchrun);
  const World w = dist::world_from_env();
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.master_addr, "node07");
  EXPECT_EQ(w.master_port, 29611);
  EXPECT_EQ(w.launcher, "torchrun");
}

TEST(DistWorld, OwnLauncherIsNamed) {
  RankEnv env(with(kTorchrun, {{"DFLASH_LAUNCHED", "1"}}));
  EXPECT_EQ(dist::world_from_env().launcher, "local");
}

TEST(DistWorld, TorchrunWinsOverSlurm) {
  auto both = kSlurm;
  for (const auto& [name, value] : kTorchrun) both[name] = value;
  RankEnv env(both);
  const World w = dist::world_from_env();
  EXPECT_EQ(w.launcher, "torchrun");
  EXPECT_EQ(w.rank, 5);
}

TEST(DistWorld, Slurm) {
  RankEnv env(kSlurm);
  const World w = dist::world_from_env();
  EXPECT_EQ(w.rank, 6);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_rank, 2);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.master_addr, "gpu-a1");
  EXPECT_EQ(w.master_port, 29400);
  EXPECT_EQ(w.launcher, "slurm");
}

TEST(DistWorld, SlurmTasksPerNodeCompressedForm) {
  // Three nodes with 4 tasks then one with 2; this is node 3 (the one with 2).
  auto vars = without(kSlurm, "SLURM_NTASKS_PER_NODE");
  vars = with(vars, {{"SLURM_TASKS_PER_NODE", "4(x3),2"},
                     {"SLURM_NTASKS", "14"},
                     {"SLURM_PROCID", "13"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_NODEID", "3"}});
  {
    RankEnv env(vars);
    const World w = dist::world_from_env();
    EXPECT_EQ(w.local_world_size, 2);
    EXPECT_EQ(w.rank, 13);
  }
  {
    RankEnv env(without(with(vars, {{"SLURM_PROCID", "0"}}), "SLURM_NODEID"));
    EXPECT_EQ(dist::world_from_env().local_world_size, 4);  // first entry without a node id
  }
  EXPECT_NE(error_of(with(vars, {{"SLURM_NODEID", "4"}})).find("no entry for SLURM_NODEID=4"),
            std::string::npos);
  EXPECT_NE(error_of(with(vars, {{"SLURM_TASKS_PER_NODE", "4(x3"}})).find("SLURM_TASKS_PER_NODE"),
            std::string::npos);
}

TEST(DistWorld, SlurmWithoutMasterAddrExplainsTheExport) {
  const std::string e = error_of(without(kSlurm, "MASTER_ADDR"));
  EXPECT_NE(e.find("MASTER_ADDR is not set"), std::string::npos) << e;
  EXPECT_NE(e.find("scontrol show hostnames"), std::string::npos) << e;
  EXPECT_NE(error_of(without(kSlurm, "MASTER_PORT")).find("MASTER_PORT is not set"),
            std::string::npos);
}

TEST(DistWorld, BadValuesNameTheVariable) {
  struct Case {
    std::map<std::string, std::string> vars;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {with(kTorchrun, {{"RANK", "five"}}), "RANK='five' is not an integer"},
      {with(kTorchrun, {{"WORLD_SIZE", "8x"}}), "WORLD_SIZE='8x' is not an integer"},
      {with(kTorchrun, {{"LOCAL_RANK", ""}}), "LOCAL_RANK='' is not an integer"},
      {with(kTorchrun, {{"RANK", "8"}}), "RANK=8 is outside the world of WORLD_SIZE=8 ranks"},
      {with(kTorchrun, {{"RANK", "-1"}}), "RANK=-1 is outside the world"},
      {with(kTorchrun, {{"WORLD_SIZE", "0"}, {"RANK", "0"}}), "WORLD_SIZE=0 must be at least 1"},
      {with(kTorchrun, {{"LOCAL_RANK", "4"}}), "LOCAL_RANK=4 is outside the LOCAL_WORLD_SIZE=4"},
      {with(kTorchrun, {{"LOCAL_WORLD_SIZE", "9"}}), "LOCAL_WORLD_SIZE=9 must be between 1 and"},
      {with(kTorchrun, {{"MASTER_PORT", "http"}}), "MASTER_PORT='http' is not an integer"},
      {with(kTorchrun, {{"MASTER_PORT", "70000"}}), "MASTER_PORT=70000 is not a TCP port"},
      {without(kTorchrun, "LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE is not set"},
      {without(kTorchrun, "RANK"), "RANK is not set"},
      {without(kTorchrun, "MASTER_ADDR"), "MASTER_ADDR is not set"},
      {with(kSlurm, {{"SLURM_PROCID", "x"}}), "SLURM_PROCID='x' is not an integer"},
      {with(kSlurm, {{"SLURM_PROCID", "8"}}), "SLURM_PROCID=8 is outside the world of"},
      {with(kSlurm, {{"SLURM_LOCALID", "4"}}), "SLURM_LOCALID=4 is outside the"},
      {without(kSlurm, "SLURM_LOCALID"), "SLURM_LOCALID is not set"},
      {without(kSlurm, "SLURM_NTASKS_PER_NODE"), "neither SLURM_NTASKS_PER_NODE nor"},
  };
  for (const auto& c : cases) {
    const std::string e = error_of(c.vars);
    EXPECT_NE(e.find(c.expected), std::string::npos) << "expected '" << c.expected << "' in: " << e;
  }
}

TEST(DistWorld, OneRankNeedsNoMaster) {
  RankEnv env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}});
  EXPECT_EQ(dist::world_from_env().world_size, 1);
}

TEST(DistWorld, DeviceFor) {
  World w;
  w.local_rank = 0;
  EXPECT_EQ(dist::device_for(w, "cpu"), at::Device(at::kCPU));
  EXPECT_EQ(dist::device_for(w, "cuda:3"), at::Device(at::kCUDA, 3));
  if (at::hasCUDA()) {
    EXPECT_EQ(dist::device_for(w, "auto"), at::Device(at::kCUDA, 0));
    EXPECT_EQ(dist::device_for(w, "cuda"), at::Device(at::kCUDA, 0));
    w.local_rank = 1000;
    EXPECT_THROW(dist::device_for(w, "cuda"), Error);
  } else {
    EXPECT_EQ(dist::device_for(w, "auto"), at::Device(at::kCPU));
    EXPECT_THROW(dist::device_for(w, "cuda"), Error);
  }
  EXPECT_THROW(dist::device_for(w, "gpu"), Error);
}

TEST(DistLaunchOption, TakesAndRemovesTheOption) {
  std::vector<std::string> a = {"dflash", "--nproc-per-node", "4", "train", "--steps", "3"};
  EXPECT_EQ(dist::take_nproc_option(a), 4);
  EXPECT_EQ(a, (std::vector<std::string>{"dflash", "train", "--steps", "3"}));

  std::vector<std::string> b = {"dflash", "train", "--nproc-per-node=2", "--steps", "3"};
  EXPECT_EQ(dist::take_nproc_option(b), 2);
  EXPECT_EQ(b, (std::vector<std::string>{"dflash", "train", "--steps", "3"}));

  std::vector<std::string> none = {"dflash", "train", "--", "--nproc-per-node", "2"};
  EXPECT_EQ(dist::take_nproc_option(none), std::nullopt);
  EXPECT_EQ(none.size(), 5u);

  for (std::vector<std::string> bad :
       std::vector<std::vector<std::string>>{{"dflash", "--nproc-per-node"},
                                             {"dflash", "--nproc-per-node", "0"},
                                             {"dflash", "--nproc-per-node", "two"},
                                             {"dflash", "--nproc-per-node="},
                                             {"dflash", "--nproc-per-node=-1"}}) {
    EXPECT_THROW(dist::take_nproc_option(bad), Error) << bad.back();
  }
}

TEST(DistComm, OneRankIsLocal) {
  World w;
  auto comm = dist::Comm::create(w, at::Device(at::kCPU));
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->backend(), "none");
  std::vector<at::Tensor> t = {at::arange(4, at::kFloat), at::ones({2, 2}, at::kLong)};
  comm->all_reduce_sum(t, "one_rank");
  EXPECT_TRUE(at::equal(t[0], at::arange(4, at::kFloat)));
  EXPECT_TRUE(at::equal(t[1], at::ones({2, 2}, at::kLong)));
  comm->broadcast(t, 0, "one_rank");
  comm->barrier("one_rank");
  EXPECT_EQ(comm->all_gather_int64({3, 1, 4}, "one_rank"),
            (std::vector<std::vector<int64_t>>{{3, 1, 4}}));
  // Misuse is caught even without peers, so a single-GPU run finds it too.
  std::vector<at::Tensor> strided = {at::ones({4, 4}).t()};
  EXPECT_THROW(comm->all_reduce_sum(strided, "one_rank"), Error);
  EXPECT_THROW(comm->broadcast(t, 1, "one_rank"), Error);
  EXPECT_THROW(comm->isend(t[0], 0, 0, "one_rank"), Error);
  EXPECT_THROW(dist::Comm::create(w, at::Device(at::kCPU), {.backend = "mpi"}), Error);
}

}  // namespace
}  // namespace dflash
