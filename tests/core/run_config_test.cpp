// The run config: YAML keys, command-line options that override them, errors that name the
// file and key, and the saved run_config.yaml read back as the same config.
#include "pipeline/run_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include "common/error.h"
#include "common/file.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;

struct Parsed {
  pipeline::RunConfig cli;
  std::string file;
};

pipeline::RunConfig resolve(std::vector<std::string> args) {
  CLI::App app;
  Parsed p;
  pipeline::add_config_options(app, p.cli, p.file);
  std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last first
  app.parse(args);
  return pipeline::resolve_config(app, p.cli, p.file);
}

fs::path write_yaml(const std::string& name, const std::string& text) {
  auto path = fs::temp_directory_path() / fmt::format("dflash_{}_{}.yaml", name, ::getpid());
  write_file_atomic(path, text);
  return path;
}

TEST(RunConfig, YamlKeysThenCommandLineOverrides) {
  auto yaml = write_yaml("keys",
                         "target: /models/qwen3-8b\n"
                         "lr: 1.0e-4\n"
                         "batch_size: 8\n"
                         "target_layer_ids: [1, 9, 17]\n"
                         "topology: disaggregated\n"
                         "resume: true\n");
  auto c = resolve({"--config", yaml.string(), "--batch-size", "16", "--seed", "3"});
  EXPECT_EQ(c.target, "/models/qwen3-8b");
  EXPECT_DOUBLE_EQ(c.lr, 1e-4);
  EXPECT_EQ(c.batch_size, 16);  // the option wins over the file
  EXPECT_EQ(c.seed, 3);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int64_t>{1, 9, 17}));
  EXPECT_EQ(c.topology, "disaggregated");
  EXPECT_TRUE(c.resume);
  EXPECT_EQ(c.max_anchors, 512);  // neither: the default
  // Without a file, defaults and options only.
  auto d = resolve({"--lr", "0.002", "--target-layer-ids", "3,5"});
  EXPECT_DOUBLE_EQ(d.lr, 0.002);
  EXPECT_EQ(d.target_layer_ids, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(d.batch_size, 1);
  remove_tree(yaml);
}

TEST(RunConfig, SavedYamlReadsBackAsTheSameConfig) {
  auto c =
      resolve({"--target", "t", "--data", "d", "--out", "o", "--lr", "0.00037",
               "--target-layer-ids", "2,4,6", "--epochs", "2.5", "--resume", "--timeout-s", "42"});
  auto yaml = write_yaml("roundtrip", pipeline::to_yaml(c));
  auto back = resolve({"--config", yaml.string()});
  EXPECT_EQ(pipeline::to_yaml(back), pipeline::to_yaml(c));
  EXPECT_DOUBLE_EQ(back.lr, 0.00037);
  EXPECT_EQ(back.target_layer_ids, (std::vector<int64_t>{2, 4, 6}));
  EXPECT_TRUE(back.resume);
  remove_tree(yaml);
}

TEST(RunConfig, BadFilesAreErrorsNamingFileAndKey) {
  auto expect_error = [](const std::string& text, const std::string& needle) {
    auto yaml = write_yaml("bad", text);
    try {
      resolve({"--config", yaml.string()});
      ADD_FAILURE() << text;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(yaml.string()), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
    }
    remove_tree(yaml);
  };
  expect_error("learning_rate: 0.1\n", "unknown key 'learning_rate'");
  expect_error("batch_size: many\n", "key 'batch_size': expected an integer");
  expect_error("target_layer_ids: 3\n", "key 'target_layer_ids'");
  expect_error("- 1\n- 2\n", "expected a mapping");
  expect_error("lr: [\n", "not valid YAML");
}

}  // namespace
}  // namespace dflash
