// chat: jinja2's filters and tests, the Python methods of str/dict/list that templates call,
// attribute and item access with jinja2's sandbox rules (internal to src/chat).
#pragma once
#include <string>

#include "chat/value.h"

namespace dflash::chat {

// `raise_exception(msg)`: the template refuses its input.
class RaisedError : public EvalError {
 public:
  using EvalError::EvalError;
};

// jinja2's Undefined used where it must fail (attribute, call, arithmetic).
[[noreturn]] void fail_undefined(const Value& v);

// obj.name: a method bound to obj, else a dict key / namespace attribute, else undefined.
Value get_attr(const Value& obj, const std::string& name);
// obj[key]: item first, then attribute (jinja2's Environment.getitem).
Value get_item(const Value& obj, const Value& key);
// The items a for loop or a filter iterates: list items, dict keys, string characters.
List iterate(const Value& v);

// Throws EvalError for an unknown filter or test.
Value apply_filter(const std::string& name, const Value& v, Args& args);
bool apply_test(const std::string& name, const Value& v, Args& args);
bool has_filter(const std::string& name);
bool has_test(const std::string& name);

}  // namespace dflash::chat
