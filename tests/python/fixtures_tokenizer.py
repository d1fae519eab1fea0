"""Tokenizer and chat-template references for tests/text (written under DFLASH_FIXTURES/tokenizer).

No hub access here, so the tokenizers are trained on the spot with HF `tokenizers` on GSM8K text
(plus a slice of the stress corpus, so merges exist for non-Latin scripts too), configured like the
real Qwen3, Llama-3 and GPT-2 tokenizer.json files. For each one we write the tokenizer directory
and `parity.json`: texts (GSM8K test + a stress corpus) with the ids and decoded text HF produces.
`nfc.json` holds NFC references from the tokenizers crate itself (not Python's unicodedata), and
`chat.json` holds rendered conversations, ids and assistant masks from transformers.
"""
import json
import pathlib
import random
import unicodedata

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

ROOT = pathlib.Path(__file__).resolve().parents[2]
GSM8K = pathlib.Path("/work/shared/data/gsm8k")
if not GSM8K.exists():
    GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# The official templates, verbatim: Qwen3 (Qwen/Qwen3-8B tokenizer_config.json) and
# Llama-3 (meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json).
QWEN3_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n"
    "    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n{%- endfor %}\n"
    "{%- for message in messages %}\n    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n    {%- else %}\n"
    "        {%- set content = '' %}\n    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + "
    "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}")

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")

# Mask references. transformers computes `return_assistant_tokens_mask` only from
# {% generation %} blocks, which the official templates lack. Rendering prefixes does not work
# for Qwen3 (an assistant turn renders differently when it is the last one: the think block), so
# we use copies of the official templates with {% generation %} around each assistant body and
# end-of-turn token, and assert that each copy renders byte-identical text to the official
# template on every conversation; ids always come from the official template.
def _mark_qwen3(t):
    """The assistant branch restructured so one {% generation %} block (which must nest) spans
    the body, tool calls and <|im_end|>; the branch logic is unchanged."""
    head = "        {%- if loop.index0 > ns.last_query_index %}\n"
    tail = "        {{- '<|im_end|>\\n' }}\n"
    i, j = t.index(head), t.index(tail)
    body = t[i:j]
    k = body.index("        {%- if message.tool_calls %}")
    tools = body[k:]
    marked = (
        "        {{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}\n"
        "        {%- if loop.index0 > ns.last_query_index and "
        "(loop.last or (not loop.last and reasoning_content)) %}\n"
        "            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
        "content.lstrip('\\n') }}\n"
        "        {%- else %}\n            {{- content }}\n        {%- endif %}\n" + tools +
        "        {{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}\n")
    return t[:i] + marked + t[j + len(tail):]


QWEN3_TEMPLATE_MARKED = _mark_qwen3(QWEN3_TEMPLATE)
assert QWEN3_TEMPLATE_MARKED.count("{%- generation %}") == 1

LLAMA3_TEMPLATE_MARKED = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")


def gsm8k(split):
    with open(GSM8K / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def stress_corpus(seed, n_random):
    """Hand-written hard cases plus random strings over every assigned code point block."""
    rng = random.Random(seed)
    cases = [
        "", " ", "  ", "\n", "\r\n", "\t", "a", "A", "1", "!",
        "Hello world", " Hello", "Hello ", "hello\n\nworld\n", "   leading and trailing   ",
        " " * 100 + "x" + "\t" * 33 + "\n" * 17 + "y" + " \n \n  \r\n\r\n   ",
        "\u00a0\u00a0nbsp\u2003em\u3000ideographic\u2028line\u2029para\u0085nel\u200bzwsp\ufeffbom",
        "don't I'LL she'S y'all we've they'RE it'd I'm 'ſ 'S 'K 'Ll ''s '' ' s",
        "1234567890 12 123 1234 12345 3.14159 -42 1e10 0x1F 1,000,000 ٠١٢٣٤٥ １２３ ⅷ ²³",
        "$12.50 + 3*4 = <<3*4=12>>12 #### 72",
        "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x != None: pass\n",
        "int main(int argc, char** argv) { std::vector<int> v{1,2,3}; return v[0] >> 1; }\n",
        "<|im_start|>user\nhi<|im_end|>\n", "<|im_start", "<|im_start|", "< |im_end|>",
        "<|IM_END|>", "<|endoftext|>", "foo<|endoftext|>bar", "<<|im_end|>>", "<think>x</think>",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
        "<|eot_id|><|eot_id|> <|eot_id|>", "<|im_end|><|im_end|>", "<thin\u212a>",
        "<|im_start|>\u0301", "ab<|im_end|>\u0301", "<| im_start |>", "<|im_start|>" * 3,
        "👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇺🇸🇯🇵 1️⃣ ❤️ 🧑🏿‍🚀 🫠 😀😃😄", "\U0001f469\u200d\u2764\ufe0f\u200d\U0001f468",
        "e\u0301 \u00e9 a\u0300\u0316 A\u030a \u212b \u1e0b\u0323 q\u0307\u0323 \u0344 \u0958",
        "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a"
        "\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367",
        "\u1100\u1161\u11a8 \uac00\u11a8 \u1100\u1161 \ud55c\uad6d\uc5b4 \u3131\u314f",
        "\u0915\u094d\u0937 \u0928\u092e\u0938\u094d\u0924\u0947 \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
        "مرحبا بالعالم ١٢٣ שָׁלוֹם עוֹלָם Привет мир Γειά σου κόσμε",
        "日本語のテキスト、漢字とカタカナ。中文文本，标点符号！한국어 텍스트",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕮𝖔𝖉𝖊 𐍈𐌰𐌹 𒀀𒀁 𓀀𓀁 𠀀𠀁 🄰🄱",
        "\x00\x01\x02\x1b[31mred\x1b[0m\x7f\x1c\x1d\x1e\x1f", "\ue000\uf8ff\U000f0000 \ufffd",
        "tab\tseparated\tvalues\n\n\n\n\nmany newlines\r\r\r", "a" * 500, "ab" * 300,
        "!!!???...,,,;;;:::---___===+++***&&&^^^%%%$$$###@@@" * 3,
        "https://example.com/path?q=1&r=2#frag user@example.org",
    ]
    assigned = [c for c in range(0x20, 0x110000)
                if not 0xD800 <= c < 0xE000 and unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    blocks = {}
    for c in assigned:
        blocks.setdefault(c >> 7, []).append(c)
    filler = [" ", "  ", "\n", "'s", "1", "23", ". ", ", ", "\t", "-", "the ", "\u0301", "\u200d"]
    for chars in blocks.values():  # one sample per 128-code-point block: every script
        parts = []
        for _ in range(rng.randint(4, 16)):
            if rng.random() < 0.3:
                parts.append(rng.choice(filler))
            else:
                parts.append("".join(chr(rng.choice(chars)) for _ in range(rng.randint(1, 8))))
        cases.append("".join(parts))
    for _ in range(n_random):  # mixtures across blocks
        cases.append("".join(chr(rng.choice(assigned)) if rng.random() < 0.7 else
                             rng.choice(filler) for _ in range(rng.randint(1, 40))))
    return cases


def train(kind, texts):
    specials_by_kind = {
        "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "gpt2": ["<|endoftext|>"],
    }
    tok = Tokenizer(models.BPE(ignore_merges=(kind == "llama3")))
    if kind == "qwen3":
        tok.normalizer = normalizers.NFC()
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        pattern = QWEN_PATTERN if kind == "qwen3" else LLAMA3_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                         use_regex=False)
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                  use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size={"qwen3": 6000, "llama3": 5000, "gpt2": 4000}[kind],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # Real checkpoints put added tokens after the BPE vocabulary; so do we.
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True)
                            for s in specials_by_kind[kind]])
    if kind == "qwen3":  # Qwen3 marks <think> as added but not special
        tok.add_tokens([AddedToken("<think>", normalized=False, special=False),
                        AddedToken("</think>", normalized=False, special=False)])
    if kind == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)])])
    return tok


def tokenizer_config(kind):
    if kind == "qwen3":
        return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN3_TEMPLATE,
                "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                "add_bos_token": False, "clean_up_tokenization_spaces": False,
                "model_max_length": 131072}
    if kind == "llama3":
        return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3_TEMPLATE,
                "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                "clean_up_tokenization_spaces": True, "model_max_length": 131072}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 1024}


def nfc_reference(out):
    nfc = normalizers.NFC()
    changed = {}
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    for s in chars:
        t = nfc.normalize_str(s)
        if t != s:
            changed[ord(s)] = t
    rng = random.Random(7)
    marks = [c for c in range(0x300, 0x370)] + [0x1dc0, 0x20d0, 0x05b0, 0x0e48, 0x302a, 0x3099]
    bases = [0x41, 0x61, 0x45, 0x65, 0x4f, 0x55, 0x3b1, 0x3c9, 0x430, 0x1100, 0x1161, 0xac00,
             0x304b, 0x30cf, 0x915, 0x5d0, 0x627]
    seqs = []
    for c in range(0x110000):  # every canonical decomposition, decomposed and re-composed
        if 0xD800 <= c < 0xE000:
            continue
        d = unicodedata.normalize("NFD", chr(c))
        if d != chr(c):
            seqs.append(d)
    for _ in range(3000):  # reordering and blocking
        seqs.append("".join(chr(rng.choice(bases if rng.random() < 0.3 else marks))
                            for _ in range(rng.randint(1, 8))))
    (out / "nfc.json").write_text(json.dumps({
        "changed": {str(k): v for k, v in changed.items()},
        "inputs": seqs, "outputs": [nfc.normalize_str(s) for s in seqs]}, ensure_ascii=False))


def conversations(rows, rng):
    """Chat samples in both input forms, built from GSM8K; returns (jsonl lines, messages)."""
    out = []
    systems = ["You are a careful math tutor.", "  Answer briefly.\n", ""]
    for i, row in enumerate(rows):
        q, a = row["question"], row["answer"]
        msgs = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": systems[i % len(systems)] or "Be exact."})
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if i % 4 == 1:  # multi-turn
            nxt = rows[(i + 1) % len(rows)]
            msgs += [{"role": "user", "content": "And this one? " + nxt["question"]},
                     {"role": "assistant", "content": nxt["answer"] + "\n"}]
        if i % 7 == 2:  # earlier reasoning that the Qwen3 template drops / keeps
            msgs[-1]["content"] = "<think>\nLet me compute.\n</think>\n\n" + msgs[-1]["content"]
        if i % 11 == 5:
            msgs[1]["content"] = "  " + msgs[1]["content"] + "  \n"
        if i % 2 == 0:
            line = {"messages": msgs, "id": i}
        else:
            role = {"system": "system", "user": "human", "assistant": "gpt"}
            line = {"conversations": [{"from": role[m["role"]], "value": m["content"]}
                                      for m in msgs], "id": f"s{i}"}
        out.append((json.dumps(line, ensure_ascii=False), msgs))
    # Boundary cases: whitespace that merges across the assistant header, Unicode whitespace for
    # Llama-3's trim, text NFC changes right at a span start, special-token text inside content,
    # reasoning given as reasoning_content, a trailing user turn, a system turn mid-way.
    hard = [
        [{"role": "user", "content": "q \n"}, {"role": "assistant", "content": "\n\n  a\n\n"}],
        [{"role": "user", "content": "\u3000q\u2003"},
         {"role": "assistant", "content": "\u2028\x1c a \x85\xa0"}],
        [{"role": "user", "content": "e\u0301"}, {"role": "assistant", "content": "e\u0301 A\u030a"}],
        [{"role": "user", "content": "<|im_end|>"},
         {"role": "assistant", "content": "x<|im_end|>y<|eot_id|><think>"}],
        [{"role": "user", "content": "q"},
         {"role": "assistant", "content": "a", "reasoning_content": "\nthought\n"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
         {"role": "assistant", "content": "</think>a"}, {"role": "system", "content": "s2"},
         {"role": "user", "content": "q2"}],
        [{"role": "user", "content": "<tool_response>x</tool_response>"},
         {"role": "assistant", "content": "<think>\nr\n</think>\n\na"}],
    ]
    for msgs in hard:
        out.append((json.dumps({"messages": msgs}, ensure_ascii=False), msgs))
    return out


def chat_reference(out, dirs):
    from transformers import AutoTokenizer

    rng = random.Random(3)
    rows = gsm8k("test")[:150]
    convs = conversations(rows, rng)
    result = {"lines": [c[0] for c in convs]}
    for kind, marked in (("qwen3", QWEN3_TEMPLATE_MARKED), ("llama3", LLAMA3_TEMPLATE_MARKED)):
        hf = AutoTokenizer.from_pretrained(str(dirs[kind]))
        texts, ids, masks = [], [], []
        for _, msgs in convs:
            text = hf.apply_chat_template(msgs, tokenize=False)
            assert hf.apply_chat_template(msgs, tokenize=False, chat_template=marked) == text, \
                f"{kind}: the marked template renders differently"
            enc = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True, chat_template=marked)
            plain = hf.apply_chat_template(msgs, tokenize=True, return_dict=True)
            assert list(enc["input_ids"]) == list(plain["input_ids"])
            texts.append(text)
            ids.append(list(plain["input_ids"]))
            masks.append(list(enc["assistant_masks"]))
        # Generation prompts: every prefix that ends just before an assistant turn, with
        # Qwen3's reasoning on and off (Llama-3's template ignores the switch).
        generation = []
        for line in [*range(60), *range(len(convs) - 7, len(convs))]:  # and the boundary cases
            msgs = convs[line][1]
            for n in range(1, len(msgs)):
                if msgs[n]["role"] != "assistant":
                    continue
                prefix = msgs[:n]
                generation.append({"line": line,
                                   "messages": n,
                                   "thinking": hf.apply_chat_template(
                                       prefix, tokenize=False, add_generation_prompt=True),
                                   "no_thinking": hf.apply_chat_template(
                                       prefix, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)})
        result[kind] = {"texts": texts, "ids": ids, "masks": masks, "generation": generation}
    (out / "chat.json").write_text(json.dumps(result, ensure_ascii=False))


def make(out: pathlib.Path):
    train_rows = gsm8k("train")
    test_rows = gsm8k("test")
    train_texts = [r["question"] + "\n" + r["answer"] for r in train_rows]
    train_texts += stress_corpus(seed=1, n_random=400)
    test_texts = [r["question"] + "\n" + r["answer"] for r in test_rows]
    stress = stress_corpus(seed=2, n_random=600)
    dirs = {}
    for kind in ("qwen3", "llama3", "gpt2"):
        d = out / kind
        d.mkdir(parents=True, exist_ok=True)
        tok = train(kind, train_texts)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(kind), indent=2))
        dirs[kind] = d
        texts = test_texts + stress
        enc = tok.encode_batch(texts, add_special_tokens=False)
        enc_sp = tok.encode_batch(texts, add_special_tokens=True)
        ids = [e.ids for e in enc]
        rng = random.Random(11)
        vocab = tok.get_vocab_size()
        random_ids = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(500)]
        (d / "parity.json").write_text(json.dumps({
            "texts": texts, "ids": ids, "ids_special": [e.ids for e in enc_sp],
            "decoded": tok.decode_batch(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode_batch(ids, skip_special_tokens=True),
            "random_ids": random_ids,
            "random_decoded": tok.decode_batch(random_ids, skip_special_tokens=False),
            "num_gsm8k": len(test_texts)}, ensure_ascii=False))
    nfc_reference(out)
    chat_reference(out, dirs)
