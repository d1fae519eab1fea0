// chat: lexer and parser, following jinja2 3.1's lexer (whitespace control, trim_blocks,
// lstrip_blocks, raw blocks, newline normalization, the dropped trailing newline) and its
// expression grammar and operator precedence.
#include "chat/parser.h"

#include <cctype>
#include <string>

#include "chat/ast.h"
#include "tokenizer/unicode.h"

namespace dflash::chat {
namespace {

using ast::Body;
using ast::Expr;
using ast::ExprPtr;
using ast::Node;
using ast::Pos;

struct Tok {
  enum Type {
    kData,
    kVarBegin,
    kVarEnd,
    kBlockBegin,
    kBlockEnd,
    kName,
    kString,
    kInt,
    kFloat,
    kOp,
    kEof
  };
  Type type;
  std::string value;
  Pos pos;
};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

std::string rstrip_ws(std::string_view s) {
  size_t n = s.size();
  while (n && is_space(s[n - 1])) --n;
  return std::string(s.substr(0, n));
}

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& name) : name_(name) {
    // jinja2 splits on \r\n, \r and \n, drops one trailing newline (keep_trailing_newline=False)
    // and joins with "\n".
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Tok> run() {
    size_t pos = 0;
    bool strip_next = false;
    while (pos <= src_.size()) {
      size_t p = find_tag(pos);
      std::string text = src_.substr(pos, p == std::string::npos ? std::string::npos : p - pos);
      if (strip_next) {
        size_t k = 0;
        while (k < text.size() && is_space(text[k])) ++k;
        text.erase(0, k);
        strip_next = false;
      }
      if (p == std::string::npos) {
        if (!text.empty()) push(Tok::kData, std::move(text), pos);
        break;
      }
      const char kind = src_[p + 1];
      const char ctrl = p + 2 < src_.size() ? src_[p + 2] : '\0';
      if (ctrl == '-') {
        text = rstrip_ws(text);
      } else if (ctrl != '+' && kind != '{') {
        // lstrip_blocks: whitespace between the line start and a block or comment tag goes.
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        const bool line_starting = pos == 0 || src_[pos - 1] == '\n';
        if ((l_pos > 0 || line_starting) && l_pos < text.size()) {
          bool blank = true;
          for (size_t k = l_pos; k < text.size(); ++k) blank = blank && is_space(text[k]);
          if (blank) text.resize(l_pos);
        }
      }
      if (!text.empty()) push(Tok::kData, std::move(text), pos);
      size_t q = p + 2 + (ctrl == '-' || ctrl == '+');
      if (kind == '#') {
        pos = comment_end(q, p, strip_next);
      } else if (kind == '%' && is_raw(q)) {
        pos = raw_block(q, p, strip_next);
      } else {
        pos = tag(kind, q, p, strip_next);
      }
    }
    toks_.push_back(Tok{Tok::kEof, "", pos_of(src_.size())});
    return std::move(toks_);
  }

 private:
  [[noreturn]] void error(size_t at, const std::string& what) const {
    const Pos p = pos_of(at);
    throw TemplateError(fmt::format("{}:{}:{}: {}", name_, p.line, p.col, what), false);
  }

  Pos pos_of(size_t at) const {
    // Tokens are produced in order, so a running cursor makes this linear overall.
    if (at < line_cursor_) {
      line_cursor_ = 0;
      line_ = 1;
      line_start_ = 0;
    }
    for (; line_cursor_ < at && line_cursor_ < src_.size(); ++line_cursor_) {
      if (src_[line_cursor_] == '\n') {
        ++line_;
        line_start_ = line_cursor_ + 1;
      }
    }
    return Pos{line_, static_cast<int>(at - line_start_) + 1};
  }

  void push(Tok::Type t, std::string v, size_t at) {
    toks_.push_back(Tok{t, std::move(v), pos_of(at)});
  }

  size_t find_tag(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string::npos;
  }

  // After a block or comment end: "-" strips the whitespace that follows; otherwise
  // trim_blocks drops one newline ("+" keeps it).
  size_t after_block_end(size_t q, char ctrl, bool& strip_next) const {
    if (ctrl == '-') {
      strip_next = true;
    } else if (ctrl != '+' && q < src_.size() && src_[q] == '\n') {
      ++q;
    }
    return q;
  }

  size_t comment_end(size_t q, size_t start, bool& strip_next) {
    const size_t e = src_.find("#}", q);
    if (e == std::string::npos) error(start, "unterminated comment (missing '#}')");
    const char ctrl = e > q && (src_[e - 1] == '-' || src_[e - 1] == '+') ? src_[e - 1] : '\0';
    return after_block_end(e + 2, ctrl, strip_next);
  }

  bool is_raw(size_t q) const {
    while (q < src_.size() && is_space(src_[q])) ++q;
    if (src_.compare(q, 3, "raw") != 0) return false;
    q += 3;
    while (q < src_.size() && is_space(src_[q])) ++q;
    if (q < src_.size() && src_[q] == '-') ++q;
    return src_.compare(q, 2, "%}") == 0;
  }

  size_t raw_block(size_t q, size_t start, bool& strip_next) {
    size_t e = src_.find("%}", q);
    bool dummy = false;
    size_t body = after_block_end(e + 2, src_[e - 1] == '-' ? '-' : '\0', dummy);
    if (dummy) {
      while (body < src_.size() && is_space(src_[body])) ++body;
    }
    // The body runs to the first {% endraw %} (with optional whitespace control).
    for (size_t i = src_.find("{%", body); i != std::string::npos; i = src_.find("{%", i + 2)) {
      size_t k = i + 2;
      const char open_ctrl = k < src_.size() ? src_[k] : '\0';
      if (open_ctrl == '-' || open_ctrl == '+') ++k;
      while (k < src_.size() && is_space(src_[k])) ++k;
      if (src_.compare(k, 6, "endraw") != 0) continue;
      k += 6;
      while (k < src_.size() && is_space(src_[k])) ++k;
      char close_ctrl = '\0';
      if (k < src_.size() && (src_[k] == '-' || src_[k] == '+')) close_ctrl = src_[k++];
      if (src_.compare(k, 2, "%}") != 0) continue;
      std::string text = src_.substr(body, i - body);
      if (open_ctrl == '-') text = rstrip_ws(text);
      if (!text.empty()) push(Tok::kData, std::move(text), body);
      return after_block_end(k + 2, close_ctrl, strip_next);
    }
    error(start, "missing {% endraw %} for this {% raw %}");
  }

  size_t tag(char kind, size_t q, size_t start, bool& strip_next) {
    const bool block = kind == '%';
    push(block ? Tok::kBlockBegin : Tok::kVarBegin, "", start);
    std::string brackets;  // the closers expected, innermost last
    size_t i = q;
    while (true) {
      while (i < src_.size() && is_space(src_[i])) ++i;
      if (i >= src_.size()) {
        error(start, block ? "unexpected end of template in a block tag (missing '%}')"
                           : "unexpected end of template in an expression (missing '}}')");
      }
      if (brackets.empty()) {
        const std::string_view end = block ? "%}" : "}}";
        for (char ctrl : {'-', '+', '\0'}) {
          if (ctrl == '+' && !block) continue;
          const size_t at = i + (ctrl ? 1 : 0);
          if ((!ctrl || src_[i] == ctrl) && src_.compare(at, 2, end) == 0) {
            push(block ? Tok::kBlockEnd : Tok::kVarEnd, "", i);
            if (!block) {
              if (ctrl == '-') strip_next = true;
              return at + 2;
            }
            return after_block_end(at + 2, ctrl, strip_next);
          }
        }
      }
      const char c = src_[i];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t j = i;
        while (j < src_.size() &&
               (std::isalnum(static_cast<unsigned char>(src_[j])) || src_[j] == '_'))
          ++j;
        push(Tok::kName, src_.substr(i, j - i), i);
        i = j;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        i = number(i);
      } else if (c == '\'' || c == '"') {
        i = string_literal(i);
      } else {
        static const char* const kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                           "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                           "]",  "{",  "}",  ",",  ".",  ":",  "|", ";"};
        bool found = false;
        for (const char* op : kOps) {
          const size_t n = std::char_traits<char>::length(op);
          if (src_.compare(i, n, op) == 0) {
            if (op[0] == '(' || op[0] == '[' || op[0] == '{') {
              brackets.push_back(op[0] == '(' ? ')' : op[0] == '[' ? ']' : '}');
            } else if (op[0] == ')' || op[0] == ']' || op[0] == '}') {
              if (brackets.empty()) error(i, fmt::format("unexpected '{}'", op[0]));
              if (brackets.back() != op[0]) {
                error(i, fmt::format("unexpected '{}', expected '{}'", op[0], brackets.back()));
              }
              brackets.pop_back();
            }
            push(Tok::kOp, op, i);
            i += n;
            found = true;
            break;
          }
        }
        if (!found) error(i, fmt::format("unexpected character '{}'", c));
      }
    }
  }

  size_t number(size_t i) {
    size_t j = i;
    auto digits = [&] {
      while (j < src_.size() &&
             (std::isdigit(static_cast<unsigned char>(src_[j])) || src_[j] == '_'))
        ++j;
    };
    digits();
    bool is_float = false;
    if (j + 1 < src_.size() && src_[j] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[j + 1]))) {
      is_float = true;
      ++j;
      digits();
    }
    if (j < src_.size() && (src_[j] == 'e' || src_[j] == 'E')) {
      size_t k = j + 1;
      if (k < src_.size() && (src_[k] == '+' || src_[k] == '-')) ++k;
      if (k < src_.size() && std::isdigit(static_cast<unsigned char>(src_[k]))) {
        is_float = true;
        j = k;
        digits();
      }
    }
    std::string text;
    for (size_t k = i; k < j; ++k) {
      if (src_[k] != '_') text += src_[k];
    }
    push(is_float ? Tok::kFloat : Tok::kInt, text, i);
    return j;
  }

  size_t string_literal(size_t i) {
    const char quote = src_[i];
    std::string out;
    size_t j = i + 1;
    for (; j < src_.size() && src_[j] != quote; ++j) {
      if (src_[j] != '\\' || j + 1 >= src_.size()) {
        out += src_[j];
        continue;
      }
      // Python's unicode-escape, as jinja2 decodes string literals.
      const char e = src_[++j];
      auto hex = [&](int n) {
        if (j + static_cast<size_t>(n) >= src_.size()) error(j, "truncated \\x/\\u escape");
        uint32_t cp = 0;
        for (size_t k = j + 1; k <= j + static_cast<size_t>(n); ++k) {
          const char h = src_[k];
          if (!std::isxdigit(static_cast<unsigned char>(h))) error(j, "invalid \\x/\\u escape");
          cp = cp * 16 + static_cast<uint32_t>(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
        }
        if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
          error(j, "escape is not a Unicode scalar value");
        }
        j += static_cast<size_t>(n);
        tok::append_utf8(out, static_cast<char32_t>(cp));
      };
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case '0':
          out += '\0';
          break;
        case '\n':
          break;
        case 'x':
          hex(2);
          break;
        case 'u':
          hex(4);
          break;
        case 'U':
          hex(8);
          break;
        default:
          out += '\\';
          out += e;
      }
    }
    if (j >= src_.size()) error(i, "unterminated string literal");
    push(Tok::kString, std::move(out), i);
    return j + 1;
  }

  const std::string& name_;
  std::string src_;
  std::vector<Tok> toks_;
  mutable size_t line_cursor_ = 0, line_start_ = 0;
  mutable int line_ = 1;
};

class Parser {
  // Nesting beyond this (expressions, blocks) is refused instead of overflowing the stack.
  static constexpr int kMaxDepth = 200;
  struct Nest {
    Parser& p;
    explicit Nest(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxDepth) p.error(p.cur().pos, "nested too deeply");
    }
    ~Nest() { --p.depth_; }
  };

 public:
  Parser(std::vector<Tok> toks, const std::string& name) : toks_(std::move(toks)), name_(name) {}

  Body parse_template(bool& has_generation) {
    Body body = parse_body({});
    has_generation = has_generation_;
    return body;
  }

 private:
  const Tok& cur() const { return toks_[i_]; }
  const Tok& peek(size_t k = 1) const { return toks_[std::min(i_ + k, toks_.size() - 1)]; }
  Tok next() { return toks_[i_ < toks_.size() - 1 ? i_++ : i_]; }

  [[noreturn]] void error(Pos p, const std::string& what) const {
    throw TemplateError(fmt::format("{}:{}:{}: {}", name_, p.line, p.col, what), false);
  }

  std::string describe(const Tok& t) const {
    switch (t.type) {
      case Tok::kEof:
        return "end of template";
      case Tok::kBlockEnd:
        return "end of statement block";
      case Tok::kVarEnd:
        return "end of print statement";
      case Tok::kData:
        return "template data";
      case Tok::kString:
        return "string";
      default:
        return "'" + t.value + "'";
    }
  }

  bool is_op(const char* op) const { return cur().type == Tok::kOp && cur().value == op; }
  bool is_name(const char* n) const { return cur().type == Tok::kName && cur().value == n; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    ++i_;
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    ++i_;
    return true;
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) error(cur().pos, fmt::format("expected '{}', got {}", op, describe(cur())));
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) error(cur().pos, "expected a name, got " + describe(cur()));
    return next().value;
  }
  void expect_block_end() {
    if (cur().type != Tok::kBlockEnd) {
      error(cur().pos, "expected end of statement block, got " + describe(cur()));
    }
    ++i_;
  }

  // Parses nodes until a block tag whose keyword is in `enders` (left unconsumed in ender_,
  // with the tokens after it) or the end of the template.
  Body parse_body(const std::vector<std::string_view>& enders) {
    Body body;
    while (true) {
      const Tok& t = cur();
      if (t.type == Tok::kEof) {
        if (!enders.empty()) {
          std::string want;
          for (size_t k = 0; k < enders.size(); ++k) {
            want += fmt::format("{}'{{% {} %}}'",
                                k == 0                   ? ""
                                : k + 1 == enders.size() ? " or "
                                                         : ", ",
                                std::string(enders[k]));
          }
          error(t.pos, "unexpected end of template: expected " + want);
        }
        return body;
      }
      if (t.type == Tok::kData) {
        auto n = node(Node::Kind::kText, t.pos);
        n->text = t.value;
        ++i_;
        body.push_back(std::move(n));
      } else if (t.type == Tok::kVarBegin) {
        auto n = node(Node::Kind::kOutput, t.pos);
        ++i_;
        n->expr = parse_tuple_or_expr();
        if (cur().type != Tok::kVarEnd) {
          error(cur().pos, "expected end of print statement, got " + describe(cur()));
        }
        ++i_;
        body.push_back(std::move(n));
      } else {
        const Pos pos = t.pos;
        ++i_;
        if (cur().type != Tok::kName) error(cur().pos, "expected a statement name");
        const std::string kw = cur().value;
        for (auto e : enders) {
          if (kw == e) {
            ++i_;
            ender_ = kw;
            return body;
          }
        }
        ++i_;
        body.push_back(statement(kw, pos));
      }
    }
  }

  std::unique_ptr<Node> node(Node::Kind k, Pos p) {
    auto n = std::make_unique<Node>();
    n->kind = k;
    n->pos = p;
    return n;
  }

  std::unique_ptr<Node> statement(const std::string& kw, Pos pos) {
    const Nest nest(*this);
    if (kw == "if") return if_statement(pos);
    if (kw == "for") return for_statement(pos);
    if (kw == "set") return set_statement(pos);
    if (kw == "macro") return macro_statement(pos);
    if (kw == "call") return call_statement(pos);
    if (kw == "filter") {
      auto n = node(Node::Kind::kFilterBlock, pos);
      n->filters = filter_chain(true);
      expect_block_end();
      n->body = parse_body({"endfilter"});
      expect_block_end();
      return n;
    }
    if (kw == "generation") {
      auto n = node(Node::Kind::kGeneration, pos);
      has_generation_ = true;
      expect_block_end();
      n->body = parse_body({"endgeneration"});
      expect_block_end();
      return n;
    }
    if (kw == "break" || kw == "continue") {
      if (loop_depth_ == 0) error(pos, "'" + kw + "' outside of a for loop");
      auto n = node(kw == "break" ? Node::Kind::kBreak : Node::Kind::kContinue, pos);
      expect_block_end();
      return n;
    }
    error(pos, fmt::format("unknown or unsupported tag '{}' (chat templates support if, for, "
                           "set, macro, call, filter, raw, generation, break, continue)",
                           kw));
  }

  std::unique_ptr<Node> if_statement(Pos pos) {
    auto n = node(Node::Kind::kIf, pos);
    n->conds.push_back(parse_tuple_or_expr());
    expect_block_end();
    while (true) {
      n->bodies.push_back(parse_body({"elif", "else", "endif"}));
      if (ender_ == "elif") {
        n->conds.push_back(parse_tuple_or_expr());
        expect_block_end();
      } else if (ender_ == "else") {
        expect_block_end();
        n->bodies.push_back(parse_body({"endif"}));
        expect_block_end();
        return n;
      } else {
        expect_block_end();
        return n;
      }
    }
  }

  std::vector<std::string> assign_targets() {
    std::vector<std::string> t;
    const bool paren = skip_op("(");
    do {
      std::string name = expect_name();
      if (skip_op(".")) name += "." + expect_name();
      t.push_back(std::move(name));
    } while (skip_op(","));
    if (paren) expect_op(")");
    return t;
  }

  std::unique_ptr<Node> for_statement(Pos pos) {
    auto n = node(Node::Kind::kFor, pos);
    n->targets = assign_targets();
    for (const auto& t : n->targets) {
      if (t.find('.') != std::string::npos) error(pos, "a for loop cannot assign to '" + t + "'");
    }
    if (!skip_name("in")) error(cur().pos, "expected 'in' in the for loop, got " + describe(cur()));
    n->expr = parse_tuple_or_expr(/*with_condexpr=*/false);
    if (skip_name("if")) n->cond = parse_expr();
    if (is_name("recursive")) error(cur().pos, "recursive for loops are not supported");
    expect_block_end();
    ++loop_depth_;
    n->body = parse_body({"endfor", "else"});
    --loop_depth_;
    if (ender_ == "else") {
      expect_block_end();
      n->else_body = parse_body({"endfor"});
    }
    expect_block_end();
    return n;
  }

  std::unique_ptr<Node> set_statement(Pos pos) {
    std::vector<std::string> targets = assign_targets();
    if (skip_op("=")) {
      auto n = node(Node::Kind::kSet, pos);
      n->targets = std::move(targets);
      n->expr = parse_tuple_or_expr();
      expect_block_end();
      return n;
    }
    if (targets.size() != 1) error(pos, "a block set assigns exactly one name");
    auto n = node(Node::Kind::kSetBlock, pos);
    n->targets = std::move(targets);
    if (is_op("|")) n->filters = filter_chain(false);
    expect_block_end();
    n->body = parse_body({"endset"});
    expect_block_end();
    return n;
  }

  void params(Node& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (!n.params.empty()) expect_op(",");
      std::string name = expect_name();
      ExprPtr def;
      if (skip_op("=")) def = parse_expr();
      n.params.emplace_back(std::move(name), std::move(def));
    }
    expect_op(")");
  }

  std::unique_ptr<Node> macro_statement(Pos pos) {
    auto n = node(Node::Kind::kMacro, pos);
    n->text = expect_name();
    params(*n);
    expect_block_end();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    n->body = parse_body({"endmacro"});
    loop_depth_ = saved;
    expect_block_end();
    return n;
  }

  std::unique_ptr<Node> call_statement(Pos pos) {
    auto n = node(Node::Kind::kCallBlock, pos);
    if (is_op("(")) params(*n);
    n->expr = parse_expr();
    if (n->expr->kind != Expr::Kind::kCall) error(pos, "expected a call after 'call'");
    expect_block_end();
    n->body = parse_body({"endcall"});
    expect_block_end();
    return n;
  }

  // `| f1(args) | f2` (the leading "|" optional for the filter tag).
  std::vector<ExprPtr> filter_chain(bool first_bare) {
    std::vector<ExprPtr> out;
    bool first = true;
    while ((first && first_bare) || skip_op("|")) {
      first = false;
      out.push_back(filter(nullptr));
    }
    return out;
  }

  ExprPtr expr(Expr::Kind k, Pos p) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->pos = p;
    return e;
  }

  // Top-level expression of a print, if, set: a bare tuple "a, b" is allowed.
  ExprPtr parse_tuple_or_expr(bool with_condexpr = true) {
    const Pos pos = cur().pos;
    ExprPtr first = with_condexpr ? parse_expr() : parse_or();
    if (!is_op(",")) return first;
    auto t = expr(Expr::Kind::kTuple, pos);
    t->args.push_back(std::move(first));
    while (skip_op(",")) {
      if (cur().type == Tok::kBlockEnd || cur().type == Tok::kVarEnd || is_name("if")) break;
      t->args.push_back(with_condexpr ? parse_expr() : parse_or());
    }
    return t;
  }

  ExprPtr parse_expr() {
    const Nest nest(*this);
    const Pos pos = cur().pos;
    ExprPtr e = parse_or();
    while (is_name("if")) {
      ++i_;
      auto c = expr(Expr::Kind::kCond, pos);
      c->args.push_back(std::move(e));
      c->args.push_back(parse_or());
      c->args.push_back(skip_name("else") ? parse_expr() : nullptr);
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(const char* op, ExprPtr l, ExprPtr r, Pos p) {
    auto e = expr(Expr::Kind::kBinary, p);
    e->name = op;
    e->args.push_back(std::move(l));
    e->args.push_back(std::move(r));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr l = parse_and();
    while (is_name("or")) {
      const Pos p = next().pos;
      l = binary("or", std::move(l), parse_and(), p);
    }
    return l;
  }

  ExprPtr parse_and() {
    ExprPtr l = parse_not();
    while (is_name("and")) {
      const Pos p = next().pos;
      l = binary("and", std::move(l), parse_not(), p);
    }
    return l;
  }

  ExprPtr parse_not() {
    const Nest nest(*this);
    if (is_name("not")) {
      auto e = expr(Expr::Kind::kUnary, next().pos);
      e->name = "not";
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const Pos pos = cur().pos;
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().type == Tok::kOp &&
          (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
           cur().value == "<=" || cur().value == ">" || cur().value == ">=")) {
        op = next().value;
      } else if (is_name("in")) {
        ++i_;
        op = "in";
      } else if (is_name("not") && peek().type == Tok::kName && peek().value == "in") {
        i_ += 2;
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = expr(Expr::Kind::kCompare, pos);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprPtr parse_math1() {
    ExprPtr l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Tok t = next();
      l = binary(t.value == "+" ? "+" : "-", std::move(l), parse_concat(), t.pos);
    }
    return l;
  }

  ExprPtr parse_concat() {
    ExprPtr l = parse_math2();
    while (is_op("~")) {
      const Pos p = next().pos;
      l = binary("~", std::move(l), parse_math2(), p);
    }
    return l;
  }

  ExprPtr parse_math2() {
    ExprPtr l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Tok t = next();
      static const char* const kOps[] = {"*", "/", "//", "%"};
      const char* op = kOps[0];
      for (const char* o : kOps) {
        if (t.value == o) op = o;
      }
      l = binary(op, std::move(l), parse_pow(), t.pos);
    }
    return l;
  }

  ExprPtr parse_pow() {
    ExprPtr l = parse_unary(true);
    while (is_op("**")) {
      const Pos p = next().pos;
      l = binary("**", std::move(l), parse_unary(true), p);
    }
    return l;
  }

  ExprPtr parse_unary(bool with_filter) {
    const Nest nest(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Tok t = next();
      e = expr(Expr::Kind::kUnary, t.pos);
      e->name = t.value;
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Tok t = cur();
    switch (t.type) {
      case Tok::kName: {
        ++i_;
        auto e = expr(Expr::Kind::kLiteral, t.pos);
        if (t.value == "true" || t.value == "True") {
          e->value = Value(true);
        } else if (t.value == "false" || t.value == "False") {
          e->value = Value(false);
        } else if (t.value == "none" || t.value == "None") {
          e->value = Value::none();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = t.value;
        }
        return e;
      }
      case Tok::kString: {
        std::string s;
        while (cur().type == Tok::kString) s += next().value;  // adjacent literals concatenate
        auto e = expr(Expr::Kind::kLiteral, t.pos);
        e->value = Value(std::move(s));
        return e;
      }
      case Tok::kInt:
      case Tok::kFloat: {
        ++i_;
        auto e = expr(Expr::Kind::kLiteral, t.pos);
        try {
          e->value = t.type == Tok::kInt ? Value(static_cast<int64_t>(std::stoll(t.value)))
                                         : Value(std::stod(t.value));
        } catch (const std::out_of_range&) {
          error(t.pos, "number literal out of range: " + t.value);
        }
        return e;
      }
      case Tok::kOp:
        if (t.value == "(") {
          ++i_;
          if (skip_op(")")) return expr(Expr::Kind::kTuple, t.pos);
          ExprPtr first = parse_expr();
          if (skip_op(")")) return first;
          auto tup = expr(Expr::Kind::kTuple, t.pos);
          tup->args.push_back(std::move(first));
          while (skip_op(",")) {
            if (is_op(")")) break;
            tup->args.push_back(parse_expr());
          }
          expect_op(")");
          return tup;
        }
        if (t.value == "[") {
          ++i_;
          auto l = expr(Expr::Kind::kList, t.pos);
          while (!is_op("]")) {
            if (!l->args.empty()) {
              expect_op(",");
              if (is_op("]")) break;
            }
            l->args.push_back(parse_expr());
          }
          expect_op("]");
          return l;
        }
        if (t.value == "{") {
          ++i_;
          auto d = expr(Expr::Kind::kDict, t.pos);
          while (!is_op("}")) {
            if (!d->args.empty()) {
              expect_op(",");
              if (is_op("}")) break;
            }
            d->args.push_back(parse_expr());
            expect_op(":");
            d->args.push_back(parse_expr());
          }
          expect_op("}");
          return d;
        }
        break;
      default:
        break;
    }
    error(t.pos, "unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        const Pos p = next().pos;
        auto a = expr(Expr::Kind::kGetAttr, p);
        if (cur().type == Tok::kName) {
          a->name = next().value;
        } else if (cur().type == Tok::kInt) {
          a->kind = Expr::Kind::kGetItem;
          auto idx = expr(Expr::Kind::kLiteral, cur().pos);
          try {
            idx->value = Value(static_cast<int64_t>(std::stoll(cur().value)));
          } catch (const std::out_of_range&) {
            error(cur().pos, "index out of range: " + cur().value);
          }
          ++i_;
          a->args.push_back(std::move(e));
          a->args.push_back(std::move(idx));
          e = std::move(a);
          continue;
        } else {
          error(cur().pos, "expected an attribute name after '.'");
        }
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (is_op("[")) {
        e = subscript(std::move(e));
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr subscript(ExprPtr target) {
    const Pos p = next().pos;
    ExprPtr parts[3];
    bool slice = false;
    for (int k = 0; k < 3; ++k) {
      if (!is_op(":") && !is_op("]")) parts[k] = parse_expr();
      if (k < 2 && skip_op(":")) {
        slice = true;
      } else {
        break;
      }
    }
    expect_op("]");
    auto e = expr(slice ? Expr::Kind::kSlice : Expr::Kind::kGetItem, p);
    e->args.push_back(std::move(target));
    if (slice) {
      for (auto& part : parts) e->args.push_back(std::move(part));
    } else {
      if (!parts[0]) error(p, "empty subscript");
      e->args.push_back(std::move(parts[0]));
    }
    return e;
  }

  void call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (!e.args.empty() || !e.kwargs.empty()) {
        expect_op(",");
        if (is_op(")")) break;  // a trailing comma
      }
      if (is_op("*") || is_op("**"))
        error(cur().pos, "*args and **kwargs in calls are not supported");
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().value == "=") {
        std::string k = next().value;
        ++i_;
        e.kwargs.emplace_back(std::move(k), parse_expr());
      } else {
        if (!e.kwargs.empty()) error(cur().pos, "positional argument after a keyword argument");
        e.args.push_back(parse_expr());
      }
    }
    expect_op(")");
  }

  ExprPtr call(ExprPtr callee) {
    auto e = expr(Expr::Kind::kCall, cur().pos);
    e->args.push_back(std::move(callee));
    // The callee is args[0]; call_args counts arguments, so parse them into a scratch node.
    Expr scratch;
    scratch.kind = Expr::Kind::kFilter;
    call_args(scratch);
    for (auto& a : scratch.args) e->args.push_back(std::move(a));
    e->kwargs = std::move(scratch.kwargs);
    return e;
  }

  ExprPtr filter(ExprPtr target) {
    const Pos p = cur().pos;
    std::string name = expect_name();
    while (skip_op(".")) name += "." + expect_name();
    auto f = expr(Expr::Kind::kFilter, p);
    f->name = std::move(name);
    Expr scratch;
    scratch.kind = Expr::Kind::kFilter;
    if (is_op("(")) call_args(scratch);
    f->args.push_back(std::move(target));
    for (auto& a : scratch.args) f->args.push_back(std::move(a));
    f->kwargs = std::move(scratch.kwargs);
    return f;
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (skip_op("|")) {
        e = filter(std::move(e));
      } else if (is_name("is")) {
        const Pos p = next().pos;
        auto t = expr(Expr::Kind::kTest, p);
        t->negated = skip_name("not");
        t->name = expect_name();
        while (skip_op(".")) t->name += "." + expect_name();
        t->args.push_back(std::move(e));
        if (is_op("(")) {
          Expr scratch;
          scratch.kind = Expr::Kind::kFilter;
          call_args(scratch);
          for (auto& a : scratch.args) t->args.push_back(std::move(a));
          t->kwargs = std::move(scratch.kwargs);
        } else if ((cur().type == Tok::kName || cur().type == Tok::kString ||
                    cur().type == Tok::kInt || cur().type == Tok::kFloat || is_op("[") ||
                    is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) error(cur().pos, "'is' cannot follow a test name");
          t->args.push_back(parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Tok> toks_;
  size_t i_ = 0;
  const std::string& name_;
  std::string ender_;
  int loop_depth_ = 0;
  int depth_ = 0;
  bool has_generation_ = false;
};

}  // namespace

ast::Body parse_template(std::string_view source, const std::string& name, bool& has_generation) {
  return Parser(Lexer(source, name).run(), name).parse_template(has_generation);
}

}  // namespace dflash::chat
