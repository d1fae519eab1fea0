// obs: exclusive stage accounting of a thread, and the report's rules on hand-written figures.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/file.h"
#include "obs/report.h"
#include "obs/stages.h"
#include "obs/stats.h"
#include "test_util.h"

namespace dflash::obs {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

TEST(ObsStages, NamesRoundTrip) {
  for (size_t i = 0; i < kNumStages; ++i) {
    const auto stage = static_cast<Stage>(i);
    EXPECT_EQ(stage_from_name(stage_name(stage)), stage);
  }
  EXPECT_FALSE(stage_from_name("no_such_stage").has_value());
}

const json* thread_in(const json& snap, const std::string& name) {
  for (const auto& t : snap["threads"]) {
    if (t["name"] == name) return &t;
  }
  return nullptr;
}

// Time goes to the innermost open stage only; time in no stage is "unattributed"; the parts add
// up to the thread's wall time.
TEST(ObsStages, HostTimeIsExclusiveAndAddsUp) {
  configure({});
  std::thread worker([] {
    register_thread("obs-test");
    using std::chrono::milliseconds;
    std::this_thread::sleep_for(milliseconds(20));  // unattributed
    Scope outer(Stage::kBatchForming);
    std::this_thread::sleep_for(milliseconds(30));
    {
      Scope inner(Stage::kQueueWait);
      std::this_thread::sleep_for(milliseconds(60));
    }
  });
  worker.join();
  const json snap = snapshot(0);
  const json* t = thread_in(snap, "obs-test");
  ASSERT_NE(t, nullptr) << snap.dump();
  const json& st = (*t)["stages"];
  EXPECT_NEAR(st["unattributed"].get<double>(), 0.020, 0.015);
  EXPECT_NEAR(st["batch_forming"].get<double>(), 0.030, 0.015);
  EXPECT_NEAR(st["queue_wait"].get<double>(), 0.060, 0.015);
  const double sum = st["unattributed"].get<double>() + st["batch_forming"].get<double>() +
                     st["queue_wait"].get<double>();
  EXPECT_NEAR(sum, (*t)["wall_s"].get<double>(), 1e-9);
  // The OS view: every live thread of the process with its CPU time, this one included.
  bool self = false;
  for (const auto& os : snap["os_threads"]) {
    EXPECT_GE(os["cpu_s"].get<double>(), 0.0);
    self |= os["tid"].get<int64_t>() == static_cast<int64_t>(::gettid());
  }
  EXPECT_TRUE(self) << snap["os_threads"].dump();
}

// GPU time, like host time, goes to the innermost open stage: a target forward with an
// all-reduce scope inside it splits into the two, and they never overlap (issue 39).
TEST(ObsStages, GpuTimeGoesToTheInnermostStage) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  configure({});
  const at::Device cuda(at::kCUDA, 0);
  auto a = at::randn({2048, 2048}, at::TensorOptions(cuda));
  auto work = [&](int n) {
    for (int i = 0; i < n; ++i) a = at::tanh(a.matmul(a) * 1e-3);
  };
  for (int64_t step = 1; step <= 4; ++step) {
    begin_step(step, cuda);
    Scope forward(Stage::kTargetForward, cuda);
    work(4);
    {
      Scope reduce(Stage::kTargetAllReduce, cuda);
      work(4);
    }
    work(4);
  }
  begin_step(5, cuda);  // steps 1-4 end at this boundary
  synchronize(cuda);
  const json gpu = snapshot(5)["gpu"];
  const double forward = gpu["stages"].value("target_forward", 0.0);
  const double reduce = gpu["stages"].value("target_allreduce", 0.0);
  ASSERT_GT(forward, 0) << gpu.dump();
  ASSERT_GT(reduce, 0) << gpu.dump();
  // A third of the matmuls run inside the inner scope; the two add up to at most the wall.
  EXPECT_NEAR(reduce / (forward + reduce), 1.0 / 3, 0.1) << gpu.dump();
  EXPECT_LE(forward + reduce, gpu["wall_s"].get<double>() * 1.001) << gpu.dump();
}

// Two snapshots of one rank: a warm one and the last; stages in seconds of a 10 s window. With a
// `start` record, appended after it (a later start of the run) instead of replacing the file.
void write_rank(const fs::path& dir, int rank, const json& main_stages, const json& gpu_stages,
                int64_t items, double busy_percent = 99.0, const json& start = nullptr) {
  auto snap = [&](double t, double scale, int64_t n, bool warm) {
    json threads = json::array();
    json st = json::object();
    double wall = 0;
    for (const auto& [k, v] : main_stages.items()) {
      st[k] = v.get<double>() * scale;
      wall += v.get<double>() * scale;
    }
    threads.push_back({{"name", "main"}, {"tid", 100 + rank}, {"wall_s", wall}, {"stages", st}});
    json s = {{"step", n},
              {"items", n},
              {"t", t},
              {"threads", threads},
              {"os_threads",
               json::array({{{"tid", 100 + rank}, {"name", "dflash"}, {"cpu_s", 5 * scale}}})}};
    if (!gpu_stages.is_null()) {
      json g = json::object();
      double gw = 0;
      for (const auto& [k, v] : gpu_stages.items()) {
        g[k] = v.get<double>() * scale;
        gw += v.get<double>() * scale;
      }
      s["gpu"] = {{"device", rank},
                  {"wall_s", gw},
                  {"steps", n},
                  {"stages", g},
                  {"nvml_busy_sum", busy_percent * 10 * scale},
                  {"nvml_samples", 10 * scale}};
    }
    if (warm) s["warm"] = true;
    return s;
  };
  std::ofstream out(dir / fmt::format("rank-{}.jsonl", rank),
                    start.is_null() ? std::ios::trunc : std::ios::app);
  if (!start.is_null()) out << start.dump() << "\n";
  // Scale 1 at t=10 (warm), scale 2 at t=20: the window holds exactly one copy of the stages.
  out << snap(10, 1, items, true).dump() << "\n" << snap(20, 2, 2 * items, false).dump() << "\n";
}

TEST(ObsReport, NamesTheTargetSideAndBalancesADisaggregatedRun) {
  const fs::path run = testing::fresh_temp_dir("obs_report_disagg");
  fs::create_directories(run / "obs");
  write_file_atomic(
      run / "obs" / "job.json",
      json{{"topology", "disaggregated"}, {"ranks", 2}, {"trainer_ranks", 1}, {"accumulation", 1}}
          .dump());
  // Trainer: 10 s of GPU time, 4 s waiting for features, 6 s busy, 20 items -> 0.3 s per share.
  write_rank(run / "obs", 0, json{{"gpu_wait", 10.0}},
             json{{"recv_wait", 4.0}, {"drafter_forward", 3.0}, {"backward", 3.0}}, 20);
  // Target: 10 s, 7 in post_process, 3 in the forward, 20 items -> 0.5 s per share.
  write_rank(run / "obs", 1, json{{"post_process", 7.0}, {"target_forward", 3.0}},
             json{{"post_process", 7.0}, {"target_forward", 3.0}}, 20);
  const json a = analyze_run(run);
  EXPECT_EQ(a["bottleneck"]["kind"], "targets") << a["bottleneck"].dump();
  EXPECT_EQ(a["bottleneck"]["stage"], "post_process");
  EXPECT_NEAR(a["ranks"][0]["gpu"]["busy"].get<double>(), 0.99, 1e-9);
  EXPECT_NEAR(a["ranks"][0]["window_s"].get<double>(), 10.0, 1e-9);
  const json& b = a["balance"];
  EXPECT_NEAR(b["target_s_per_share"].get<double>(), 0.5, 1e-9);
  EXPECT_NEAR(b["trainer_s_per_share"].get<double>(), 0.3, 1e-9);
  EXPECT_NEAR(b["target_fraction"].get<double>(), 0.5 / 0.8, 1e-9);
  // 8 GPUs: x targets give min(x / 0.5, (8 - x) / 0.3) shares/s, best at x = 5.
  EXPECT_EQ(b["best_targets_of_8"], 5);
  EXPECT_NE(format_report(a).find("bottleneck: targets"), std::string::npos) << format_report(a);
  remove_tree(run);
}

// Disaggregated target groups (--target-tp 2): the balance counts a group of 2 ranks as the unit
// (x target GPUs in multiples of 2 deliver x / 2 / t shares a second), and the report prints
// the groups' all-reduce share of the target ranks' time.
TEST(ObsReport, CountsTargetGroupsAndNamesTheirAllReduce) {
  const fs::path run = testing::fresh_temp_dir("obs_report_groups");
  fs::create_directories(run / "obs");
  write_file_atomic(run / "obs" / "job.json", json{{"topology", "disaggregated"},
                                                   {"ranks", 4},
                                                   {"trainer_ranks", 2},
                                                   {"target_tp", 2},
                                                   {"accumulation", 1}}
                                                  .dump());
  // Trainers: 6 s busy of 10 for 20 shares -> 0.3 s a share.
  for (int rank : {0, 1}) {
    write_rank(run / "obs", rank, json{{"gpu_wait", 10.0}},
               json{{"recv_wait", 4.0}, {"drafter_forward", 3.0}, {"backward", 3.0}}, 20);
  }
  // The group's two ranks: 5 s busy of 10 (2 of it in the all-reduce) for 20 shares -> 0.25 s.
  for (int rank : {2, 3}) {
    write_rank(run / "obs", rank, json{{"send_wait", 10.0}},
               json{{"send_wait", 5.0}, {"target_forward", 3.0}, {"target_allreduce", 2.0}}, 20);
  }
  const json a = analyze_run(run);
  const json& b = a["balance"];
  EXPECT_EQ(b["target_group"], 2);
  EXPECT_NEAR(b["target_s_per_share"].get<double>(), 0.25, 1e-9);
  // Two GPUs of target per share: 2 x 0.25 against 0.3.
  EXPECT_NEAR(b["target_fraction"].get<double>(), 0.5 / 0.8, 1e-9);
  // 8 GPUs: x = 2, 4, 6 give min(x / 2 / 0.25, (8 - x) / 0.3) = 4, 8, 6.7 shares/s.
  EXPECT_EQ(b["best_targets_of_8"], 4);
  EXPECT_EQ(b["best_targets"], 2);
  const json& r = a["target_allreduce"];
  EXPECT_NEAR(r["share"].get<double>(), 0.2, 1e-9);
  EXPECT_NEAR(r["of_target"].get<double>(), 0.4, 1e-9);
  const std::string text = format_report(a);
  for (const char* line :
       {"target all-reduce: the tensor-parallel groups of 2 spend 20.0% of their ranks' time",
        "balance: a target group (2 ranks, tensor parallel) takes 250.0 ms per trainer share",
        "8 GPUs: 4 + 4, targets in groups of 2", "target_allreduce 20.0%"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }
  remove_tree(run);
}

TEST(ObsReport, NamesTheSlowestTrainerOfAColocatedRun) {
  const fs::path run = testing::fresh_temp_dir("obs_report_slow_rank");
  fs::create_directories(run / "obs");
  write_file_atomic(run / "obs" / "job.json",
                    json{{"topology", "colocated"}, {"ranks", 2}, {"trainer_ranks", 2}}.dump());
  write_rank(run / "obs", 0, json{{"drafter_forward", 2.0}, {"allreduce", 5.0}, {"backward", 3.0}},
             nullptr, 10);
  write_rank(run / "obs", 1, json{{"drafter_forward", 7.0}, {"allreduce", 0.2}, {"backward", 2.8}},
             nullptr, 10);
  const json a = analyze_run(run);
  EXPECT_EQ(a["bottleneck"]["kind"], "slow_rank") << a["bottleneck"].dump();
  EXPECT_EQ(a["bottleneck"]["rank"], 1);
  EXPECT_EQ(a["bottleneck"]["stage"], "drafter_forward");
  remove_tree(run);
}

// A short run whose final checkpoint is a third of the window: NVML's busy over the window is
// low, but the steps keep the GPU busy; the line says both, and it is not the host.
TEST(ObsReport, CheckpointsDoNotMakeAGpuBoundRunHostBound) {
  const fs::path run = testing::fresh_temp_dir("obs_report_checkpoint");
  fs::create_directories(run / "obs");
  write_file_atomic(run / "obs" / "job.json",
                    json{{"topology", "colocated"}, {"ranks", 1}, {"trainer_ranks", 1}}.dump());
  write_rank(run / "obs", 0, json{{"drafter_forward", 6.5}, {"gpu_wait", 0.3}, {"checkpoint", 3.2}},
             json{{"drafter_forward", 6.5}}, 10, /*busy_percent=*/66.0);
  const json a = analyze_run(run);
  EXPECT_EQ(a["bottleneck"]["kind"], "gpu") << a["bottleneck"].dump();
  EXPECT_NE(a["bottleneck"]["line"].get<std::string>().find(
                "busy 66% (97% outside checkpoints and evaluation, which take 32% of the window)"),
            std::string::npos)
      << a["bottleneck"].dump();
  remove_tree(run);
}

// A run of three starts: figures from before start records (start 0, one rank), a resume on two
// ranks that trained (start 1), a resume with nothing left to do (start 2, one rank). The report
// is of the newest that trained, with the job of that start, and lists them all; any start on
// request; one that is not there is refused naming those that are.
TEST(ObsReport, ReportsOneStartOfSeveralAndListsThem) {
  const fs::path run = testing::fresh_temp_dir("obs_report_starts");
  const fs::path obs = run / "obs";
  fs::create_directories(obs);
  EXPECT_EQ(next_start(obs), 1);
  write_file_atomic(obs / "job.json",
                    json{{"topology", "colocated"}, {"ranks", 1}, {"trainer_ranks", 1}}.dump());
  write_rank(obs, 0, json{{"drafter_forward", 9.0}, {"gpu_wait", 1.0}}, nullptr, 10);
  EXPECT_EQ(next_start(obs), 1);
  const json two = {{"topology", "colocated"}, {"ranks", 2}, {"trainer_ranks", 2}};
  const json resumed = {{"start", 1}, {"step", 10}, {"resumed", true}};
  record_job_start(obs, two, resumed);
  for (int rank : {0, 1}) {
    write_rank(obs, rank, json{{"drafter_forward", 2.0}, {"allreduce", 5.0}, {"backward", 3.0}},
               nullptr, 10, 99.0, resumed);
  }
  EXPECT_EQ(next_start(obs), 2);
  const json idle = {{"start", 2}, {"step", 20}, {"resumed", true}};
  record_job_start(obs, json{{"topology", "colocated"}, {"ranks", 1}, {"trainer_ranks", 1}}, idle);
  std::ofstream(obs / "rank-0.jsonl", std::ios::app) << idle.dump() << "\n"
                                                     << json{{"step", 20},
                                                             {"items", 0},
                                                             {"t", 5.0},
                                                             {"threads", json::array()},
                                                             {"os_threads", json::array()}}
                                                            .dump()
                                                     << "\n";
  const json job = json::parse(read_file(obs / "job.json"));
  EXPECT_EQ(job["ranks"], 1);
  EXPECT_EQ(job["start"], 2);
  ASSERT_EQ(job["starts"].size(), 3u);
  EXPECT_EQ(job["starts"][0]["start"], 0);  // the job.json from before start records
  EXPECT_EQ(job["starts"][1]["ranks"], 2);

  const json a = analyze_run(run);
  EXPECT_EQ(a["start"], 1);
  EXPECT_EQ(a["job"]["ranks"], 2);
  ASSERT_EQ(a["ranks"].size(), 2u);
  EXPECT_NEAR(a["ranks"][1]["window_s"].get<double>(), 10.0, 1e-9);
  ASSERT_EQ(a["starts"].size(), 3u);
  EXPECT_TRUE(a["starts"][0]["trained"].get<bool>());
  EXPECT_TRUE(a["starts"][1]["trained"].get<bool>());
  EXPECT_FALSE(a["starts"][2]["trained"].get<bool>());
  const std::string text = format_report(a);
  for (const char* line :
       {"starts: 3 in this run directory, the report is of start 1",
        "start 0 (written before start records): steps 10..20", "<- this report",
        "start 2 (resumed at step 20): no step trained", "rank 1 (trainer): steps 10..20"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }
  EXPECT_EQ(analyze_run(run, 0)["ranks"].size(), 1u);
  const json idle_report = analyze_run(run, 2);
  EXPECT_EQ(idle_report["ranks"][0]["from_step"], 20);
  EXPECT_EQ(idle_report["ranks"][0]["window_s"], 0.0);
  try {
    analyze_run(run, 5);
    ADD_FAILURE() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("no figures of start 5 (the run has starts 0, 1, 2)"),
              std::string::npos)
        << e.what();
  }
  remove_tree(run);
}

TEST(ObsReport, MissingFilesNameThePath) {
  const fs::path run = testing::fresh_temp_dir("obs_report_missing");
  try {
    analyze_run(run);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("job.json"), std::string::npos) << e.what();
  }
  remove_tree(run);
}

}  // namespace
}  // namespace dflash::obs
