#include "chat/builtins.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <unordered_map>

#include "tokenizer/unicode.h"

namespace dflash::chat {
namespace {

std::string object_desc(const Value& v) {
  // jinja2's object_type_repr: "None", "dict object", "str object"...
  return v.is_none() ? "None" : "'" + v.type_name() + " object'";
}

// Argument binding as Python does for builtins with keyword defaults.
struct Binder {
  Args& args;
  const char* fn;

  // Parameter `name` at `index`; `def` when not given. A required parameter has no default
  // (undefined) and fails when missing.
  Value get(size_t index, const char* name, Value def = Value::undefined("")) {
    for (auto& [k, v] : args.keyword) {
      if (k == name) return v;
    }
    if (index < args.positional.size()) return args.positional[index];
    if (def.is_undefined() && def.undefined_hint().empty()) {
      throw EvalError(fmt::format("{}() missing required argument '{}'", fn, name));
    }
    return def;
  }
};

std::string need_str(const Value& v, const char* what) {
  if (!v.is_string())
    throw EvalError(fmt::format("{} must be a string, not {}", what, v.type_name()));
  return v.as_string();
}

int64_t need_int(const Value& v, const char* what) {
  if (!v.is_int() && !v.is_bool()) {
    throw EvalError(fmt::format("{} must be an integer, not {}", what, v.type_name()));
  }
  return v.as_int();
}

// --- Python str helpers (code points; whitespace as str.isspace) ---

bool in_chars(std::string_view cp, const std::vector<std::string_view>& chars) {
  return std::find(chars.begin(), chars.end(), cp) != chars.end();
}

bool cp_is_space(std::string_view cp) {
  size_t i = 0;
  return tok::is_python_space(tok::next_code_point(cp, i));
}

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  const auto cps = code_points(s);
  const bool ws = chars.is_none() || chars.is_undefined();
  const std::string chars_text = ws ? std::string() : need_str(chars, "strip chars");
  const std::vector<std::string_view> set = code_points(chars_text);  // views into chars_text
  auto strip_it = [&](std::string_view cp) { return ws ? cp_is_space(cp) : in_chars(cp, set); };
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && strip_it(cps[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(cps[e - 1])) --e;
  }
  if (b == e) return "";
  const size_t begin = static_cast<size_t>(cps[b].data() - s.data());
  const size_t end = static_cast<size_t>(cps[e - 1].data() + cps[e - 1].size() - s.data());
  return s.substr(begin, end - begin);
}

Value py_split(const std::string& s, const Value& sep, int64_t maxsplit) {
  List out;
  if (sep.is_none() || sep.is_undefined()) {
    const auto cps = code_points(s);
    size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && cp_is_space(cps[i])) ++i;
      if (i == cps.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        const size_t begin = static_cast<size_t>(cps[i].data() - s.data());
        size_t end = s.size();
        // Python keeps the remainder as is, trailing whitespace stripped.
        size_t e = cps.size();
        while (e > i && cp_is_space(cps[e - 1])) --e;
        end = static_cast<size_t>(cps[e - 1].data() + cps[e - 1].size() - s.data());
        out.emplace_back(s.substr(begin, end - begin));
        break;
      }
      const size_t start = i;
      while (i < cps.size() && !cp_is_space(cps[i])) ++i;
      const size_t begin = static_cast<size_t>(cps[start].data() - s.data());
      const size_t end = static_cast<size_t>(cps[i - 1].data() + cps[i - 1].size() - s.data());
      out.emplace_back(s.substr(begin, end - begin));
    }
    return Value::list(std::move(out));
  }
  const std::string d = need_str(sep, "split separator");
  if (d.empty()) throw EvalError("empty separator");
  size_t pos = 0;
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    const size_t f = s.find(d, pos);
    if (f == std::string::npos) break;
    out.emplace_back(s.substr(pos, f - pos));
    pos = f + d.size();
  }
  out.emplace_back(s.substr(pos));
  return Value::list(std::move(out));
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts `repl` between code points (and at both ends).
    const auto cps = code_points(s);
    int64_t n = 0;
    for (const auto& cp : cps) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      out += cp;
    }
    if (count < 0 || n < count) out += repl;
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t f = s.find(old, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += repl;
    pos = f + old.size();
    ++n;
  }
  out.append(s, pos);
  return out;
}

std::string ascii_map(std::string s, int (*f)(int)) {
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x80)
      c = static_cast<char>(f(static_cast<unsigned char>(c)));
  }
  return s;
}
std::string upper(const std::string& s) {
  return ascii_map(s, [](int c) { return std::toupper(c); });
}
std::string lower(const std::string& s) {
  return ascii_map(s, [](int c) { return std::tolower(c); });
}

std::string capitalize(const std::string& s) {
  std::string out = lower(s);
  if (!out.empty() && static_cast<unsigned char>(out[0]) < 0x80) {
    out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  }
  return out;
}

bool is_alpha_cp(std::string_view cp) {
  // Non-ASCII counts as cased (letters), which is right for the scripts chat roles use.
  return cp.size() > 1 || std::isalpha(static_cast<unsigned char>(cp[0]));
}

// Python's str.title(): a cased character after an uncased one starts a word.
std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (auto cp : code_points(s)) {
    if (cp.size() == 1) {
      const auto c = static_cast<unsigned char>(cp[0]);
      out += static_cast<char>(prev_cased ? std::tolower(c) : std::toupper(c));
    } else {
      out += cp;
    }
    prev_cased = is_alpha_cp(cp);
  }
  return out;
}

// jinja2's do_title: words split at whitespace and -({[<, first letter up, rest down.
std::string jinja_title(const std::string& s) {
  std::string out;
  bool start = true;
  for (auto cp : code_points(s)) {
    const bool boundary =
        cp_is_space(cp) || cp == "-" || cp == "(" || cp == "{" || cp == "[" || cp == "<";
    if (cp.size() == 1) {
      const auto c = static_cast<unsigned char>(cp[0]);
      out += static_cast<char>(boundary ? c : start ? std::toupper(c) : std::tolower(c));
    } else {
      out += cp;
    }
    start = boundary;
  }
  return out;
}

// Python's str.splitlines() line breaks.
std::vector<std::string> splitlines(const std::string& s) {
  std::vector<std::string> lines;
  std::string cur;
  const auto cps = code_points(s);
  for (size_t i = 0; i < cps.size(); ++i) {
    const auto cp = cps[i];
    const bool brk = cp == "\n" || cp == "\r" || cp == "\v" || cp == "\f" || cp == "\x1c" ||
                     cp == "\x1d" || cp == "\x1e" || cp == "\u0085" || cp == "\u2028" ||
                     cp == "\u2029";
    if (!brk) {
      cur += cp;
      continue;
    }
    if (cp == "\r" && i + 1 < cps.size() && cps[i + 1] == "\n") ++i;
    lines.push_back(std::move(cur));
    cur.clear();
  }
  if (!cur.empty()) lines.push_back(std::move(cur));
  return lines;
}

bool starts_or_ends(const std::string& s, const Value& affix, bool start) {
  auto one = [&](const std::string& a) {
    return a.size() <= s.size() && (start ? s.compare(0, a.size(), a) == 0
                                          : s.compare(s.size() - a.size(), a.size(), a) == 0);
  };
  if (affix.is_list()) {
    for (const auto& a : affix.as_list()) {
      if (one(need_str(a, "prefix"))) return true;
    }
    return false;
  }
  return one(need_str(affix, start ? "startswith argument" : "endswith argument"));
}

Value bound(const Value& obj, const std::string& name,
            std::function<Value(const Value&, Args&)> f) {
  return Value::function(name, [obj, f = std::move(f)](Args& a) { return f(obj, a); });
}

Value str_method(const Value& obj, const std::string& name) {
  using F = std::function<Value(const Value&, Args&)>;
  static const std::unordered_map<std::string, F> kMethods = {
      {"strip",
       [](const Value& o, Args& a) {
         return Value(py_strip(o.as_string(), Binder{a, "strip"}.get(0, "chars", Value::none()),
                               true, true));
       }},
      {"lstrip",
       [](const Value& o, Args& a) {
         return Value(py_strip(o.as_string(), Binder{a, "lstrip"}.get(0, "chars", Value::none()),
                               true, false));
       }},
      {"rstrip",
       [](const Value& o, Args& a) {
         return Value(py_strip(o.as_string(), Binder{a, "rstrip"}.get(0, "chars", Value::none()),
                               false, true));
       }},
      {"split",
       [](const Value& o, Args& a) {
         Binder b{a, "split"};
         return py_split(o.as_string(), b.get(0, "sep", Value::none()),
                         need_int(b.get(1, "maxsplit", Value(-1)), "maxsplit"));
       }},
      {"startswith",
       [](const Value& o, Args& a) {
         return Value(
             starts_or_ends(o.as_string(), Binder{a, "startswith"}.get(0, "prefix"), true));
       }},
      {"endswith",
       [](const Value& o, Args& a) {
         return Value(starts_or_ends(o.as_string(), Binder{a, "endswith"}.get(0, "suffix"), false));
       }},
      {"replace",
       [](const Value& o, Args& a) {
         Binder b{a, "replace"};
         return Value(py_replace(o.as_string(), need_str(b.get(0, "old"), "replace old"),
                                 need_str(b.get(1, "new"), "replace new"),
                                 need_int(b.get(2, "count", Value(-1)), "count")));
       }},
      {"upper", [](const Value& o, Args&) { return Value(upper(o.as_string())); }},
      {"lower", [](const Value& o, Args&) { return Value(lower(o.as_string())); }},
      {"title", [](const Value& o, Args&) { return Value(py_title(o.as_string())); }},
      {"capitalize", [](const Value& o, Args&) { return Value(capitalize(o.as_string())); }},
      {"find",
       [](const Value& o, Args& a) {
         const std::string sub = need_str(Binder{a, "find"}.get(0, "sub"), "find argument");
         const size_t f = o.as_string().find(sub);
         if (f == std::string::npos) return Value(-1);
         return Value(static_cast<int64_t>(
             code_points(std::string_view(o.as_string()).substr(0, f)).size()));
       }},
      {"count",
       [](const Value& o, Args& a) {
         const std::string sub = need_str(Binder{a, "count"}.get(0, "sub"), "count argument");
         if (sub.empty()) return Value(static_cast<int64_t>(code_points(o.as_string()).size() + 1));
         int64_t n = 0;
         for (size_t p = o.as_string().find(sub); p != std::string::npos;
              p = o.as_string().find(sub, p + sub.size()))
           ++n;
         return Value(n);
       }},
      {"join",
       [](const Value& o, Args& a) {
         std::string out;
         bool first = true;
         for (const auto& e : iterate(Binder{a, "join"}.get(0, "iterable"))) {
           if (!first) out += o.as_string();
           first = false;
           out += need_str(e, "join item");
         }
         return Value(std::move(out));
       }},
      {"splitlines",
       [](const Value& o, Args&) {
         List out;
         for (auto& l : splitlines(o.as_string())) out.emplace_back(std::move(l));
         return Value::list(std::move(out));
       }},
      {"isdigit",
       [](const Value& o, Args&) {
         const auto& s = o.as_string();
         return Value(!s.empty() &&
                      std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }));
       }},
      {"isspace",
       [](const Value& o, Args&) {
         const auto cps = code_points(o.as_string());
         return Value(!cps.empty() && std::all_of(cps.begin(), cps.end(), cp_is_space));
       }},
  };
  auto it = kMethods.find(name);
  if (it == kMethods.end())
    return Value::undefined(fmt::format("'str object' has no attribute '{}'", name));
  return bound(obj, name, it->second);
}

Value dict_method(const Value& obj, const std::string& name) {
  if (name == "items") {
    return bound(obj, name, [](const Value& o, Args&) {
      List out;
      for (const auto& [k, v] : o.as_dict()) out.push_back(Value::list({Value(k), v}, true));
      return Value::list(std::move(out));
    });
  }
  if (name == "keys") {
    return bound(obj, name, [](const Value& o, Args&) {
      List out;
      for (const auto& kv : o.as_dict()) out.emplace_back(kv.first);
      return Value::list(std::move(out));
    });
  }
  if (name == "values") {
    return bound(obj, name, [](const Value& o, Args&) {
      List out;
      for (const auto& kv : o.as_dict()) out.push_back(kv.second);
      return Value::list(std::move(out));
    });
  }
  if (name == "get") {
    return bound(obj, name, [](const Value& o, Args& a) {
      Binder b{a, "get"};
      const Value key = b.get(0, "key");
      const Value def = b.get(1, "default", Value::none());
      if (!key.is_string()) return def;
      const Value* v = o.find(key.as_string());
      return v ? *v : def;
    });
  }
  return Value();
}

Value list_method(const Value& obj, const std::string& name) {
  if (name == "index" || name == "count") {
    return bound(obj, name, [name](const Value& o, Args& a) {
      const Value x = Binder{a, name.c_str()}.get(0, "value");
      int64_t n = 0;
      for (size_t i = 0; i < o.as_list().size(); ++i) {
        if (o.as_list()[i].equals(x)) {
          if (name == "index") return Value(static_cast<int64_t>(i));
          ++n;
        }
      }
      if (name == "index") throw EvalError(x.repr() + " is not in list");
      return Value(n);
    });
  }
  if (name == "append" || name == "pop" || name == "extend" || name == "insert" ||
      name == "remove" || name == "update" || name == "clear" || name == "sort" ||
      name == "reverse") {
    // ImmutableSandboxedEnvironment refuses to modify lists and dicts.
    return Value::function(name, [name](Args&) -> Value {
      throw EvalError(fmt::format("access to attribute '{}' of 'list' object is unsafe.", name));
    });
  }
  return Value::undefined(fmt::format("'list object' has no attribute '{}'", name));
}

Value undefined_attr(const Value& obj, const std::string& name) {
  return Value::undefined(fmt::format("{} has no attribute '{}'", object_desc(obj), name));
}

// --- filters ---

using Filter = std::function<Value(const Value&, Args&)>;

// int(float): truncation, an error beyond 64 bits (Python would give a big int).
Value truncate(double d) {
  if (!(std::fabs(d) < 9.2e18))
    throw EvalError(fmt::format("cannot convert {} to a 64-bit integer", d));
  return Value(static_cast<int64_t>(std::trunc(d)));
}

Value to_int(const Value& v, const Value& def) {
  if (v.is_int() || v.is_bool()) return Value(v.as_int());
  if (v.is_float()) return truncate(v.as_number());
  if (v.is_string()) {
    const std::string s = py_strip(v.as_string(), Value::none(), true, true);
    try {
      size_t n = 0;
      const int64_t i = std::stoll(s, &n, 10);
      if (n == s.size()) return Value(i);
      const double d = std::stod(s, &n);
      if (n == s.size()) return truncate(d);
    } catch (const std::exception&) {
    }
  }
  return def;
}

Value to_float(const Value& v, const Value& def) {
  if (v.is_number()) return Value(v.as_number());
  if (v.is_string()) {
    try {
      size_t n = 0;
      const std::string s = py_strip(v.as_string(), Value::none(), true, true);
      const double d = std::stod(s, &n);
      if (n == s.size()) return Value(d);
    } catch (const std::exception&) {
    }
  }
  return def;
}

int64_t length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return static_cast<int64_t>(code_points(v.as_string()).size());
    case Value::Kind::kList:
      return static_cast<int64_t>(v.as_list().size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.as_dict().size());
    default:
      throw EvalError(fmt::format("object of type '{}' has no len()", v.type_name()));
  }
}

// An attribute path "a.b" or an integer index, as jinja2's make_attrgetter.
Value attr_path(const Value& v, const Value& attr) {
  if (attr.is_int()) return get_item(v, attr);
  Value cur = v;
  const std::string path = need_str(attr, "attribute");
  size_t pos = 0;
  while (true) {
    const size_t dot = path.find('.', pos);
    const std::string part =
        path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    cur = get_item(cur, Value(part));
    if (dot == std::string::npos) return cur;
    pos = dot + 1;
  }
}

Args rest_args(const Args& a, size_t from) {
  Args out;
  for (size_t i = from; i < a.positional.size(); ++i) out.positional.push_back(a.positional[i]);
  out.keyword = a.keyword;
  return out;
}

Value select_impl(const Value& v, Args& a, bool by_attr, bool keep) {
  List out;
  size_t first = 0;
  Value attr;
  if (by_attr) {
    if (a.positional.empty()) throw EvalError("selectattr/rejectattr need an attribute name");
    attr = a.positional[0];
    first = 1;
  }
  const bool has_test = a.positional.size() > first;
  const std::string test = has_test ? need_str(a.positional[first], "test name") : "";
  for (const auto& item : iterate(v)) {
    const Value x = by_attr ? attr_path(item, attr) : item;
    bool ok;
    if (has_test) {
      Args ta = rest_args(a, first + 1);
      ok = apply_test(test, x, ta);
    } else {
      ok = x.truthy();
    }
    if (ok == keep) out.push_back(item);
  }
  return Value::list(std::move(out));
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False).
Value tojson(const Value& v, Args& a) {
  Binder b{a, "tojson"};
  const Value ensure_ascii = b.get(0, "ensure_ascii", Value(false));
  const Value indent = b.get(1, "indent", Value::none());
  const Value seps = b.get(2, "separators", Value::none());
  const Value sort_keys = b.get(3, "sort_keys", Value(false));
  if (ensure_ascii.truthy()) throw EvalError("tojson(ensure_ascii=True) is not supported");
  int ind = -1;
  if (!indent.is_none())
    ind = static_cast<int>(std::max<int64_t>(0, need_int(indent, "tojson indent")));
  std::string item_sep, key_sep;
  if (!seps.is_none()) {
    if (!seps.is_list() || seps.as_list().size() != 2)
      throw EvalError("tojson separators must be a pair of strings");
    item_sep = need_str(seps.as_list()[0], "separator");
    key_sep = need_str(seps.as_list()[1], "separator");
  }
  return Value(v.to_json(ind, seps.is_none() ? nullptr : &item_sep,
                         seps.is_none() ? nullptr : &key_sep, sort_keys.truthy()));
}

Value indent_filter(const Value& v, Args& a) {
  Binder b{a, "indent"};
  const Value width = b.get(0, "width", Value(4));
  const bool first = b.get(1, "first", Value(false)).truthy();
  const bool blank = b.get(2, "blank", Value(false)).truthy();
  const std::string ind =
      width.is_string() ? width.as_string()
                        : std::string(static_cast<size_t>(need_int(width, "indent width")), ' ');
  const auto lines = splitlines(v.str() + "\n");
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind) + lines[i];
  }
  return Value(first ? ind + rv : rv);
}

// Filters longer than a few lines, out of the table in filters() so that it reads as a list.
Value join_filter(const Value& v, Args& a) {
  Binder b{a, "join"};
  const std::string sep = b.get(0, "d", Value("")).str();
  const Value attr = b.get(1, "attribute", Value::none());
  std::string out;
  bool first = true;
  for (const auto& e : iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += (attr.is_none() ? e : attr_path(e, attr)).str();
  }
  return Value(std::move(out));
}

// map(attribute=name[, default=x]) or map(filter_name, args...), as Jinja2 reads them.
Value map_filter(const Value& v, Args& a) {
  List out;
  for (const auto& kv : a.keyword) {
    if (kv.first != "attribute") continue;
    Value def;
    for (const auto& kw : a.keyword) {
      if (kw.first == "default") def = kw.second;
    }
    for (const auto& e : iterate(v)) {
      Value x = attr_path(e, kv.second);
      out.push_back(x.is_undefined() && !def.is_undefined() ? def : x);
    }
    return Value::list(std::move(out));
  }
  if (a.positional.empty()) throw EvalError("map needs a filter name or attribute=");
  const std::string name = need_str(a.positional[0], "filter name");
  for (const auto& e : iterate(v)) {
    Args fa = rest_args(a, 1);
    out.push_back(apply_filter(name, e, fa));
  }
  return Value::list(std::move(out));
}

Value reverse_filter(const Value& v, Args&) {
  if (v.is_string()) {
    auto cps = code_points(v.as_string());
    std::string out;
    for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
    return Value(std::move(out));
  }
  List items = iterate(v);
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value sort_filter(const Value& v, Args& a) {
  Binder b{a, "sort"};
  const bool reverse = b.get(0, "reverse", Value(false)).truthy();
  const bool case_sensitive = b.get(1, "case_sensitive", Value(false)).truthy();
  const Value attr = b.get(2, "attribute", Value::none());
  List items = iterate(v);
  auto key = [&](const Value& x) {
    Value k = attr.is_none() ? x : attr_path(x, attr);
    return !case_sensitive && k.is_string() ? Value(lower(k.as_string())) : k;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& l, const Value& r) {
    return reverse ? key(r).less(key(l)) : key(l).less(key(r));
  });
  return Value::list(std::move(items));
}

Value sum_filter(const Value& v, Args& a) {
  Binder b{a, "sum"};
  const Value attr = b.get(0, "attribute", Value::none());
  Value total = b.get(1, "start", Value(0));
  for (const auto& e : iterate(v)) {
    const Value x = attr.is_none() ? e : attr_path(e, attr);
    if (!x.is_number() || !total.is_number())
      throw EvalError("sum: unsupported operand type " + x.type_name());
    total = total.is_float() || x.is_float() ? Value(total.as_number() + x.as_number())
                                             : Value(total.as_int() + x.as_int());
  }
  return total;
}

Value round_filter(const Value& v, Args& a) {
  Binder b{a, "round"};
  const int64_t precision = need_int(b.get(0, "precision", Value(0)), "round precision");
  const std::string method = b.get(1, "method", Value("common")).str();
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_number() * scale;
  const double r = method == "ceil"    ? std::ceil(x)
                   : method == "floor" ? std::floor(x)
                                       : std::round(x);
  return Value(r / scale);
}

Value dictsort_filter(const Value& v, Args& a) {
  Binder b{a, "dictsort"};
  const bool case_sensitive = b.get(0, "case_sensitive", Value(false)).truthy();
  const bool by_value = b.get(1, "by", Value("key")).str() == "value";
  const bool reverse = b.get(2, "reverse", Value(false)).truthy();
  if (!v.is_dict()) throw EvalError("dictsort: can only sort a mapping");
  List items;
  for (const auto& [k, x] : v.as_dict()) items.push_back(Value::list({Value(k), x}, true));
  auto key = [&](const Value& p) {
    Value k = p.as_list()[by_value ? 1 : 0];
    return !case_sensitive && k.is_string() ? Value(lower(k.as_string())) : k;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& l, const Value& r) {
    return reverse ? key(r).less(key(l)) : key(l).less(key(r));
  });
  return Value::list(std::move(items));
}

const std::unordered_map<std::string, Filter>& filters() {
  static const std::unordered_map<std::string, Filter> kFilters = [] {
    std::unordered_map<std::string, Filter> f;
    f["default"] = [](const Value& v, Args& a) {
      Binder b{a, "default"};
      const Value def = b.get(0, "default_value", Value(""));
      const bool boolean = b.get(1, "boolean", Value(false)).truthy();
      return v.is_undefined() || (boolean && !v.truthy()) ? def : v;
    };
    f["d"] = f["default"];
    f["length"] = [](const Value& v, Args&) { return Value(length(v)); };
    f["count"] = f["length"];
    f["list"] = [](const Value& v, Args&) { return Value::list(iterate(v)); };
    f["string"] = [](const Value& v, Args&) { return Value(v.str()); };
    f["safe"] = [](const Value& v, Args&) { return v; };
    f["e"] = [](const Value& v, Args&) { return Value(html_escape(v.str())); };
    f["escape"] = f["e"];
    f["int"] = [](const Value& v, Args& a) {
      return to_int(v, Binder{a, "int"}.get(0, "default", Value(0)));
    };
    f["float"] = [](const Value& v, Args& a) {
      return to_float(v, Binder{a, "float"}.get(0, "default", Value(0.0)));
    };
    f["abs"] = [](const Value& v, Args&) {
      if (v.is_float()) return Value(std::fabs(v.as_number()));
      if (v.is_number() && v.as_int() != INT64_MIN)
        return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
      throw EvalError("bad operand type for abs(): '" + v.type_name() + "'");
    };
    f["trim"] = [](const Value& v, Args& a) {
      return Value(py_strip(v.str(), Binder{a, "trim"}.get(0, "chars", Value::none()), true, true));
    };
    f["lower"] = [](const Value& v, Args&) { return Value(lower(v.str())); };
    f["upper"] = [](const Value& v, Args&) { return Value(upper(v.str())); };
    f["capitalize"] = [](const Value& v, Args&) { return Value(capitalize(v.str())); };
    f["title"] = [](const Value& v, Args&) { return Value(jinja_title(v.str())); };
    f["replace"] = [](const Value& v, Args& a) {
      Binder b{a, "replace"};
      const Value count = b.get(2, "count", Value::none());
      return Value(py_replace(v.str(), b.get(0, "old").str(), b.get(1, "new").str(),
                              count.is_none() ? -1 : need_int(count, "count")));
    };
    f["join"] = join_filter;
    f["map"] = map_filter;
    f["select"] = [](const Value& v, Args& a) { return select_impl(v, a, false, true); };
    f["reject"] = [](const Value& v, Args& a) { return select_impl(v, a, false, false); };
    f["selectattr"] = [](const Value& v, Args& a) { return select_impl(v, a, true, true); };
    f["rejectattr"] = [](const Value& v, Args& a) { return select_impl(v, a, true, false); };
    f["first"] = [](const Value& v, Args&) {
      List items = iterate(v);
      return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
    };
    f["last"] = [](const Value& v, Args&) {
      List items = iterate(v);
      return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
    };
    f["items"] = [](const Value& v, Args&) {
      if (v.is_undefined()) return Value::list({});
      if (!v.is_dict()) throw EvalError("items filter: can only get item pairs from a mapping.");
      List out;
      for (const auto& [k, x] : v.as_dict()) out.push_back(Value::list({Value(k), x}, true));
      return Value::list(std::move(out));
    };
    f["reverse"] = reverse_filter;
    f["sort"] = sort_filter;
    f["unique"] = [](const Value& v, Args&) {
      List out;
      for (const auto& e : iterate(v)) {
        if (std::none_of(out.begin(), out.end(), [&](const Value& o) { return o.equals(e); }))
          out.push_back(e);
      }
      return Value::list(std::move(out));
    };
    f["min"] = [](const Value& v, Args&) {
      List items = iterate(v);
      if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
      return *std::min_element(items.begin(), items.end(),
                               [](const Value& l, const Value& r) { return l.less(r); });
    };
    f["max"] = [](const Value& v, Args&) {
      List items = iterate(v);
      if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
      return *std::max_element(items.begin(), items.end(),
                               [](const Value& l, const Value& r) { return l.less(r); });
    };
    f["sum"] = sum_filter;
    f["round"] = round_filter;
    f["indent"] = indent_filter;
    f["tojson"] = tojson;
    f["attr"] = [](const Value& v, Args& a) {
      return get_attr(v, need_str(Binder{a, "attr"}.get(0, "name"), "attr name"));
    };
    f["dictsort"] = dictsort_filter;
    return f;
  }();
  return kFilters;
}

using Test = std::function<bool(const Value&, Args&)>;

const std::unordered_map<std::string, Test>& tests() {
  static const std::unordered_map<std::string, Test> kTests = [] {
    std::unordered_map<std::string, Test> t;
    auto arg = [](Args& a) {
      if (a.positional.empty()) throw EvalError("test needs an argument");
      return a.positional[0];
    };
    t["defined"] = [](const Value& v, Args&) { return !v.is_undefined(); };
    t["undefined"] = [](const Value& v, Args&) { return v.is_undefined(); };
    t["none"] = [](const Value& v, Args&) { return v.is_none(); };
    t["boolean"] = [](const Value& v, Args&) { return v.is_bool(); };
    t["true"] = [](const Value& v, Args&) { return v.is_bool() && v.as_bool(); };
    t["false"] = [](const Value& v, Args&) { return v.is_bool() && !v.as_bool(); };
    t["integer"] = [](const Value& v, Args&) { return v.is_int(); };
    t["float"] = [](const Value& v, Args&) { return v.is_float(); };
    t["number"] = [](const Value& v, Args&) { return v.is_number(); };
    t["string"] = [](const Value& v, Args&) { return v.is_string(); };
    t["mapping"] = [](const Value& v, Args&) { return v.is_dict(); };
    t["iterable"] = [](const Value& v, Args&) {
      return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
    };
    t["sequence"] = [](const Value& v, Args&) {
      return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
    };
    t["callable"] = [](const Value& v, Args&) { return v.is_callable(); };
    t["escaped"] = [](const Value&, Args&) { return false; };
    t["odd"] = [](const Value& v, Args&) { return need_int(v, "odd test value") % 2 != 0; };
    t["even"] = [](const Value& v, Args&) { return need_int(v, "even test value") % 2 == 0; };
    t["divisibleby"] = [arg](const Value& v, Args& a) {
      const int64_t d = need_int(arg(a), "divisibleby argument");
      if (d == 0) throw EvalError("integer modulo by zero");
      return need_int(v, "divisibleby value") % d == 0;
    };
    t["lower"] = [](const Value& v, Args&) {
      const std::string s = v.str();
      return lower(s) == s && upper(s) != s;
    };
    t["upper"] = [](const Value& v, Args&) {
      const std::string s = v.str();
      return upper(s) == s && lower(s) != s;
    };
    t["eq"] = [arg](const Value& v, Args& a) { return v.equals(arg(a)); };
    t["equalto"] = t["=="] = t["eq"];
    t["ne"] = [arg](const Value& v, Args& a) { return !v.equals(arg(a)); };
    t["!="] = t["ne"];
    t["lt"] = [arg](const Value& v, Args& a) { return v.less(arg(a)); };
    t["lessthan"] = t["<"] = t["lt"];
    t["gt"] = [arg](const Value& v, Args& a) { return arg(a).less(v); };
    t["greaterthan"] = t[">"] = t["gt"];
    t["le"] = [arg](const Value& v, Args& a) { return !arg(a).less(v); };
    t["<="] = t["le"];
    t["ge"] = [arg](const Value& v, Args& a) { return !v.less(arg(a)); };
    t[">="] = t["ge"];
    t["sameas"] = [arg](const Value& v, Args& a) {
      const Value o = arg(a);
      // Python identity: singletons (None, True, False) and equal small values.
      return v.kind() == o.kind() && v.equals(o);
    };
    t["in"] = [arg](const Value& v, Args& a) {
      const Value c = arg(a);
      if (c.is_string())
        return c.as_string().find(need_str(v, "'in <string>' left operand")) != std::string::npos;
      if (c.is_dict()) return v.is_string() && c.find(v.as_string()) != nullptr;
      for (const auto& e : iterate(c)) {
        if (e.equals(v)) return true;
      }
      return false;
    };
    return t;
  }();
  return kTests;
}

}  // namespace

void fail_undefined(const Value& v) {
  const std::string& h = v.undefined_hint();
  throw EvalError(h.find(" is undefined") != std::string::npos ||
                          h.find("has no") != std::string::npos || h.find("No ") == 0 ||
                          h.find("has no element") != std::string::npos
                      ? h
                      : "'" + h + "' is undefined");
}

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      fail_undefined(obj);
    case Value::Kind::kString:
      return str_method(obj, name);
    case Value::Kind::kDict: {
      Value m = dict_method(obj, name);
      if (!m.is_undefined()) return m;
      const Value* v = obj.find(name);
      return v ? *v : undefined_attr(obj, name);
    }
    case Value::Kind::kNamespace: {
      for (const auto& [k, v] : obj.namespace_items()) {
        if (k == name) return v;
      }
      return undefined_attr(obj, name);
    }
    case Value::Kind::kList:
      return list_method(obj, name);
    default:
      return undefined_attr(obj, name);
  }
}

Value get_item(const Value& obj, const Value& key) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      fail_undefined(obj);
    case Value::Kind::kDict:
      if (key.is_string()) {
        const Value* v = obj.find(key.as_string());
        if (v) return *v;
        Value m = dict_method(obj, key.as_string());
        return m.is_undefined() ? undefined_attr(obj, key.as_string()) : m;
      }
      return Value::undefined(fmt::format("{} has no attribute {}", object_desc(obj), key.repr()));
    case Value::Kind::kList:
    case Value::Kind::kString:
      if (key.is_int() || key.is_bool()) {
        int64_t i = key.as_int();
        if (obj.is_list()) {
          const auto n = static_cast<int64_t>(obj.as_list().size());
          if (i < 0) i += n;
          if (i < 0 || i >= n) {
            return Value::undefined(
                fmt::format("{} has no element {}", object_desc(obj), key.as_int()));
          }
          return obj.as_list()[static_cast<size_t>(i)];
        }
        const auto cps = code_points(obj.as_string());
        const auto n = static_cast<int64_t>(cps.size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) {
          return Value::undefined(
              fmt::format("{} has no element {}", object_desc(obj), key.as_int()));
        }
        return Value(cps[static_cast<size_t>(i)]);
      }
      if (key.is_string()) return get_attr(obj, key.as_string());
      return Value::undefined(fmt::format("{} has no element {}", object_desc(obj), key.repr()));
    default:
      if (key.is_string()) return get_attr(obj, key.as_string());
      return Value::undefined(fmt::format("{} has no element {}", object_desc(obj), key.repr()));
  }
}

List iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      return v.as_list();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& kv : v.as_dict()) keys.emplace_back(kv.first);
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (auto cp : code_points(v.as_string())) chars.emplace_back(cp);
      return chars;
    }
    default:
      throw EvalError(fmt::format("'{}' object is not iterable", v.type_name()));
  }
}

Value apply_filter(const std::string& name, const Value& v, Args& args) {
  auto it = filters().find(name);
  if (it == filters().end()) throw EvalError(fmt::format("No filter named '{}'.", name));
  return it->second(v, args);
}

bool apply_test(const std::string& name, const Value& v, Args& args) {
  auto it = tests().find(name);
  if (it == tests().end()) throw EvalError(fmt::format("No test named '{}'.", name));
  return it->second(v, args);
}

bool has_filter(const std::string& name) { return filters().count(name) != 0; }
bool has_test(const std::string& name) { return tests().count(name) != 0; }

}  // namespace dflash::chat
