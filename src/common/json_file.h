// common: reading a JSON file, with parse errors that name the file.
#pragma once
#include <filesystem>
#include <nlohmann/json.hpp>

namespace dflash {

nlohmann::json read_json_file(const std::filesystem::path& path);

}  // namespace dflash
