// chat: the syntax tree of a parsed template (internal to src/chat; template.h is the API).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/value.h"

namespace dflash::chat::ast {

struct Expr;
struct Node;
using ExprPtr = std::unique_ptr<Expr>;
using Body = std::vector<std::unique_ptr<Node>>;

struct Pos {
  int line = 1, col = 1;
};

struct Expr {
  enum class Kind {
    kLiteral,  // value
    kName,     // name
    kList,     // args
    kTuple,    // args
    kDict,     // args: key, value, key, value...
    kGetAttr,  // args[0].name
    kGetItem,  // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]] (null for omitted)
    kCall,     // args[0](args[1:], kwargs)
    kFilter,   // args[0]|name(args[1:], kwargs); args[0] null inside a filter block
    kTest,     // args[0] is [not] name(args[1:])
    kUnary,    // name ("-", "+", "not") args[0]
    kBinary,   // args[0] name args[1]: + - * / // % ** ~ and or
    kCompare,  // args[0] ops[0] args[1] ops[1] args[2]...
    kCond,     // args[0] if args[1] else args[2] (null: undefined)
  };
  Kind kind;
  Pos pos;
  std::string name;
  Value value;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  bool negated = false;
};

struct Node {
  enum class Kind {
    kText,         // text
    kOutput,       // {{ expr }}
    kIf,           // conds[i] -> bodies[i]; bodies.back() is else when bodies > conds
    kFor,          // for targets in expr [if cond] body [else else_body]
    kSet,          // set targets = expr; target "ns.attr" when attr is set
    kSetBlock,     // set targets[0] | filters: body
    kMacro,        // macro name(params = defaults) body
    kCallBlock,    // call(params) expr: body
    kFilterBlock,  // filter filters: body
    kGeneration,   // generation: body
    kBreak,
    kContinue,
  };
  Kind kind;
  Pos pos;
  std::string text;  // text, macro name
  ExprPtr expr, cond;
  std::vector<std::string> targets;  // for/set targets; "ns.attr" for attribute targets
  std::vector<ExprPtr> conds;
  std::vector<Body> bodies;
  Body body, else_body;
  // Macro and caller parameters with their defaults (null: required).
  std::vector<std::pair<std::string, ExprPtr>> params;
  std::vector<ExprPtr> filters;  // filter chain of a block set or filter block (kFilter nodes)
};

}  // namespace dflash::chat::ast
