#!/usr/bin/env python3
"""Lists the functions in src/ (host code: *.cpp and *.h; CUDA device code in *.cu/*.cuh is not
looked at) longer than a limit, 150 lines by default (issue 36: a function that long does
several jobs, and each should have a name). Exits 1 when one is found that the allowlist does
not name, or when the allowlist names one that is no longer over the limit (so the list shrinks
as functions are split instead of hiding new growth).

It is not a C++ parser. The heuristic, enough for this code base:
- Comments, string literals (raw strings included), character literals and preprocessor lines
  (with their continuations) are blanked out first, keeping the line breaks, so that braces in
  them do not count.
- The text is then read brace by brace. The "head" of a `{` is the text since the last `;`,
  `{` or `}` read at namespace or class scope (an access specifier `public:` dropped):
  - a head starting with namespace/class/struct/union/enum/extern (after an optional
    template<...>) opens a scope, read on the same way (so class members count);
  - a `{` inside the head's open parenthesis or bracket (a default argument `x = {}`) or a
    constructor's member initialiser written with braces (`: a_{a}`, a `{` right after a name)
    is part of the head: skipped to its matching `}`;
  - a head with a parenthesis and no top-level `=` is a function, and so is one whose `=` is
    followed by a lambda (`auto f = [](int x) {`): its body runs to the matching `}`, whatever
    it holds (lambdas and local classes are part of it);
  - any other `{` (an initialiser `T table[] = {...}`, with or without parentheses) is data,
    skipped to its matching `}`.
  A brace never closed is reported as a problem of its file.
- A function's length is its lines from the first line of its head that is not blank to the
  line of its closing brace, both counted.
- Its name is the (qualified) identifier before the parameter list: the last top-level
  `( ... )` of the head, before a constructor's ` : ` init list.

Usage: long_functions.py [--limit N] [--allow FILE] [ROOT]
The allowlist holds one `path:name` a line (path relative to ROOT, as printed); `#` starts a
comment.
"""
import argparse
import pathlib
import re
import sys


def blank(text):
    """The text with comments, literals and preprocessor lines replaced by spaces (line breaks
    kept, so positions still give line numbers)."""
    out = list(text)
    i, n = 0, len(text)

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    at_line_start = True
    while i < n:
        c = text[i]
        if c == "\n":
            at_line_start = True
            i += 1
            continue
        if at_line_start and c == "#":
            j = i
            while j < n and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            wipe(i, min(j, n))
            i = j
            continue
        if not c.isspace():
            at_line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            wipe(i, j)
            i = j
        elif (c == "R" and text.startswith('"', i + 1)
              and not (i and (text[i - 1].isalnum() or text[i - 1] == "_"))):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            wipe(i, j)
            i = j
        elif c == '"' or (c == "'" and not (i and text[i - 1].isalnum())):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            wipe(i, j + 1)
            i = j + 1
        else:
            i += 1
    return "".join(out)


SCOPE = re.compile(r"^(?:template\s*<.*>\s*)?(?:namespace|class|struct|union|enum|extern)\b", re.S)
ACCESS = re.compile(r"^\s*(?:public|private|protected)\s*:(?!:)")
QUALIFIERS = {"const", "noexcept", "override", "final", "mutable", "volatile", "try"}


def matching(text, i, open_, close):
    """Index of the bracket closing the one at i (scanning forward or backward)."""
    step = 1 if text[i] == open_ else -1
    depth = 0
    while 0 <= i < len(text):
        if text[i] in (open_, close):
            depth += 1 if text[i] == (open_ if step > 0 else close) else -1
            if depth == 0:
                return i
        i += step
    return -1


def init_list_start(head):
    """Index of a constructor's init-list colon in head (a single `:` after the parameter list at
    paren depth 0), or -1."""
    depth = 0
    seen_params = False
    for k, c in enumerate(head):
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
            seen_params = seen_params or depth == 0
        elif c == ":" and depth == 0 and seen_params:
            if head[k - 1 : k] != ":" and head[k + 1 : k + 2] != ":":
                return k
    return -1


def open_brackets(head):
    """Whether head leaves a ( or [ open: a brace there is a default argument or an initialiser
    inside the signature."""
    return head.count("(") > head.count(")") or head.count("[") > head.count("]")


def assigned(head):
    """What follows a top-level `=` of head (outside (), [] and <>; operator= and comparisons
    are not one), or None: `auto f = [](...) {` is a lambda, `T table[] = {` data."""
    text = re.sub(r"\boperator\s*(?:[^\s(]+|\(\))", "operator", head)
    depth = 0
    for k, c in enumerate(text):
        if c in "([<":
            depth += 1
        elif c in ")]>":
            depth -= 1
        elif (c == "=" and depth == 0 and text[k - 1 : k] not in ("=", "!", "<", ">")
              and text[k + 1 : k + 2] != "="):
            return text[k + 1 :].strip()
    return None


def is_function(head):
    """A head with a parenthesis: a function unless it assigns something other than a lambda."""
    rhs = assigned(head)
    return rhs is None or rhs.startswith("[")


def name_of(head):
    lhs = assigned(head)
    if lhs is not None:  # a lambda: named by what it is bound to
        m = re.search(r"([A-Za-z_]\w*)\s*=", head)
        return m.group(1) if m else "?"

    colon = init_list_start(head)
    sig = head if colon < 0 else head[:colon]
    close = sig.rfind(")")
    if close < 0:
        return "?"
    open_ = matching(sig, close, "(", ")")
    qualified = r"(?:[A-Za-z_~]\w*\s*(?:<[^<>]*>)?\s*::\s*)*"
    m = re.search(r"(" + qualified + r"(?:operator\s*\S+?|~?[A-Za-z_]\w*))\s*$", sig[:open_])
    return re.sub(r"\s+", "", m.group(1)) if m else "?"


def functions(text):
    """(name, first line, last line) of every function at namespace or class scope."""
    code = blank(text)
    line_of = lambda pos: code.count("\n", 0, pos) + 1
    found = []
    head_start = 0
    i, n = 0, len(code)
    while i < n:
        c = code[i]
        if c in ";}":
            head_start = i + 1
        elif c == "{":
            opened = i
            head = ACCESS.sub(lambda m: " " * len(m.group(0)), code[head_start:i])
            stripped = head.strip()
            if SCOPE.match(stripped):
                head_start = i + 1  # read the scope's contents the same way
            elif open_brackets(stripped):
                i = matching(code, i, "{", "}")  # a default argument f(x = {}): still the head
            elif "(" in stripped and is_function(stripped):
                word = re.search(r"([\w>]+)$", stripped)
                if (init_list_start(stripped) >= 0 and word and word.group(1) not in QUALIFIERS
                        and not stripped.endswith(")")):
                    i = matching(code, i, "{", "}")  # a member initialiser x_{a}: still the head
                else:
                    i = matching(code, i, "{", "}")
                    first = head_start + len(head) - len(head.lstrip())
                    found.append((name_of(stripped), line_of(first), line_of(i)))
                    head_start = i + 1
            else:
                i = matching(code, i, "{", "}")  # data: an initialiser
            if i < 0:
                raise ValueError(f"line {line_of(opened)}: this brace is never closed")
        i += 1
    return found


# What the heuristic must get right, each case one this code base has: braces in comments,
# strings, raw strings and character literals, preprocessor lines, default arguments `= {}`,
# data initialisers (with parentheses in their type), constructor init lists with braces,
# class members, a lambda bound at namespace scope, local lambdas and classes inside a body.
SAMPLE = r"""#include <x>
#define OPEN {
namespace a {
// a comment with { an open brace
int f(int x = {}, const char* s = "{") {
  auto g = [&](int y) { return y + '}'; };
  struct Local { int z{1}; };
  return g(x) + R"({ raw )";
}
constexpr void (*kTable[])(int) = {&f, &f};
class C : public Base<int> {
 public:
  C(int a) : a_{a}, b_(a) {
    /* } */
  }
  int get() const noexcept { return a_; }
  bool operator==(const C& o) const { return a_ == o.a_; }
 private:
  int a_{0}, b_;
};
const auto h = [](int x) {
  return x;
};
}  // namespace a
"""
SAMPLE_FUNCTIONS = [("f", 5, 9), ("C", 13, 15), ("get", 16, 16), ("operator==", 17, 17),
                    ("h", 21, 23)]


def self_test():
    got = functions(SAMPLE)
    if got != SAMPLE_FUNCTIONS:
        print(f"long_functions: the heuristic reads the sample as {got}, "
              f"expected {SAMPLE_FUNCTIONS}")
        return 1
    print(f"long_functions: the sample's {len(got)} functions found as expected")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", default=pathlib.Path(__file__).resolve().parents[1],
                    type=pathlib.Path)
    ap.add_argument("--limit", type=int, default=150)
    ap.add_argument("--allow", type=pathlib.Path)
    ap.add_argument("--self-test", action="store_true", help="check the heuristic on a sample")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    root = args.root.resolve()
    allow = {}
    if args.allow:
        for n, line in enumerate(args.allow.read_text().splitlines(), 1):
            entry = line.split("#", 1)[0].strip()
            if entry:
                allow[entry] = n

    long = []
    problems = 0
    for f in sorted((root / "src").rglob("*")):
        if f.suffix not in (".cpp", ".h"):
            continue
        rel = f.relative_to(root).as_posix()
        try:
            found = functions(f.read_text(errors="replace"))
        except ValueError as e:
            print(f"{rel}: {e}: cannot read its functions")
            problems += 1
            continue
        for name, first, last in found:
            if last - first + 1 > args.limit:
                long.append((rel, name, first, last - first + 1))

    for rel, name, first, length in long:
        key = f"{rel}:{name}"
        if key in allow:
            print(f"{rel}:{first}: {name} is {length} lines (allowed by {args.allow.name})")
            del allow[key]
        else:
            print(f"{rel}:{first}: {name} is {length} lines, over {args.limit}: "
                  "split it into named steps")
            problems += 1
    for key, n in allow.items():
        print(f"{args.allow}:{n}: {key} is not over {args.limit} lines (or not found): "
              "remove it from the list")
        problems += 1
    print(f"long_functions: {len(long)} over {args.limit} lines, {problems} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
