#include "chat/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <nlohmann/json.hpp>

#include "tokenizer/unicode.h"

namespace dflash::chat {

Value Value::list(List items, bool tuple) {
  Value v(Kind::kList);
  v.list_ = std::make_shared<ListData>(ListData{std::move(items), tuple});
  return v;
}

Value Value::dict(Dict items) {
  Value v(Kind::kDict);
  v.dict_ = std::make_shared<DictData>(DictData{std::move(items)});
  return v;
}

Value Value::namespace_(Dict items) {
  Value v = dict(std::move(items));
  v.kind_ = Kind::kNamespace;
  return v;
}

Value Value::function(std::string name, Function f) {
  Value v(Kind::kCallable);
  v.fn_ = std::make_shared<FunctionData>(FunctionData{std::move(name), std::move(f)});
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float:
      return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict items;
      items.reserve(j.size());
      for (const auto& [k, e] : j.items()) items.emplace_back(k, from_json(e));
      return dict(std::move(items));
    }
    default:
      throw EvalError("binary JSON values cannot be passed to a chat template");
  }
}

nlohmann::ordered_json Value::to_nlohmann() const {
  switch (kind_) {
    case Kind::kNone:
      return nullptr;
    case Kind::kBool:
      return as_bool();
    case Kind::kInt:
      return int_;
    case Kind::kFloat:
      return float_;
    case Kind::kString:
      return *str_;
    case Kind::kList: {
      auto a = nlohmann::ordered_json::array();
      for (const auto& e : as_list()) a.push_back(e.to_nlohmann());
      return a;
    }
    case Kind::kDict: {
      auto o = nlohmann::ordered_json::object();
      for (const auto& [k, e] : as_dict()) o[k] = e.to_nlohmann();
      return o;
    }
    default:
      throw EvalError("Object of type " + type_name() + " is not JSON serializable");
  }
}

const std::string& Value::undefined_hint() const {
  static const std::string kNone = "value is undefined";
  return str_ ? *str_ : kNone;
}

const Value* Value::find(std::string_view key) const {
  for (const auto& [k, v] : dict_->items) {
    if (k == key) return &v;
  }
  return nullptr;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
    case Kind::kInt:
      return int_ != 0;
    case Kind::kFloat:
      return float_ != 0;
    case Kind::kString:
      return !str_->empty();
    case Kind::kList:
      return !list_->items.empty();
    case Kind::kDict:
      return !dict_->items.empty();
    default:
      return true;
  }
}

bool Value::equals(const Value& o) const {
  if (is_number() && o.is_number()) {
    if (is_float() || o.is_float()) return as_number() == o.as_number();
    return int_ == o.int_;
  }
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return *str_ == *o.str_;
    case Kind::kList: {
      if (is_tuple() != o.is_tuple() || as_list().size() != o.as_list().size()) return false;
      for (size_t i = 0; i < as_list().size(); ++i) {
        if (!as_list()[i].equals(o.as_list()[i])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      if (as_dict().size() != o.as_dict().size()) return false;
      for (const auto& [k, v] : as_dict()) {
        const Value* w = o.find(k);
        if (!w || !v.equals(*w)) return false;
      }
      return true;
    }
    case Kind::kNamespace:
      return dict_ == o.dict_;
    default:
      return fn_ == o.fn_;
  }
}

bool Value::less(const Value& o) const {
  if (is_number() && o.is_number()) {
    if (is_float() || o.is_float()) return as_number() < o.as_number();
    return int_ < o.int_;
  }
  if (is_string() && o.is_string()) return *str_ < *o.str_;  // UTF-8 order is code point order
  if (is_list() && o.is_list() && is_tuple() == o.is_tuple()) {
    const auto &a = as_list(), &b = o.as_list();
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      if (!a[i].equals(b[i])) return a[i].less(b[i]);
    }
    return a.size() < b.size();
  }
  throw EvalError("'<' not supported between instances of '" + type_name() + "' and '" +
                  o.type_name() + "'");
}

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  // Shortest round-trip digits, then Python's layout: fixed for 1e-4 <= |d| < 1e16, else
  // scientific with a signed, at least two-digit exponent.
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string s(buf, r.ptr);
  const size_t e = s.find('e');
  const int exp = std::stoi(s.substr(e + 1));
  std::string mant = s.substr(0, e);
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant) {
    if (c != '.') digits += c;
  }
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    } else if (static_cast<size_t>(exp) + 1 >= digits.size()) {
      out += digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(exp) + 1) + "." +
             digits.substr(static_cast<size_t>(exp) + 1);
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  out += exp < 0 ? "e-" : "e+";
  const std::string ed = std::to_string(std::abs(exp));
  out += (ed.size() < 2 ? "0" : "") + ed;
  return out;
}

std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    tok::next_code_point(s, i);
    out.push_back(s.substr(start, i - start));
  }
  return out;
}

namespace {

// Python's str.isprintable() for the code points templates meet: controls, the Unicode spaces
// other than ' ', and the common format characters are escaped by repr().
bool python_printable(char32_t c) {
  if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad) return false;
  if ((c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) || c == 0x3000 ||
      (c >= 0x2060 && c <= 0x206f) || c == 0xfeff || c == 0x1680 || c == 0x205f) {
    return false;
  }
  return !(c >= 0xd800 && c <= 0xdfff) && !(c >= 0xe000 && c <= 0xf8ff);
}

std::string string_repr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    const char32_t c = tok::next_code_point(s, i);
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!python_printable(c)) {
      out += c <= 0xff     ? fmt::format("\\x{:02x}", static_cast<uint32_t>(c))
             : c <= 0xffff ? fmt::format("\\u{:04x}", static_cast<uint32_t>(c))
                           : fmt::format("\\U{:08x}", static_cast<uint32_t>(c));
    } else {
      out.append(s.substr(start, i - start));
    }
  }
  out += quote;
  return out;
}

}  // namespace

void json_string(std::string& out, std::string_view s) {
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

namespace {

struct JsonWriter {
  int indent;
  std::string item_sep, key_sep;
  bool sort_keys;
  std::string out;

  void newline(int level) {
    out += '\n';
    out.append(static_cast<size_t>(indent * level), ' ');
  }

  void write(const Value& v, int level) {
    switch (v.kind()) {
      case Value::Kind::kNone:
        out += "null";
        return;
      case Value::Kind::kBool:
        out += v.as_bool() ? "true" : "false";
        return;
      case Value::Kind::kInt:
        out += std::to_string(v.as_int());
        return;
      case Value::Kind::kFloat: {
        const double d = v.as_number();
        out += std::isnan(d)   ? "NaN"
               : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity")
                               : python_float_repr(d);
        return;
      }
      case Value::Kind::kString:
        json_string(out, v.as_string());
        return;
      case Value::Kind::kList: {
        const auto& items = v.as_list();
        if (items.empty()) {
          out += "[]";
          return;
        }
        out += '[';
        for (size_t i = 0; i < items.size(); ++i) {
          if (i) out += item_sep;
          if (indent >= 0) newline(level + 1);
          write(items[i], level + 1);
        }
        if (indent >= 0) newline(level);
        out += ']';
        return;
      }
      case Value::Kind::kDict: {
        const auto& items = v.as_dict();
        if (items.empty()) {
          out += "{}";
          return;
        }
        std::vector<const std::pair<std::string, Value>*> order;
        for (const auto& kv : items) order.push_back(&kv);
        if (sort_keys) {
          std::stable_sort(order.begin(), order.end(),
                           [](const auto* a, const auto* b) { return a->first < b->first; });
        }
        out += '{';
        for (size_t i = 0; i < order.size(); ++i) {
          if (i) out += item_sep;
          if (indent >= 0) newline(level + 1);
          json_string(out, order[i]->first);
          out += key_sep;
          write(order[i]->second, level + 1);
        }
        if (indent >= 0) newline(level);
        out += '}';
        return;
      }
      default:
        throw EvalError("Object of type " + v.type_name() + " is not JSON serializable");
    }
  }
};

}  // namespace

std::string Value::to_json(int indent, const std::string* item_sep, const std::string* key_sep,
                           bool sort_keys) const {
  JsonWriter w{indent,
               item_sep ? *item_sep : (indent >= 0 ? "," : ", "),
               key_sep ? *key_sep : ": ",
               sort_keys,
               {}};
  w.write(*this, 0);
  return std::move(w.out);
}

std::string Value::str() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return *str_;
    default:
      return repr();
  }
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return as_bool() ? "True" : "False";
    case Kind::kInt:
      return std::to_string(int_);
    case Kind::kFloat:
      return python_float_repr(float_);
    case Kind::kString:
      return string_repr(*str_);
    case Kind::kList: {
      std::string out = is_tuple() ? "(" : "[";
      for (size_t i = 0; i < as_list().size(); ++i) {
        if (i) out += ", ";
        out += as_list()[i].repr();
      }
      if (is_tuple() && as_list().size() == 1) out += ",";
      return out + (is_tuple() ? ")" : "]");
    }
    case Kind::kDict:
    case Kind::kNamespace: {
      std::string out = is_namespace() ? "<Namespace {" : "{";
      for (size_t i = 0; i < as_dict().size(); ++i) {
        if (i) out += ", ";
        out += string_repr(as_dict()[i].first) + ": " + as_dict()[i].second.repr();
      }
      return out + (is_namespace() ? "}>" : "}");
    }
    default:
      return "<function " + fn_->name + ">";
  }
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return is_tuple() ? "tuple" : "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    default:
      return "function";
  }
}

}  // namespace dflash::chat
