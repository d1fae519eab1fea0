// common: reading a JSON file, with parse errors that name the file, and its fields, with
// errors that name the field and `origin` (the file, or what it describes).
#pragma once
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "common/error.h"

namespace dflash {

nlohmann::json read_json_file(const std::filesystem::path& path);

template <class T>
T required_field(const nlohmann::json& j, const char* key, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) fail("{}: missing required field \"{}\"", origin, key);
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception& e) {
    fail("{}: field \"{}\" has the wrong type ({})", origin, key, e.what());
  }
}

template <class T>
T optional_field(const nlohmann::json& j, const char* key, T fallback, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception& e) {
    fail("{}: field \"{}\" has the wrong type ({})", origin, key, e.what());
  }
}

}  // namespace dflash
