#include "obs/report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"

namespace dflash::obs {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Shares below this are noise for the bottleneck rules.
constexpr double kWaitThreshold = 0.10;
// Checkpoints and evaluations above this share of the window are named beside the GPU's busy %.
constexpr double kPauseNote = 0.05;

// One start's part of a rank file: its record (null for figures from before start records)
// and its snapshots.
struct StartFigures {
  int64_t start = 0;
  json record;
  std::vector<json> snapshots;
};

std::vector<StartFigures> read_starts(const fs::path& path) {
  std::vector<StartFigures> out;
  std::istringstream in(read_file(path));
  std::string line;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;  // a line cut short by a kill
    if (j.contains("start") && j["start"].is_number_integer()) {
      out.push_back({j["start"].get<int64_t>(), j, {}});
    } else if (j.contains("t")) {
      if (out.empty()) out.push_back({0, nullptr, {}});
      out.back().snapshots.push_back(std::move(j));
    }
  }
  return out;
}

const StartFigures* find_start(const std::vector<StartFigures>& starts, int64_t index) {
  for (const auto& s : starts) {
    if (s.start == index && !s.snapshots.empty()) return &s;
  }
  return nullptr;
}

fs::path rank_file(const fs::path& dir, int rank) {
  return dir / fmt::format("rank-{}.jsonl", rank);
}

// job.json as the starts' bookkeeping reads it: a file cut short by a crash is no reason to
// refuse a run (the report, which needs it, names it).
json read_job(const fs::path& path) {
  if (!fs::exists(path)) return json::object();
  json job = json::parse(read_file(path), nullptr, /*allow_exceptions=*/false);
  return job.is_object() ? job : json::object();
}

double num(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0.0;
}

// last - first of a {stage: seconds} object (first may lack a stage).
std::map<std::string, double> stage_delta(const json& last, const json* first) {
  std::map<std::string, double> out;
  for (const auto& [k, v] : last.items()) {
    double before = 0;
    if (first && first->contains(k)) before = (*first)[k].get<double>();
    out[k] = v.get<double>() - before;
  }
  return out;
}

const json* find_by_tid(const json& list, int64_t tid) {
  for (const auto& t : list) {
    if (t.value("tid", int64_t{-1}) == tid) return &t;
  }
  return nullptr;
}

json shares(const std::map<std::string, double>& seconds, double total) {
  json out = json::object();
  for (const auto& [k, v] : seconds) {
    if (total > 0 && v > 0) out[k] = v / total;
  }
  return out;
}

double share(const json& shares, const char* stage) {
  return shares.contains(stage) ? shares[stage].get<double>() : 0.0;
}

// The stage with the largest share (ignoring `skip`), as (name, share).
std::pair<std::string, double> top_stage(const json& shares,
                                         const std::vector<std::string>& skip = {}) {
  std::pair<std::string, double> best{"", 0};
  for (const auto& [k, v] : shares.items()) {
    if (k == "unattributed" || std::find(skip.begin(), skip.end(), k) != skip.end()) continue;
    if (v.get<double>() > best.second) best = {k, v.get<double>()};
  }
  return best;
}

// `start_step`: the step the start began at (the first figures may come later).
json analyze_rank(int rank, const std::vector<json>& snaps, int64_t start_step) {
  const json& last = snaps.back();
  const json* first = nullptr;
  for (const auto& s : snaps) {
    if (&s != &last && s.value("warm", false)) {
      first = &s;
      break;
    }
  }
  if (!first && snaps.size() > 1) first = &snaps.front();
  json r = {{"rank", rank}, {"step", last.value("step", int64_t{0})}};
  const double window = first ? num(last, "t") - num(*first, "t") : 0.0;
  r["window_s"] = window;
  r["from_step"] = first ? first->value("step", int64_t{0}) : start_step;
  // Registered threads: their split of wall time by stage.
  json threads = json::array();
  for (const auto& t : last["threads"]) {
    const int64_t tid = t.value("tid", int64_t{-1});
    const json* before = first ? find_by_tid((*first)["threads"], tid) : nullptr;
    const double wall = num(t, "wall_s") - (before ? num(*before, "wall_s") : 0.0);
    const auto split = stage_delta(t["stages"], before ? &(*before)["stages"] : nullptr);
    json entry = {{"name", t["name"]}, {"tid", tid}, {"wall_s", wall}};
    entry["stages"] = shares(split, wall);
    const auto outside = split.find("unattributed");
    entry["attributed"] =
        wall > 0 ? 1.0 - (outside == split.end() ? 0.0 : outside->second) / wall : 0.0;
    threads.push_back(std::move(entry));
  }
  // Every OS thread's CPU over the window.
  double cores = 0;
  json other = json::array();
  for (const auto& t : last["os_threads"]) {
    const int64_t tid = t.value("tid", int64_t{-1});
    const json* before = first ? find_by_tid((*first)["os_threads"], tid) : nullptr;
    const double cpu = num(t, "cpu_s") - (before ? num(*before, "cpu_s") : 0.0);
    const double frac = window > 0 ? cpu / window : 0.0;
    cores += frac;
    bool registered = false;
    for (auto& th : threads) {
      if (th["tid"] == tid) {
        th["cpu"] = frac;
        registered = true;
      }
    }
    if (!registered && frac >= 0.005) other.push_back({{"name", t["name"]}, {"cpu", frac}});
  }
  std::sort(other.begin(), other.end(),
            [](const json& a, const json& b) { return a["cpu"] > b["cpu"]; });
  r["threads"] = std::move(threads);
  r["other_threads"] = std::move(other);
  r["cpu_cores"] = cores;
  if (last.contains("gpu")) {
    const json& g = last["gpu"];
    const json* gb = first && first->contains("gpu") ? &(*first)["gpu"] : nullptr;
    const double wall = num(g, "wall_s") - (gb ? num(*gb, "wall_s") : 0.0);
    const auto split = stage_delta(g["stages"], gb ? &(*gb)["stages"] : nullptr);
    double in_stages = 0;
    for (const auto& [k, v] : split) in_stages += v;
    json gpu = {{"device", g["device"]},
                {"wall_s", wall},
                {"stages", shares(split, wall)},
                {"attributed", wall > 0 ? std::min(in_stages / wall, 1.0) : 0.0}};
    const double samples = num(g, "nvml_samples") - (gb ? num(*gb, "nvml_samples") : 0.0);
    if (samples > 0) {
      gpu["busy"] =
          (num(g, "nvml_busy_sum") - (gb ? num(*gb, "nvml_busy_sum") : 0.0)) / samples / 100.0;
    }
    if (g.contains("device_memory_used")) {
      gpu["memory_used_gib"] = num(g, "device_memory_used") / (1 << 30);
    }
    r["gpu"] = std::move(gpu);
    r["timeline"] = r["gpu"]["stages"];
  } else {
    // On the CPU the main thread runs the compute: its split is the rank's timeline.
    r["timeline"] = r["threads"].empty() ? json::object() : r["threads"][0]["stages"];
  }
  r["items"] = last.value("items", int64_t{0}) - (first ? first->value("items", int64_t{0}) : 0);
  return r;
}

const json* thread_named(const json& rank, std::string_view name) {
  for (const auto& t : rank["threads"]) {
    if (t["name"].get<std::string>() == name) return &t;
  }
  return nullptr;
}

// The bottleneck, in the order a user would fix things: data starving a trainer, one side of a
// disaggregated job starving the other, one slow rank holding the all-reduce, then the host or
// the device itself.
json find_bottleneck(const json& job, const json& ranks) {
  const int trainers = job.value("trainer_ranks", 1);
  const bool disaggregated = job.value("topology", std::string("colocated")) == "disaggregated";
  auto role = [&](const json& r) { return r["rank"].get<int>() < trainers ? "trainer" : "target"; };
  // 1. Data: a consumer waits on the batch queue while the forming thread is busy.
  for (const auto& r : ranks) {
    const json* main = thread_named(r, "main");
    const json* forming = thread_named(r, "dflash-batches");
    if (!main || !forming) continue;
    const double wait = share(main->at("stages"), "queue_wait");
    const double busy = share(forming->at("stages"), "batch_forming");
    if (wait >= kWaitThreshold && busy >= 0.5) {
      return {{"kind", "data"},
              {"rank", r["rank"]},
              {"stage", "batch_forming"},
              {"line", fmt::format("data: rank {} ({}) waits {:.0f}% of its time for micro-batches "
                                   "while its batch-forming thread is busy {:.0f}%: forming "
                                   "batches (anchors, blocks, packing) is the bottleneck",
                                   r["rank"].get<int>(), role(r), 100 * wait, 100 * busy)}};
    }
  }
  if (disaggregated) {
    double recv = 0, send = 0;
    int nr = 0, ns = 0;
    for (const auto& r : ranks) {
      if (std::string(role(r)) == "trainer") {
        recv += share(r["timeline"], "recv_wait");
        ++nr;
      } else {
        send += share(r["timeline"], "send_wait");
        ++ns;
      }
    }
    recv /= std::max(nr, 1);
    send /= std::max(ns, 1);
    if (recv >= kWaitThreshold && recv >= send) {
      // Name what the target ranks spend their time on.
      std::map<std::string, double> sum;
      for (const auto& r : ranks) {
        if (std::string(role(r)) != "target") continue;
        for (const auto& [k, v] : r["timeline"].items()) sum[k] += v.get<double>();
      }
      json avg = json::object();
      for (const auto& [k, v] : sum) avg[k] = v / std::max(ns, 1);
      const auto [stage, frac] = top_stage(avg, {"send_wait", "queue_wait"});
      return {{"kind", "targets"},
              {"rank", trainers},
              {"stage", stage},
              {"line", fmt::format("targets: trainer ranks wait {:.0f}% of their time on target "
                                   "features (target ranks spend {:.0f}% in {}): add target ranks "
                                   "or move to colocated",
                                   100 * recv, 100 * frac, stage)}};
    }
    if (send >= kWaitThreshold) {
      const auto [stage, frac] = top_stage(ranks[0]["timeline"], {"recv_wait", "queue_wait"});
      return {{"kind", "trainers"},
              {"rank", 0},
              {"stage", stage},
              {"line", fmt::format("trainers: target ranks wait {:.0f}% of their time for trainer "
                                   "ranks to take their features (trainers spend {:.0f}% in {}): "
                                   "add trainer ranks",
                                   100 * send, 100 * frac, stage)}};
    }
  }
  // 3. One trainer slower than the rest: the others wait for it in the all-reduce.
  if (trainers > 1) {
    int slow = -1, fast = -1;
    double least = 2, most = -1;
    for (const auto& r : ranks) {
      if (std::string(role(r)) != "trainer") continue;
      const double w = share(r["timeline"], "allreduce");
      if (w < least) least = w, slow = r["rank"].get<int>();
      if (w > most) most = w, fast = r["rank"].get<int>();
    }
    if (slow >= 0 && most - least >= kWaitThreshold) {
      const auto [stage, frac] = top_stage(ranks[slow]["timeline"], {"allreduce"});
      const double other = share(ranks[fast]["timeline"], stage.c_str());
      return {{"kind", "slow_rank"},
              {"rank", slow},
              {"stage", stage},
              {"line", fmt::format("slow rank: rank {} is the slowest trainer; the others wait up "
                                   "to {:.0f}% of their time for it in the all-reduce ({} takes "
                                   "{:.0f}% of rank {}, {:.0f}% of rank {})",
                                   slow, 100 * most, stage, 100 * frac, slow, 100 * other, fast)}};
    }
  }
  // 4. The device or the host.
  const json& r0 = ranks[0];
  const auto [stage, frac] = top_stage(r0["timeline"], {"gpu_wait", "queue_wait"});
  if (r0.contains("gpu")) {
    const double busy = r0["gpu"].value("busy", -1.0);
    const json* main = thread_named(r0, "main");
    const double gpu_wait = main ? share(main->at("stages"), "gpu_wait") : 0.0;
    // NVML's busy covers the whole window, checkpoint writes and evaluations included, in
    // which the training GPU idles (the final checkpoint alone is a large share of a short
    // run): the steps' own busy share decides between host and GPU.
    const double pauses =
        main ? share(main->at("stages"), "checkpoint") + share(main->at("stages"), "eval") : 0.0;
    const double steps_busy = busy >= 0 && pauses < 1 ? std::min(1.0, busy / (1 - pauses)) : busy;
    std::string busy_text = busy >= 0 ? fmt::format("{:.0f}%", 100 * busy) : "(no NVML)";
    if (busy >= 0 && pauses >= kPauseNote) {
      busy_text += fmt::format(
          " ({:.0f}% outside checkpoints and evaluation, which take {:.0f}% of the window)",
          100 * steps_busy, 100 * pauses);
    }
    if (steps_busy >= 0 && steps_busy < 0.9 && gpu_wait < kWaitThreshold) {
      return {{"kind", "host"},
              {"rank", 0},
              {"stage", stage},
              {"line", fmt::format("host: rank 0's GPU is busy only {} and its main thread "
                                   "waits for it {:.0f}% of the time: launching work on the host "
                                   "is the bottleneck",
                                   busy_text, 100 * gpu_wait)}};
    }
    return {{"kind", "gpu"},
            {"rank", 0},
            {"stage", stage},
            {"line", fmt::format("GPU-bound: rank 0's GPU is busy {} and the host keeps ahead; its "
                                 "largest stage is {} ({:.0f}% of GPU time)",
                                 busy_text, stage, 100 * frac)}};
  }
  return {{"kind", "compute"},
          {"rank", 0},
          {"stage", stage},
          {"line", fmt::format("compute-bound: no rank waits on another; the largest stage is {} "
                               "({:.0f}% of rank 0's time)",
                               stage, 100 * frac)}};
}

// Seconds per trainer share of a micro-batch on each side, excluding waits for the other side.
// With tensor-parallel target groups (target_tp T) every rank of a group works on each of the
// group's shares: a group is the unit the split counts, T GPUs at a time.
json balance(const json& job, const json& ranks) {
  const int trainers = job.value("trainer_ranks", 1);
  const int group = std::max(job.value("target_tp", 1), 1);
  const int64_t accumulation = job.value("accumulation", int64_t{1});
  double target_s = 0, trainer_s = 0;
  int nt = 0, nd = 0;
  for (const auto& r : ranks) {
    const double items = r.value("items", 0.0);
    const double window = r.value("window_s", 0.0);
    if (items <= 0 || window <= 0) continue;
    const bool trainer = r["rank"].get<int>() < trainers;
    const char* wait = trainer ? "recv_wait" : "send_wait";
    const double busy = window * (1.0 - share(r["timeline"], wait) -
                                  (r.contains("gpu") ? 0.0 : share(r["timeline"], "queue_wait")));
    if (trainer) {
      trainer_s += busy / (items * static_cast<double>(accumulation));
      ++nd;
    } else {
      target_s += busy / items;
      ++nt;
    }
  }
  if (nt == 0 || nd == 0) return nullptr;
  target_s /= nt;
  trainer_s /= nd;
  const int world = static_cast<int>(ranks.size());
  // The number of target GPUs (whole groups) of n that feeds the trainers fastest.
  auto best_split = [&](int n) {
    int best = group;
    double best_rate = 0;
    for (int x = group; x < n; x += group) {
      const double rate = std::min(x / group / target_s, (n - x) / trainer_s);
      if (rate > best_rate) best_rate = rate, best = x;
    }
    return best;
  };
  // GPU-seconds of target work per share against a trainer's.
  const double frac = group * target_s / (group * target_s + trainer_s);
  const int now = best_split(world), eight = best_split(8);
  const std::string who = group > 1
                              ? fmt::format("a target group ({} ranks, tensor parallel)", group)
                              : "a target rank";
  return {{"target_s_per_share", target_s},
          {"trainer_s_per_share", trainer_s},
          {"target_group", group},
          {"target_fraction", frac},
          {"best_targets", now},
          {"best_targets_of_8", eight},
          {"line", fmt::format("balance: {} takes {:.1f} ms per trainer share, a trainer "
                               "{:.1f} ms; the balanced split is {:.2f} target : {:.2f} trainer "
                               "({} GPUs: {} + {}; 8 GPUs: {} + {}{})",
                               who, 1e3 * target_s, 1e3 * trainer_s, frac, 1 - frac, world, now,
                               world - now, eight, 8 - eight,
                               group > 1 ? fmt::format(", targets in groups of {}", group) : "")}};
}

// A tensor-parallel target's all-reduces (their own stage, target_allreduce): their share of
// each rank's time that runs the target, and of its target forward with them.
json target_allreduce(const json& job, const json& ranks) {
  const int group = job.value("target_tp", 1);
  if (group <= 1) return nullptr;
  json per_rank = json::array();
  double sum = 0, of_forward = 0;
  for (const auto& r : ranks) {
    const json& t = r["timeline"];
    const double reduce = share(t, "target_allreduce"), forward = share(t, "target_forward");
    if (reduce + forward <= 0) continue;
    per_rank.push_back({{"rank", r["rank"]}, {"share", reduce}});
    sum += reduce;
    of_forward += reduce / (reduce + forward);
  }
  if (per_rank.empty()) return nullptr;
  const double n = static_cast<double>(per_rank.size());
  return {{"group", group},
          {"ranks", per_rank},
          {"share", sum / n},
          {"of_target", of_forward / n},
          {"line", fmt::format("target all-reduce: the tensor-parallel groups of {} spend {:.1f}% "
                               "of their ranks' time in the group's all-reduces ({:.1f}% of "
                               "target forward + all-reduce; mean of {} ranks)",
                               group, 100 * sum / n, 100 * of_forward / n, per_rank.size())}};
}

std::string pct(double x) { return fmt::format("{:5.1f}%", 100 * x); }

std::string split_text(const json& shares) {
  std::vector<std::pair<std::string, double>> v;
  for (const auto& [k, s] : shares.items()) v.push_back({k, s.get<double>()});
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::string out;
  for (const auto& [k, s] : v) {
    if (s < 0.0005) continue;
    out += fmt::format("{}{} {:.1f}%", out.empty() ? "" : ", ", k, 100 * s);
  }
  return out;
}

}  // namespace

int64_t next_start(const fs::path& obs_dir) {
  const json job = read_job(obs_dir / "job.json");
  if (job.empty()) return 1;
  int64_t last = 0;  // a job.json without starts: its figures are start 0
  for (const auto& s : job.value("starts", json::array())) {
    last = std::max(last, s.value("start", int64_t{0}));
  }
  return last + 1;
}

void record_job_start(const fs::path& obs_dir, const json& job, const json& record) {
  const json before = read_job(obs_dir / "job.json");
  json starts = before.value("starts", json::array());
  if (!before.empty() && !before.contains("starts")) {
    json old = before;
    old["start"] = 0;
    starts.push_back(std::move(old));
  }
  json entry = job;
  entry.update(record);
  starts.push_back(std::move(entry));
  json out = job;
  out["start"] = record.at("start");
  out["starts"] = std::move(starts);
  write_file_atomic(obs_dir / "job.json", out.dump(2) + "\n");
}

json analyze_run(const fs::path& run_dir, std::optional<int64_t> which) {
  const fs::path dir = run_dir / "obs";
  const fs::path job_path = dir / "job.json";
  if (!fs::exists(job_path)) {
    fail(
        "{}: not found (the run directory of `dflash train` or `dflash bench --out`, written by "
        "a dflash with built-in observability)",
        job_path.string());
  }
  const json job_file = read_json_file(job_path);
  const fs::path first_rank = rank_file(dir, 0);
  if (!fs::exists(first_rank)) fail("{}: missing (rank 0 wrote no figures)", first_rank.string());
  // Every start of the run as rank 0 saw it; by default the report is of the newest that
  // trained steps (a resume with nothing left to do has no steady state to report).
  json starts = json::array();
  const auto figures = read_starts(first_rank);
  const StartFigures* chosen = nullptr;
  bool chosen_trained = false;
  for (const auto& s : figures) {
    if (s.snapshots.empty()) continue;
    const int64_t step = s.record.is_object() ? s.record.value("step", int64_t{0}) : 0;
    const json r = analyze_rank(0, s.snapshots, step);
    json entry = {{"start", s.start},
                  {"step", step},
                  {"resumed", s.record.is_object() && s.record.value("resumed", false)},
                  {"from_step", r["from_step"]},
                  {"to_step", r["step"]},
                  {"window_s", r["window_s"]},
                  {"trained", s.snapshots.back().value("items", int64_t{0}) > 0}};
    if (s.record.is_object() && s.record.contains("time")) entry["time"] = s.record["time"];
    if (s.record.is_object() && s.record.contains("data_change")) {
      entry["data_change"] = s.record["data_change"];
    }
    const bool trained = entry["trained"].get<bool>();
    if (which ? s.start == *which : trained || !chosen_trained) {
      chosen = &s;
      chosen_trained = trained;
    }
    starts.push_back(std::move(entry));
  }
  if (starts.empty()) fail("{}: no complete snapshot line", first_rank.string());
  if (!chosen) {
    std::vector<int64_t> have;
    for (const auto& s : starts) have.push_back(s["start"].get<int64_t>());
    fail("{}: no figures of start {} (the run has starts {})", first_rank.string(), *which,
         fmt::join(have, ", "));
  }
  const int64_t index = chosen->start;
  // The job of that start: the ranks and topology may differ from start to start.
  json job = job_file;
  for (const auto& s : job_file.value("starts", json::array())) {
    if (s.value("start", int64_t{-1}) == index) job = s;
  }
  const int world = job.value("ranks", 1);
  json ranks = json::array();
  for (int rank = 0; rank < world; ++rank) {
    const fs::path path = rank_file(dir, rank);
    if (!fs::exists(path)) fail("{}: missing (rank {} wrote no figures)", path.string(), rank);
    const auto all = read_starts(path);
    const StartFigures* mine = find_start(all, index);
    if (!mine) {
      fail("{}: no complete snapshot line of start {} (rank {} wrote none)", path.string(), index,
           rank);
    }
    const int64_t step = mine->record.is_object() ? mine->record.value("step", int64_t{0}) : 0;
    ranks.push_back(analyze_rank(rank, mine->snapshots, step));
  }
  json out = {{"run_dir", run_dir.string()},
              {"job", job},
              {"ranks", ranks},
              {"start", index},
              {"starts", starts}};
  out["bottleneck"] = find_bottleneck(job, ranks);
  if (job.value("topology", std::string()) == "disaggregated") out["balance"] = balance(job, ranks);
  out["target_allreduce"] = target_allreduce(job, ranks);
  return out;
}

std::string format_report(const json& a) {
  const json& job = a["job"];
  const int trainers = job.value("trainer_ranks", 1);
  std::string out =
      fmt::format("report: {} ({} rank(s), {}, {} training)\n", a["run_dir"].get<std::string>(),
                  job.value("ranks", 1), job.value("topology", std::string("colocated")), trainers);
  const json starts = a.value("starts", json::array());
  if (starts.size() > 1) {
    out += fmt::format(
        "starts: {} in this run directory, the report is of start {} (`dflash report {} --start "
        "N` for another)\n",
        starts.size(), a["start"].get<int64_t>(), a["run_dir"].get<std::string>());
    for (const auto& s : starts) {
      const int64_t index = s["start"].get<int64_t>();
      std::string how = index == 0 ? " (written before start records)" : "";
      if (s.value("resumed", false)) {
        how = fmt::format(" (resumed at step {})", s["step"].get<int64_t>());
      }
      if (s.contains("data_change")) how += " on another dataset (--allow-data-change)";
      out += fmt::format("  start {}{}: {}{}\n", index, how,
                         s.value("trained", false)
                             ? fmt::format("steps {}..{}, {:.1f} s of steady-state figures",
                                           s["from_step"].get<int64_t>(),
                                           s["to_step"].get<int64_t>(), s["window_s"].get<double>())
                             : std::string("no step trained"),
                         index == a["start"].get<int64_t>() ? "  <- this report" : "");
    }
  }
  double min_gpu = 2, min_thread = 2;
  for (const auto& r : a["ranks"]) {
    const int rank = r["rank"].get<int>();
    out += fmt::format("\nrank {} ({}): steps {}..{} over {:.1f} s, host CPU {:.2f} cores\n", rank,
                       rank < trainers ? "trainer" : "target", r["from_step"].get<int64_t>(),
                       r["step"].get<int64_t>(), r["window_s"].get<double>(),
                       r["cpu_cores"].get<double>());
    if (r.contains("gpu")) {
      const json& g = r["gpu"];
      min_gpu = std::min(min_gpu, g["attributed"].get<double>());
      out += fmt::format(
          "  GPU {}: busy {} (NVML), {} of its time in named stages{}\n", g["device"].get<int>(),
          g.contains("busy") ? pct(g["busy"].get<double>()) : std::string("   n/a"),
          pct(g["attributed"].get<double>()),
          g.contains("memory_used_gib")
              ? fmt::format(", {:.1f} GiB in use on the device", g["memory_used_gib"].get<double>())
              : std::string());
      out += fmt::format("    {}\n", split_text(g["stages"]));
    }
    for (const auto& t : r["threads"]) {
      if (t["wall_s"].get<double>() <= 0) continue;
      min_thread = std::min(min_thread, t["attributed"].get<double>());
      json stages = t["stages"];
      stages.erase("unattributed");
      out += fmt::format("  thread {:<15} CPU {}, {} in named stages: {}\n",
                         t["name"].get<std::string>(), pct(t.value("cpu", 0.0)),
                         pct(t["attributed"].get<double>()), split_text(stages));
    }
    if (!r["other_threads"].empty()) {
      std::string others;
      for (const auto& t : r["other_threads"]) {
        others += fmt::format("{}{} {}", others.empty() ? "" : ", ", t["name"].get<std::string>(),
                              pct(t["cpu"].get<double>()));
      }
      out += fmt::format("  other threads (LibTorch, NCCL, CUDA): {}\n", others);
    }
  }
  out += fmt::format(
      "\nattribution: {} and every worker thread at least {} of its wall time in "
      "named stages\n",
      min_gpu <= 1 ? fmt::format("every GPU at least {}", pct(min_gpu)) : "no GPU",
      pct(std::min(min_thread, 1.0)));
  if (a.contains("target_allreduce") && !a["target_allreduce"].is_null()) {
    out += fmt::format("{}\n", a["target_allreduce"]["line"].get<std::string>());
  }
  out += fmt::format("bottleneck: {}\n", a["bottleneck"]["line"].get<std::string>());
  if (a.contains("balance") && !a["balance"].is_null()) {
    out += fmt::format("{}\n", a["balance"]["line"].get<std::string>());
  }
  return out;
}

fs::path merge_traces(const fs::path& run_dir) {
  const fs::path dir = run_dir / "obs";
  if (!fs::exists(dir)) return {};
  json events = json::array();
  bool any = false;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("trace-rank-", 0) != 0) continue;
    const json part = read_json_file(entry.path());
    for (const auto& e : part.at("traceEvents")) events.push_back(e);
    any = true;
  }
  if (!any) return {};
  const fs::path out = run_dir / "trace.json";
  write_file_atomic(out, json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n");
  return out;
}

}  // namespace dflash::obs
