// The Jinja chat-template interpreter: byte-identical to transformers' apply_chat_template on
// every template in tests/data/chat_templates x the conversation corpus of
// tests/python/fixtures_chat_templates.py (errors where transformers errs), and the language
// pieces one by one against what jinja2 renders.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "chat/template.h"
#include "common/file.h"
#include "text_fixtures.h"

namespace dflash::chat {
namespace {

std::filesystem::path templates_dir() {
  return std::filesystem::path(DFLASH_SOURCE_DIR) / "tests" / "data" / "chat_templates";
}

TEST(ChatTemplateParity, EveryTemplateAndConversationMatchesTransformers) {
  const auto path = std::filesystem::path(DFLASH_FIXTURES) / "chat_templates" / "cases.json";
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing: run make_fixtures first";
  const auto ref = nlohmann::ordered_json::parse(read_file(path));
  RenderOptions options;
  options.now = ref["now"].get<std::time_t>();
  std::map<std::string, Template> templates;
  size_t rendered = 0, refused = 0;
  std::set<std::string> names;
  for (const auto& c : ref["cases"]) {
    const std::string name = c["template"].get<std::string>();
    names.insert(name);
    auto it = templates.find(name);
    if (it == templates.end()) {
      it = templates.emplace(name, Template(read_file(templates_dir() / name), name)).first;
    }
    SCOPED_TRACE(name + " / " + c["conversation"].get<std::string>() + " / add_generation_prompt=" +
                 c["add_generation_prompt"].dump() + " / " + c["kwargs"].dump());
    Dict kwargs;
    for (const auto& [k, v] : c["kwargs"].items()) kwargs.emplace_back(k, Value::from_json(v));
    const Dict vars = hf_template_variables(c["messages"], c["tools"],
                                            c["add_generation_prompt"].get<bool>(), kwargs);
    if (c.contains("text")) {
      try {
        EXPECT_EQ(it->second.render(vars, options).text, c["text"].get<std::string>());
        ++rendered;
      } catch (const TemplateError& e) {
        ADD_FAILURE() << "transformers rendered it, we threw: " << e.what();
      }
    } else {
      try {
        it->second.render(vars, options);
        ADD_FAILURE() << "transformers failed (" << c["error"].get<std::string>()
                      << "), we rendered";
      } catch (const TemplateError& e) {
        EXPECT_EQ(e.raised_by_template(), c["raised"].get<bool>())
            << e.what() << " vs " << c["error"];
        EXPECT_EQ(std::string(e.what()).rfind(name + ":", 0), 0u) << e.what();
        ++refused;
      }
    }
  }
  EXPECT_EQ(names.size(), 15u);
  EXPECT_GT(rendered, 1000u);
  EXPECT_GT(refused, 100u);
}

std::string render(std::string_view src,
                   const nlohmann::ordered_json& vars = nlohmann::ordered_json::object()) {
  Dict d;
  for (const auto& [k, v] : vars.items()) d.emplace_back(k, Value::from_json(v));
  return Template(src, "t.jinja").render(d).text;
}

TEST(ChatTemplate, WhitespaceControlAsTransformersConfiguresJinja) {
  // trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it.
  EXPECT_EQ(render("  {% if true %}\n  x\n  {% endif %}\ny"), "  x\ny");
  EXPECT_EQ(render("a  {%- if true -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(render("a {{- 'b' -}} c"), "abc");
  EXPECT_EQ(render("a\n  {%+ if true %}b{% endif %}"), "a\n  b");
  EXPECT_EQ(render("{# c #}\nx  {# c #}y"),
            "x  y");              // comments trim too; lstrip after text does not
  EXPECT_EQ(render("x\n"), "x");  // one trailing newline dropped
  EXPECT_EQ(render("x\n\n"), "x\n");
  EXPECT_EQ(render("{{ 1 }}\n"), "1");
  EXPECT_EQ(render("{{ 1 }}\n2"), "1\n2");  // no trim after a print
  EXPECT_EQ(render("{% raw %}{{ x }}{% endraw %}"), "{{ x }}");
}

TEST(ChatTemplate, PythonValuesPrintAsPython) {
  EXPECT_EQ(render("{{ true }} {{ none }} {{ 1.0 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 7 // 2 }} {{ -7 "
                   "// 2 }} {{ 7 / 2 }}"),
            "True None 1.0 1e+20 0.30000000000000004 3 -4 3.5");
  EXPECT_EQ(render("{{ [1, 'a', none, {'k': \"it's\"}] }}"), "[1, 'a', None, {'k': \"it's\"}]");
  EXPECT_EQ(render("{{ ('a',) }} {{ x }}", {{"x", {{"b", true}}}}), "('a',) {'b': True}");
  EXPECT_EQ(render("{{ 'a\\nb' }}|{{ ['a\\nb'] }}"), "a\nb|['a\\nb']");
}

TEST(ChatTemplate, TojsonIsTransformersJsonDumps) {
  const nlohmann::ordered_json v = {{"x", {{"b", 1}, {"a", {1.5, "é\"\n", nullptr, true}}}}};
  EXPECT_EQ(render("{{ x | tojson }}", v), R"({"b": 1, "a": [1.5, "é\"\n", null, true]})");
  EXPECT_EQ(render("{{ x | tojson(indent=2) }}", v),
            "{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    \"é\\\"\\n\",\n    null,\n    true\n  ]\n}");
  EXPECT_EQ(render("{{ x | tojson(separators=(',', ':'), sort_keys=true) }}", v),
            R"({"a":[1.5,"é\"\n",null,true],"b":1})");
  EXPECT_EQ(render("{{ [] | tojson(indent=4) }}{{ {} | tojson }}"), "[]{}");
}

TEST(ChatTemplate, LoopsScopesAndNamespaces) {
  EXPECT_EQ(
      render("{% for x in [1,2,3] if x != 2 %}{{ loop.index }}{{ x }}{{ loop.last }},{% endfor %}"),
      "11False,23True,");
  EXPECT_EQ(render("{% for x in [] %}a{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"),
            "a=1;b=2;");
  // A set inside a loop does not leak out; a namespace attribute does.
  EXPECT_EQ(
      render("{% set n = 0 %}{% set ns = namespace(n=0) %}{% for x in [1,2] %}{% set n = n + x %}"
             "{% set ns.n = ns.n + x %}{% endfor %}{{ n }} {{ ns.n }}"),
      "0 3");
  EXPECT_EQ(render("{% for x in [1,2,3,4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}"
                   "{% break %}{% endif %}{{ x }}{% endfor %}"),
            "13");
  EXPECT_EQ(render("{% for x in 'ab' %}{{ loop.previtem is defined }}{{ loop.cycle('o', 'e') }}{% "
                   "endfor %}"),
            "FalseoTruee");
}

TEST(ChatTemplate, MacrosCallFilterAndSetBlocks) {
  EXPECT_EQ(render("{% macro f(a, b='B') %}[{{ a }}{{ b }}{{ varargs | length }}]{% endmacro %}"
                   "{{ f(1) }}{{ f(1, b=2) }}{{ f(1, 2, 3) }}"),
            "[1B0][120][121]");
  EXPECT_EQ(render("{% macro w() %}<{{ caller() }}>{% endmacro %}{% call w() %}in{% endcall %}"),
            "<in>");
  EXPECT_EQ(
      render("{% filter upper %}ab{% endfilter %}{% set s | trim %}  x  {% endset %}[{{ s }}]"),
      "AB[x]");
  EXPECT_EQ(
      render(
          "{% macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(3) }}"),
      "321");
}

TEST(ChatTemplate, FiltersTestsAndMethods) {
  EXPECT_EQ(
      render("{{ '  a b  ' | trim }}|{{ 'aXbX' | replace('X', '-') }}|{{ 'hello world' | title }}|"
             "{{ 'hELLO' | capitalize }}|{{ [1,2] | join(', ') }}|{{ 'abc' | length }}|{{ 'é' | "
             "length }}"),
      "a b|a-b-|Hello World|Hello|1, 2|3|1");
  EXPECT_EQ(
      render("{{ x | selectattr('t', 'equalto', 'f') | map(attribute='n') | list }}",
             {{"x", {{{"t", "f"}, {"n", 1}}, {{"t", "g"}, {"n", 2}}, {{"t", "f"}, {"n", 3}}}}}),
      "[1, 3]");
  EXPECT_EQ(render("{{ [1, 0, 2] | select | list }}{{ [1, 0, 2] | reject('equalto', 1) | first }}"),
            "[1, 2]0");
  EXPECT_EQ(
      render(
          "{{ u | default('d') }}{{ '' | default('d', true) }}{{ 'x' is string }}{{ 1 is number }}"
          "{{ {} is mapping }}{{ u is not defined }}{{ none is none }}"),
      "ddTrueTrueTrueTrueTrue");
  EXPECT_EQ(
      render(
          "{{ ' a b '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|"
          "{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}|{{ 'xxaxx'.lstrip('x') }}"),
      "a b|['a', 'b', '', 'c']|['a', 'b']|TrueTrue|axx");
  EXPECT_EQ(render("{{ 'abcdef'[1:4] }}{{ 'abcdef'[::-1] }}{{ [1,2,3][-1] }}{{ [1,2,3][:-1] }}{{ "
                   "'héllo'[1] }}"),
            "bcdfedcba3[1, 2]é");
  EXPECT_EQ(render("{{ 'a\\nb' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}"), "a\n  b|  a\n  b");
  EXPECT_EQ(
      render(
          "{{ '3' | int + 1 }}{{ 'x' | int }}{{ 2 | string ~ 'a' }}{{ {'a': 1} | items | list }}"),
      "40"
      "2a[('a', 1)]");
  EXPECT_EQ(render("{{ 'b' in 'abc' }}{{ 2 in [1, 2] }}{{ 'k' in {'k': 1} }}{{ 3 not in [1] }}{{ 1 "
                   "< 2 < 3 }}"),
            "TrueTrueTrueTrueTrue");
  EXPECT_EQ(
      render("{{ 'a' if false }}|{{ 'a' if false else 'b' }}|{{ none or 'x' }}|{{ 1 and 2 }}"),
      "|b|x|2");
}

// The filters with bodies of their own in chat/builtins.cpp (sort, dictsort, sum, round,
// reverse, map by filter name, join by attribute): what jinja2 renders.
TEST(ChatTemplate, SortSumRoundReverseMapAndJoinFilters) {
  EXPECT_EQ(
      render(
          "{{ [3, 1, 2] | sort }}|{{ ['b', 'A', 'c'] | sort(reverse=true) }}|"
          "{{ x | sort(attribute='n') | map(attribute='n') | list }}|"
          "{{ {'b': 1, 'a': 2} | dictsort }}|"
          "{{ {'b': 1, 'a': 2} | dictsort(by='value', reverse=true) }}|{{ [1, 2, 3] | sum }}|"
          "{{ x | sum(attribute='n', start=10) }}|{{ 2.567 | round(2) }}|"
          "{{ 2.5 | round(method='floor') }}|{{ 'abc' | reverse }}|{{ [1, 2] | reverse | list }}|"
          "{{ ['a', 'b'] | map('upper') | list }}|{{ x | join('-', attribute='n') }}",
          {{"x", {{{"n", 2}}, {{"n", 1}}}}}),
      "[1, 2, 3]|['c', 'b', 'A']|[1, 2]|[('a', 2), ('b', 1)]|[('a', 2), ('b', 1)]|6|13|2.57|2.0|"
      "cba|[2, 1]|['A', 'B']|2-1");
}

TEST(ChatTemplate, StrftimeNowUsesTheGivenClock) {
  RenderOptions o;
  o.now = 1785067200;
  std::tm tm{};
  localtime_r(&*o.now, &tm);
  char want[64];
  std::strftime(want, sizeof want, "%d %b %Y", &tm);
  EXPECT_EQ(Template("{{ strftime_now('%d %b %Y') }}", "t").render({}, o).text, want);
}

TEST(ChatTemplate, GenerationBlocksGiveSpans) {
  Template t(
      "{% for m in messages %}<{{ m }}>{% generation %}[{{ m }}]{% endgeneration %}{% endfor %}",
      "g");
  EXPECT_TRUE(t.has_generation());
  Dict vars{{"messages", Value::list({Value("a"), Value("bc")})}};
  const Rendered r = t.render(vars);
  EXPECT_EQ(r.text, "<a>[a]<bc>[bc]");
  ASSERT_EQ(r.generation_spans.size(), 2u);
  EXPECT_EQ(r.generation_spans[0], (std::pair<size_t, size_t>{3, 6}));
  EXPECT_EQ(r.generation_spans[1], (std::pair<size_t, size_t>{10, 14}));
}

void expect_error(std::string_view src, const std::string& where, const std::string& what,
                  bool raised = false,
                  const nlohmann::ordered_json& vars = nlohmann::ordered_json::object()) {
  try {
    render(src, vars);
    ADD_FAILURE() << "no error for " << src;
  } catch (const TemplateError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("t.jinja:" + where + ": ", 0), 0u) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_EQ(e.raised_by_template(), raised) << msg;
  }
}

TEST(ChatTemplate, ErrorsNameTheTemplateLineAndColumn) {
  expect_error("a\n{% if x %}", "2:11", "expected '{% elif %}', '{% else %}' or '{% endif %}'");
  expect_error("{% include 'x' %}", "1:1", "unknown or unsupported tag 'include'");
  expect_error("{{ x | nosuch }}", "1:8", "No filter named 'nosuch'");
  expect_error("\n  {{ raise_exception('no system role') }}", "2:21", "no system role", true);
  expect_error("{{ x.y.z }}", "1:5", "'x' is undefined");
  expect_error("{{ m.content.strip() }}", "1:13", "'dict object' has no attribute 'content'", false,
               {{"m", nlohmann::ordered_json::object()}});
  expect_error("{{ 'a' + 1 }}", "1:8", "can only concatenate str");
  expect_error("{% for m in none %}{% endfor %}", "1:1", "'NoneType' object is not iterable");
  expect_error("{{ (1 }}", "1:7", "unexpected '}', expected ')'");
  expect_error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "1:20", "recursion deeper");
  expect_error("{{ 9223372036854775807 + 1 }}", "1:24", "integer overflow");
  expect_error("{{ 2 ** 64 }}", "1:6", "integer overflow");
  expect_error("{{ " + std::string(300, '(') + "1" + std::string(300, ')') + " }}", "1:70",
               "nested too deeply");
  expect_error("{{ '\\ud800' }}", "1:6", "not a Unicode scalar value");
}

}  // namespace
}  // namespace dflash::chat
