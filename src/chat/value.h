// chat: the values a chat template computes with, modelled on the Python objects jinja2 sees
// when transformers renders a template (None, bool, int, float, str, list, tuple, dict, jinja2's
// Undefined and Namespace, callables), with Python's truthiness, comparisons, str()/repr() and
// json.dumps, because templates print them and the output must be byte-identical.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/error.h"

namespace dflash::chat {

class Value;
using List = std::vector<Value>;
// Python dicts keep insertion order; chat dicts have a handful of keys, so a vector searched
// linearly is faster than a map and keeps the order for free.
using Dict = std::vector<std::pair<std::string, Value>>;

// Positional and keyword arguments of a call (filter, test, method, macro, global function).
struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// A failure while evaluating: the message says what failed (as jinja2 would) without the place,
// which the interpreter adds ("template.jinja:12:5: ...").
class EvalError : public dflash::Error {
 public:
  using dflash::Error::Error;
};

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kCallable
  };
  using Function = std::function<Value(Args&)>;

  Value() = default;  // undefined
  static Value undefined(std::string hint) {
    Value v;
    v.str_ = std::make_shared<const std::string>(std::move(hint));
    return v;
  }
  static Value none() { return Value(Kind::kNone); }
  Value(bool b) : kind_(Kind::kBool), int_(b) {}       // NOLINT
  Value(int64_t i) : kind_(Kind::kInt), int_(i) {}     // NOLINT
  Value(int i) : kind_(Kind::kInt), int_(i) {}         // NOLINT
  Value(double d) : kind_(Kind::kFloat), float_(d) {}  // NOLINT
  Value(std::string s)                                 // NOLINT
      : kind_(Kind::kString), str_(std::make_shared<const std::string>(std::move(s))) {}
  Value(const char* s) : Value(std::string(s)) {}       // NOLINT
  Value(std::string_view s) : Value(std::string(s)) {}  // NOLINT
  static Value list(List items, bool tuple = false);
  static Value dict(Dict items);
  static Value namespace_(Dict items);
  static Value function(std::string name, Function f);
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_tuple() const { return is_list() && list_->tuple; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }
  double as_number() const { return is_float() ? float_ : static_cast<double>(int_); }
  const std::string& as_string() const { return *str_; }
  const List& as_list() const { return list_->items; }
  const Dict& as_dict() const { return dict_->items; }
  Dict& namespace_items() const { return dict_->items; }
  // What an undefined value stands for, for the error its use raises ("'x' is undefined").
  const std::string& undefined_hint() const;
  const std::string& function_name() const { return fn_->name; }
  Value call(Args& args) const { return fn_->f(args); }

  // Dict lookup: nullptr when absent.
  const Value* find(std::string_view key) const;
  // Python: truth value, ==, <, str(), repr(), type name as jinja2's messages write it.
  bool truthy() const;
  bool equals(const Value& other) const;
  // Throws EvalError for types Python cannot order.
  bool less(const Value& other) const;
  std::string str() const;
  std::string repr() const;
  std::string type_name() const;
  // json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...), transformers'
  // tojson. indent < 0: none. Separators default as Python's: (", ", ": ") without indent,
  // (",", ": ") with it.
  std::string to_json(int indent = -1, const std::string* item_sep = nullptr,
                      const std::string* key_sep = nullptr, bool sort_keys = false) const;
  nlohmann::ordered_json to_nlohmann() const;

 private:
  explicit Value(Kind k) : kind_(k) {}
  struct ListData {
    List items;
    bool tuple = false;
  };
  struct DictData {
    Dict items;
  };
  struct FunctionData {
    std::string name;
    Function f;
  };
  Kind kind_ = Kind::kUndefined;
  int64_t int_ = 0;
  double float_ = 0;
  std::shared_ptr<const std::string> str_;  // string, or the hint of an undefined value
  std::shared_ptr<ListData> list_;
  std::shared_ptr<DictData> dict_;  // dict or namespace
  std::shared_ptr<FunctionData> fn_;
};

// Python's repr() of a float ("1.0", "1e-05", "1.5e+16", "inf", "nan").
std::string python_float_repr(double d);
// `s` as a JSON string the way Python's json.dumps(ensure_ascii=False) writes it, appended.
void json_string(std::string& out, std::string_view s);
// Unicode code points of a UTF-8 string (templates index and slice strings by code point).
std::vector<std::string_view> code_points(std::string_view s);

}  // namespace dflash::chat
