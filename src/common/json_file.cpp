#include "common/json_file.h"

#include "common/error.h"
#include "common/file.h"

namespace dflash {

nlohmann::json read_json_file(const std::filesystem::path& path) {
  try {
    return nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed JSON: {}", path.string(), e.what());
  }
}

}  // namespace dflash
