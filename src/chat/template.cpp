// chat: the interpreter. Scoping follows jinja2's compiled code: `if` shares its scope, each
// for-loop iteration and each macro call gets a child scope (a `set` inside does not leak out,
// hence namespace()), the template's top level is one scope over the render variables.
#include "chat/template.h"

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "chat/ast.h"
#include "chat/builtins.h"
#include "chat/parser.h"

namespace dflash::chat {
namespace {

using ast::Body;
using ast::Expr;
using ast::Node;

struct Scope {
  std::shared_ptr<Scope> parent;
  Dict vars;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get()) {
      for (const auto& [k, v] : s->vars) {
        if (k == name) return &v;
      }
    }
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, x] : vars) {
      if (k == name) {
        x = std::move(v);
        return;
      }
    }
    vars.emplace_back(name, std::move(v));
  }
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { kNormal, kBreak, kContinue };

// Python ints are unbounded; templates never need more than 64 bits, so overflow is an error
// (not undefined behaviour).
int64_t checked(bool overflowed, int64_t v) {
  if (overflowed) throw EvalError("integer overflow (beyond 64 bits)");
  return v;
}
int64_t add(int64_t a, int64_t b) {
  int64_t r;
  const bool overflowed = __builtin_add_overflow(a, b, &r);
  return checked(overflowed, r);
}
int64_t sub(int64_t a, int64_t b) {
  int64_t r;
  const bool overflowed = __builtin_sub_overflow(a, b, &r);
  return checked(overflowed, r);
}
int64_t mul(int64_t a, int64_t b) {
  int64_t r;
  const bool overflowed = __builtin_mul_overflow(a, b, &r);
  return checked(overflowed, r);
}

int64_t floor_div(int64_t a, int64_t b) {
  if (a == INT64_MIN && b == -1) checked(true, 0);
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

Value arith(const std::string& op, const Value& l, const Value& r) {
  if (l.is_undefined()) fail_undefined(l);
  if (r.is_undefined()) fail_undefined(r);
  const bool nums = l.is_number() && r.is_number();
  const bool flt = nums && (l.is_float() || r.is_float());
  auto unsupported = [&]() -> Value {
    throw EvalError(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op,
                                l.type_name(), r.type_name()));
  };
  if (op == "+") {
    if (nums)
      return flt ? Value(l.as_number() + r.as_number()) : Value(add(l.as_int(), r.as_int()));
    if (l.is_string() && r.is_string()) return Value(l.as_string() + r.as_string());
    if (l.is_list() && r.is_list() && l.is_tuple() == r.is_tuple()) {
      List out = l.as_list();
      out.insert(out.end(), r.as_list().begin(), r.as_list().end());
      return Value::list(std::move(out), l.is_tuple());
    }
    if (l.is_string()) {
      throw EvalError(fmt::format("can only concatenate str (not \"{}\") to str", r.type_name()));
    }
    return unsupported();
  }
  if (op == "-") {
    if (!nums) return unsupported();
    return flt ? Value(l.as_number() - r.as_number()) : Value(sub(l.as_int(), r.as_int()));
  }
  if (op == "*") {
    if (nums)
      return flt ? Value(l.as_number() * r.as_number()) : Value(mul(l.as_int(), r.as_int()));
    const Value& seq = l.is_number() ? r : l;
    const Value& n = l.is_number() ? l : r;
    if (!n.is_int() && !n.is_bool()) return unsupported();
    const int64_t times = std::max<int64_t>(0, n.as_int());
    if (seq.is_string()) {
      if (static_cast<double>(seq.as_string().size()) * static_cast<double>(times) > 1e8) {
        throw EvalError("string repetition too large");
      }
      std::string out;
      for (int64_t i = 0; i < times; ++i) out += seq.as_string();
      return Value(std::move(out));
    }
    if (seq.is_list()) {
      if (static_cast<double>(seq.as_list().size()) * static_cast<double>(times) > 1e7) {
        throw EvalError("list repetition too large");
      }
      List out;
      for (int64_t i = 0; i < times; ++i)
        out.insert(out.end(), seq.as_list().begin(), seq.as_list().end());
      return Value::list(std::move(out), seq.is_tuple());
    }
    return unsupported();
  }
  if (!nums) {
    if (op == "%" && l.is_string())
      throw EvalError("printf-style string formatting ('%') is not supported");
    return unsupported();
  }
  if (op == "/") {
    if (r.as_number() == 0) throw EvalError("division by zero");
    return Value(l.as_number() / r.as_number());
  }
  if (op == "//") {
    if (r.as_number() == 0) throw EvalError("integer division or modulo by zero");
    if (flt) return Value(std::floor(l.as_number() / r.as_number()));
    return Value(floor_div(l.as_int(), r.as_int()));
  }
  if (op == "%") {
    if (r.as_number() == 0) throw EvalError("integer division or modulo by zero");
    if (flt) {
      const double m = std::fmod(l.as_number(), r.as_number());
      return Value(m != 0 && ((m < 0) != (r.as_number() < 0)) ? m + r.as_number() : m);
    }
    return Value(sub(l.as_int(), mul(floor_div(l.as_int(), r.as_int()), r.as_int())));
  }
  if (op == "**") {
    if (!flt && r.as_int() >= 0) {
      const int64_t b = l.as_int(), e = r.as_int();
      if (b == 0 || b == 1) return Value(e == 0 ? int64_t{1} : b);
      if (b == -1) return Value(e % 2 == 0 ? int64_t{1} : int64_t{-1});
      int64_t out = 1;  // |b| >= 2: overflows within 64 steps
      for (int64_t i = 0; i < r.as_int(); ++i) out = mul(out, l.as_int());
      return Value(out);
    }
    return Value(std::pow(l.as_number(), r.as_number()));
  }
  return unsupported();
}

bool contains(const Value& container, const Value& item) {
  if (container.is_string()) {
    if (!item.is_string()) {
      throw EvalError(
          fmt::format("'in <string>' requires string as left operand, not {}", item.type_name()));
    }
    return container.as_string().find(item.as_string()) != std::string::npos;
  }
  if (container.is_dict()) return item.is_string() && container.find(item.as_string()) != nullptr;
  if (container.is_undefined()) return false;
  if (!container.is_list()) {
    throw EvalError(fmt::format("argument of type '{}' is not iterable", container.type_name()));
  }
  for (const auto& e : container.as_list()) {
    if (e.equals(item)) return true;
  }
  return false;
}

bool compare(const std::string& op, const Value& l, const Value& r) {
  if (op == "==") return l.equals(r);
  if (op == "!=") return !l.equals(r);
  if (op == "in") return contains(r, l);
  if (op == "notin") return !contains(r, l);
  if (l.is_undefined()) fail_undefined(l);
  if (r.is_undefined()) fail_undefined(r);
  if (op == "<") return l.less(r);
  if (op == ">") return r.less(l);
  if (op == "<=") return !r.less(l);
  return !l.less(r);  // >=
}

int64_t clamp_index(int64_t i, int64_t n, bool neg_step) {
  if (i < 0) {
    i += n;
    if (i < 0) i = neg_step ? -1 : 0;
  } else if (i >= n) {
    i = neg_step ? n - 1 : n;
  }
  return i;
}

class Renderer {
 public:
  Renderer(const std::string& name, const RenderOptions& options, Rendered& result)
      : name_(name), options_(options), result_(result), out_(&result.text) {}

  void render(const Body& body, const Dict& variables) {
    auto root = std::make_shared<Scope>();
    root->vars = variables;
    add_globals(*root);
    try {
      exec(body, root);
    } catch (const RaisedError& e) {
      throw TemplateError(where() + e.what(), true);
    } catch (const TemplateError&) {
      throw;
    } catch (const dflash::Error& e) {
      throw TemplateError(where() + e.what(), false);
    }
  }

 private:
  std::string where() const { return fmt::format("{}:{}:{}: ", name_, pos_.line, pos_.col); }

  void add_globals(Scope& root) {
    auto global = [&](const char* name, Value::Function f) {
      if (!root.find(name)) root.vars.emplace_back(name, Value::function(name, std::move(f)));
    };
    global("raise_exception", [](Args& a) -> Value {
      throw RaisedError(a.positional.empty() ? std::string() : a.positional[0].str());
    });
    global("strftime_now", [this](Args& a) -> Value {
      if (a.positional.empty()) throw EvalError("strftime_now() missing the format argument");
      const std::time_t t = options_.now ? *options_.now : std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      const std::string fmt = a.positional[0].str();
      if (fmt.empty()) return Value("");
      std::string buf(256 + fmt.size() * 8, '\0');
      const size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &tm);
      buf.resize(n);
      return Value(std::move(buf));
    });
    global("namespace", [](Args& a) -> Value {
      Dict items;
      if (!a.positional.empty()) {
        if (!a.positional[0].is_dict())
          throw EvalError("namespace() takes a dict or keyword arguments");
        items = a.positional[0].as_dict();
      }
      for (auto& [k, v] : a.keyword) items.emplace_back(k, v);
      for (const auto& kv : items) {
        if (!kv.first.empty() && kv.first[0] == '_') {
          throw EvalError(
              fmt::format("Chat templates cannot store underscore-prefixed attributes on a "
                          "namespace, but got '{}'.",
                          kv.first));
        }
      }
      return Value::namespace_(std::move(items));
    });
    global("dict", [](Args& a) -> Value {
      Dict items;
      if (!a.positional.empty()) items = a.positional[0].as_dict();
      for (auto& [k, v] : a.keyword) items.emplace_back(k, v);
      return Value::dict(std::move(items));
    });
    global("range", [](Args& a) -> Value {
      int64_t start = 0, stop = 0, step = 1;
      auto num = [](const Value& v) {
        if (!v.is_int())
          throw EvalError("range() arguments must be integers, not " + v.type_name());
        return v.as_int();
      };
      if (a.positional.size() == 1) {
        stop = num(a.positional[0]);
      } else if (a.positional.size() >= 2) {
        start = num(a.positional[0]);
        stop = num(a.positional[1]);
        if (a.positional.size() > 2) step = num(a.positional[2]);
      }
      if (step == 0) throw EvalError("range() arg 3 must not be zero");
      List out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i = add(i, step)) {
        // jinja2's sandbox caps ranges at MAX_RANGE.
        if (out.size() >= 100000)
          throw EvalError(
              "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        out.emplace_back(i);
      }
      return Value::list(std::move(out));
    });
  }

  void write(std::string_view s) {
    if (out_->size() + s.size() > options_.max_output) {
      throw EvalError(fmt::format("output larger than the limit of {} bytes", options_.max_output));
    }
    out_->append(s);
  }

  Flow exec(const Body& body, const ScopePtr& scope) {
    for (const auto& n : body) {
      const Flow f = exec(*n, scope);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  // Renders `body` into a string of its own (block set, filter block, macro, caller).
  std::string capture(const Body& body, const ScopePtr& scope) {
    std::string buf;
    std::string* saved = out_;
    out_ = &buf;
    try {
      exec(body, scope);
    } catch (...) {
      out_ = saved;
      throw;
    }
    out_ = saved;
    return buf;
  }

  Flow exec(const Node& n, const ScopePtr& scope) {
    pos_ = n.pos;
    switch (n.kind) {
      case Node::Kind::kText:
        write(n.text);
        return Flow::kNormal;
      case Node::Kind::kOutput: {
        const Value v = eval(*n.expr, scope);
        pos_ = n.pos;
        if (v.is_string()) {
          write(v.as_string());
        } else {
          write(v.str());
        }
        return Flow::kNormal;
      }
      case Node::Kind::kIf:
        for (size_t i = 0; i < n.conds.size(); ++i) {
          if (eval(*n.conds[i], scope).truthy()) return exec(n.bodies[i], scope);
        }
        if (n.bodies.size() > n.conds.size()) return exec(n.bodies.back(), scope);
        return Flow::kNormal;
      case Node::Kind::kFor:
        exec_for(n, scope);
        return Flow::kNormal;
      case Node::Kind::kSet:
        assign(n, n.targets, eval(*n.expr, scope), scope);
        return Flow::kNormal;
      case Node::Kind::kSetBlock: {
        Value v(capture(n.body, scope));
        for (const auto& f : n.filters) v = eval_filter(*f, v, scope);
        assign(n, n.targets, std::move(v), scope);
        return Flow::kNormal;
      }
      case Node::Kind::kMacro:
        scope->set(n.text, make_macro(n, scope));
        return Flow::kNormal;
      case Node::Kind::kCallBlock: {
        const Node* node = &n;
        Value caller = Value::function("caller", [this, node, scope](Args& a) -> Value {
          return Value(invoke(*node, node->body, scope, a, Value()));
        });
        const Expr& call = *n.expr;
        const Value fn = eval(*call.args[0], scope);
        Args a = eval_args(call, 1, scope);
        a.keyword.emplace_back("caller", caller);
        pos_ = n.pos;
        if (!fn.is_callable()) throw EvalError("'call' needs a macro, got " + fn.type_name());
        write(fn.call(a).str());
        return Flow::kNormal;
      }
      case Node::Kind::kFilterBlock: {
        Value v(capture(n.body, scope));
        for (const auto& f : n.filters) v = eval_filter(*f, v, scope);
        write(v.str());
        return Flow::kNormal;
      }
      case Node::Kind::kGeneration: {
        const bool root = out_ == &result_.text;
        const size_t begin = out_->size();
        const Flow f = exec(n.body, scope);
        if (root) result_.generation_spans.emplace_back(begin, out_->size());
        return f;
      }
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void assign(const Node& n, const std::vector<std::string>& targets, Value v,
              const ScopePtr& scope) {
    if (targets.size() == 1) {
      assign_one(n, targets[0], std::move(v), scope);
      return;
    }
    const List items = iterate(v);
    if (items.size() != targets.size()) {
      throw EvalError(
          fmt::format("cannot unpack {} values into {} names", items.size(), targets.size()));
    }
    for (size_t i = 0; i < items.size(); ++i) assign_one(n, targets[i], items[i], scope);
  }

  void assign_one(const Node&, const std::string& target, Value v, const ScopePtr& scope) {
    const size_t dot = target.find('.');
    if (dot == std::string::npos) {
      scope->set(target, std::move(v));
      return;
    }
    const std::string obj = target.substr(0, dot), attr = target.substr(dot + 1);
    const Value* ns = scope->find(obj);
    if (!ns || !ns->is_namespace()) {
      throw EvalError(fmt::format("cannot assign attribute on non-namespace object '{}'", obj));
    }
    if (!attr.empty() && attr[0] == '_') {
      throw EvalError(
          fmt::format("Chat templates cannot store underscore-prefixed attributes on a namespace, "
                      "but got '{}'.",
                      attr));
    }
    for (auto& [k, x] : ns->namespace_items()) {
      if (k == attr) {
        x = std::move(v);
        return;
      }
    }
    ns->namespace_items().emplace_back(attr, std::move(v));
  }

  void exec_for(const Node& n, const ScopePtr& scope) {
    List items = iterate(eval(*n.expr, scope));
    if (n.cond) {
      List kept;
      for (auto& item : items) {
        auto s = std::make_shared<Scope>();
        s->parent = scope;
        bind_targets(n, item, *s);
        if (eval(*n.cond, s).truthy()) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec(n.else_body, scope);
      return;
    }
    const auto len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len; ++i) {
      auto s = std::make_shared<Scope>();
      s->parent = scope;
      const auto ui = static_cast<size_t>(i);
      Dict loop;
      loop.reserve(12);
      loop.emplace_back("index", Value(i + 1));
      loop.emplace_back("index0", Value(i));
      loop.emplace_back("revindex", Value(len - i));
      loop.emplace_back("revindex0", Value(len - i - 1));
      loop.emplace_back("first", Value(i == 0));
      loop.emplace_back("last", Value(i == len - 1));
      loop.emplace_back("length", Value(len));
      loop.emplace_back("depth", Value(1));
      loop.emplace_back("depth0", Value(0));
      loop.emplace_back("previtem",
                        i > 0 ? items[ui - 1] : Value::undefined("there is no previous item"));
      loop.emplace_back("nextitem",
                        i + 1 < len ? items[ui + 1] : Value::undefined("there is no next item"));
      loop.emplace_back("cycle", Value::function("cycle", [i](Args& a) -> Value {
                          if (a.positional.empty()) throw EvalError("no items for cycling given");
                          return a.positional[static_cast<size_t>(i) % a.positional.size()];
                        }));
      s->vars.emplace_back("loop", Value::dict(std::move(loop)));
      bind_targets(n, items[ui], *s);
      if (exec(n.body, s) == Flow::kBreak) break;
    }
  }

  void bind_targets(const Node& n, const Value& item, Scope& s) {
    if (n.targets.size() == 1) {
      s.set(n.targets[0], item);
      return;
    }
    const List parts = iterate(item);
    if (parts.size() != n.targets.size()) {
      throw EvalError(fmt::format("cannot unpack {} values into {} loop variables", parts.size(),
                                  n.targets.size()));
    }
    for (size_t k = 0; k < parts.size(); ++k) s.set(n.targets[k], parts[k]);
  }

  Value make_macro(const Node& n, const ScopePtr& scope) {
    const Node* node = &n;
    // Weak: the macro lives in the scope it closes over, and a strong reference would be a
    // cycle that leaks every render.
    std::weak_ptr<Scope> weak = scope;
    return Value::function(n.text, [this, node, weak](Args& a) -> Value {
      const ScopePtr scope = weak.lock();
      if (!scope) throw EvalError("macro '" + node->text + "' called after its scope ended");
      Value caller;
      for (auto it = a.keyword.begin(); it != a.keyword.end(); ++it) {
        if (it->first == "caller") {
          caller = it->second;
          a.keyword.erase(it);
          break;
        }
      }
      return Value(invoke(*node, node->body, scope, a, caller));
    });
  }

  // A macro or caller body with its parameters bound (missing ones take their defaults, else are
  // undefined; extras go to varargs / kwargs, as jinja2 does).
  std::string invoke(const Node& n, const Body& body, const ScopePtr& closure, Args& a,
                     const Value& caller) {
    if (++depth_ > options_.max_depth) {
      --depth_;
      throw EvalError(fmt::format("macro recursion deeper than {} calls", options_.max_depth));
    }
    auto s = std::make_shared<Scope>();
    s->parent = closure;
    List varargs;
    for (size_t i = 0; i < a.positional.size(); ++i) {
      if (i < n.params.size()) {
        s->set(n.params[i].first, a.positional[i]);
      } else {
        varargs.push_back(a.positional[i]);
      }
    }
    Dict kwargs;
    for (auto& [k, v] : a.keyword) {
      bool is_param = false;
      for (const auto& p : n.params) is_param = is_param || p.first == k;
      if (is_param) {
        s->set(k, v);
      } else {
        kwargs.emplace_back(k, v);
      }
    }
    for (size_t i = a.positional.size(); i < n.params.size(); ++i) {
      const auto& [pname, def] = n.params[i];
      bool given = false;
      for (const auto& kv : s->vars) given = given || kv.first == pname;
      if (given) continue;
      s->set(pname, def ? eval(*def, s) : Value::undefined("'" + pname + "' is undefined"));
    }
    s->set("varargs", Value::list(std::move(varargs)));
    s->set("kwargs", Value::dict(std::move(kwargs)));
    if (!caller.is_undefined()) s->set("caller", caller);
    const Pos saved = pos_;
    std::string out;
    try {
      out = capture(body, s);
    } catch (...) {
      --depth_;
      throw;
    }
    --depth_;
    pos_ = saved;
    return out;
  }

  using Pos = ast::Pos;

  Args eval_args(const Expr& e, size_t from, const ScopePtr& scope) {
    Args a;
    a.positional.reserve(e.args.size() - from);
    for (size_t i = from; i < e.args.size(); ++i) a.positional.push_back(eval(*e.args[i], scope));
    for (const auto& [k, x] : e.kwargs) a.keyword.emplace_back(k, eval(*x, scope));
    return a;
  }

  Value eval_filter(const Expr& f, const Value& v, const ScopePtr& scope) {
    Args a = eval_args(f, 1, scope);
    pos_ = f.pos;
    return apply_filter(f.name, v, a);
  }

  Value eval(const Expr& e, const ScopePtr& scope) {
    if (++depth_ > options_.max_depth * 4) {
      --depth_;
      throw EvalError("expression nested too deeply");
    }
    struct Guard {
      size_t& d;
      ~Guard() { --d; }
    } guard{depth_};
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.value;
      case Expr::Kind::kName: {
        const Value* v = scope->find(e.name);
        return v ? *v : Value::undefined("'" + e.name + "' is undefined");
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        List items;
        items.reserve(e.args.size());
        for (const auto& a : e.args) items.push_back(eval(*a, scope));
        return Value::list(std::move(items), e.kind == Expr::Kind::kTuple);
      }
      case Expr::Kind::kDict: {
        Dict items;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          const Value k = eval(*e.args[i], scope);
          Value v = eval(*e.args[i + 1], scope);
          if (!k.is_string()) {
            pos_ = e.args[i]->pos;
            throw EvalError("dict keys must be strings in chat templates, got " + k.type_name());
          }
          bool replaced = false;
          for (auto& kv : items) {
            if (kv.first == k.as_string()) {
              kv.second = v;
              replaced = true;
            }
          }
          if (!replaced) items.emplace_back(k.as_string(), std::move(v));
        }
        return Value::dict(std::move(items));
      }
      case Expr::Kind::kGetAttr: {
        const Value obj = eval(*e.args[0], scope);
        pos_ = e.pos;
        return get_attr(obj, e.name);
      }
      case Expr::Kind::kGetItem: {
        const Value obj = eval(*e.args[0], scope);
        const Value key = eval(*e.args[1], scope);
        pos_ = e.pos;
        return get_item(obj, key);
      }
      case Expr::Kind::kSlice:
        return slice(e, scope);
      case Expr::Kind::kCall: {
        const Value fn = eval(*e.args[0], scope);
        Args a = eval_args(e, 1, scope);
        pos_ = e.pos;
        if (fn.is_undefined()) fail_undefined(fn);
        if (!fn.is_callable())
          throw EvalError(fmt::format("'{}' object is not callable", fn.type_name()));
        return fn.call(a);
      }
      case Expr::Kind::kFilter:
        return eval_filter(e, eval(*e.args[0], scope), scope);
      case Expr::Kind::kTest: {
        const Value v = eval(*e.args[0], scope);
        Args a = eval_args(e, 1, scope);
        pos_ = e.pos;
        return Value(apply_test(e.name, v, a) != e.negated);
      }
      case Expr::Kind::kUnary: {
        const Value v = eval(*e.args[0], scope);
        pos_ = e.pos;
        if (e.name == "not") return Value(!v.truthy());
        if (v.is_undefined()) fail_undefined(v);
        if (!v.is_number())
          throw EvalError(
              fmt::format("bad operand type for unary {}: '{}'", e.name, v.type_name()));
        if (e.name == "+") return v.is_float() ? v : Value(v.as_int());
        return v.is_float() ? Value(-v.as_number()) : Value(sub(0, v.as_int()));
      }
      case Expr::Kind::kBinary: {
        const Value l = eval(*e.args[0], scope);
        if (e.name == "and") return l.truthy() ? eval(*e.args[1], scope) : l;
        if (e.name == "or") return l.truthy() ? l : eval(*e.args[1], scope);
        const Value r = eval(*e.args[1], scope);
        pos_ = e.pos;
        if (e.name == "~") return Value(l.str() + r.str());
        return arith(e.name, l, r);
      }
      case Expr::Kind::kCompare: {
        Value l = eval(*e.args[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value r = eval(*e.args[i + 1], scope);
          pos_ = e.pos;
          if (!compare(e.ops[i], l, r)) return Value(false);
          l = std::move(r);
        }
        return Value(true);
      }
      case Expr::Kind::kCond:
        if (eval(*e.args[1], scope).truthy()) return eval(*e.args[0], scope);
        return e.args[2] ? eval(*e.args[2], scope) : Value::undefined("the inline if had no else");
    }
    return Value();
  }

  Value slice(const Expr& e, const ScopePtr& scope) {
    const Value obj = eval(*e.args[0], scope);
    Value parts[3];
    for (int k = 0; k < 3; ++k) {
      if (e.args[static_cast<size_t>(k) + 1])
        parts[k] = eval(*e.args[static_cast<size_t>(k) + 1], scope);
    }
    pos_ = e.pos;
    if (obj.is_undefined()) fail_undefined(obj);
    auto num = [](const Value& v, int64_t def) {
      if (v.is_undefined() || v.is_none()) return def;
      if (!v.is_int() && !v.is_bool()) throw EvalError("slice indices must be integers or None");
      return v.as_int();
    };
    const int64_t step = num(parts[2], 1);
    if (step == 0) throw EvalError("slice step cannot be zero");
    std::vector<std::string_view> cps;
    int64_t n;
    if (obj.is_string()) {
      cps = code_points(obj.as_string());
      n = static_cast<int64_t>(cps.size());
    } else if (obj.is_list()) {
      n = static_cast<int64_t>(obj.as_list().size());
    } else {
      throw EvalError(fmt::format("'{}' object is not subscriptable", obj.type_name()));
    }
    const bool neg = step < 0;
    const int64_t start = parts[0].is_undefined() || parts[0].is_none()
                              ? (neg ? n - 1 : 0)
                              : clamp_index(num(parts[0], 0), n, neg);
    const int64_t stop = parts[1].is_undefined() || parts[1].is_none()
                             ? (neg ? -1 : n)
                             : clamp_index(num(parts[1], 0), n, neg);
    std::string s;
    List items;
    for (int64_t i = start; neg ? i > stop : i < stop;) {
      if (obj.is_string()) {
        s += cps[static_cast<size_t>(i)];
      } else {
        items.push_back(obj.as_list()[static_cast<size_t>(i)]);
      }
      if (__builtin_add_overflow(i, step, &i)) break;  // past either end
    }
    if (obj.is_string()) return Value(std::move(s));
    return Value::list(std::move(items), obj.is_tuple());
  }

  const std::string& name_;
  const RenderOptions& options_;
  Rendered& result_;
  std::string* out_;
  Pos pos_;
  size_t depth_ = 0;
};

}  // namespace

Dict hf_template_variables(const nlohmann::ordered_json& messages,
                           const nlohmann::ordered_json& tools, bool add_generation_prompt,
                           const Dict& kwargs) {
  if (!messages.is_array()) throw EvalError("messages must be a JSON array");
  List msgs;
  msgs.reserve(messages.size());
  for (const auto& m : messages) {
    if (!m.is_object()) throw EvalError("each message must be a JSON object, got " + m.dump());
    Dict d;
    d.reserve(m.size() + 2);
    const nlohmann::ordered_json* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
      auto it = m.find(key);
      if (!reasoning && it != m.end() && !it->is_null()) reasoning = &*it;
    }
    // {"thinking": r, **message, "reasoning_content": r}: "thinking" comes first.
    if (reasoning) d.emplace_back("thinking", Value::from_json(*reasoning));
    for (const auto& [k, v] : m.items()) {
      if (v.is_null()) continue;
      if (reasoning && (k == "thinking" || k == "reasoning_content")) {
        if (k == "thinking") d[0].second = Value::from_json(v);
        if (k == "reasoning_content") d.emplace_back(k, Value::from_json(*reasoning));
        continue;
      }
      d.emplace_back(k, Value::from_json(v));
    }
    const auto rc = m.find("reasoning_content");
    if (reasoning && (rc == m.end() || rc->is_null()))
      d.emplace_back("reasoning_content", Value::from_json(*reasoning));
    msgs.push_back(Value::dict(std::move(d)));
  }
  Dict vars;
  vars.emplace_back("messages", Value::list(std::move(msgs)));
  vars.emplace_back("tools", tools.is_null() ? Value::none() : Value::from_json(tools));
  vars.emplace_back("documents", Value::none());
  vars.emplace_back("add_generation_prompt", Value(add_generation_prompt));
  for (const auto& [k, v] : kwargs) {
    bool replaced = false;
    for (auto& kv : vars) {
      if (kv.first == k) {
        kv.second = v;
        replaced = true;
      }
    }
    if (!replaced) vars.emplace_back(k, v);
  }
  return vars;
}

Template::Template(std::string_view source, std::string name) : name_(std::move(name)) {
  body_ = std::make_shared<const Body>(parse_template(source, name_, has_generation_));
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

Rendered Template::render(const Dict& variables, const RenderOptions& options) const {
  Rendered result;
  Renderer(name_, options, result).render(*body_, variables);
  return result;
}

}  // namespace dflash::chat
