"""Tests of the built-in task and tiny model: tokenizer, chat template, build, cache, resolution.

Fast: builds use a few-step recipe in a temporary cache dir. Run alone:
    pytest tests/test_tiny_model.py -q
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import unicodedata

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoverl_async.agents import multiply_task
from nanoverl_async.models.cache import default_cache_dir, recipe_digest
from nanoverl_async.models.load import load_tokenizer, resolve_model_path
from nanoverl_async.models.tiny import (
    TinyRecipe,
    build_model,
    build_tiny,
    build_tokenizer,
    demo_batch,
    demo_pieces,
    warm_start,
)

FAST = TinyRecipe(steps=2, batch_size=4, warmup_steps=1)  # a real build, just barely trained


def tool_episode(a: int, b: int) -> list[dict]:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}}
    return [
        {"role": "user", "content": f"{a}*{b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("cache")
    return str(cache), build_tiny(str(cache), FAST)


def test_multiply_task():
    s = multiply_task.make_prompt(3, 7)
    assert s == multiply_task.make_prompt(3, 7) and json.loads(json.dumps(s)) == s
    assert 0 <= s["a"] < 100 and 0 <= s["b"] < 100 and s["answer"] == str(s["a"] * s["b"])
    assert s["messages"] == [{"role": "user", "content": f"{s['a']}*{s['b']}?"}] and s["index"] == 7
    pairs = {(multiply_task.make_prompt(0, i)["a"], multiply_task.make_prompt(0, i)["b"]) for i in range(50)}
    assert len(pairs) > 40
    assert multiply_task.calculator("12*34") == "408" and multiply_task.calculator(" 5 - 7") == "-2"
    assert multiply_task.calculator("3+4") == "7"
    for bad in ("12/3", "1*2*3", "-1*2", "abc", "", "1.5*2", "__import__('os')", "9" * 20 + "*2"):
        with pytest.raises(ValueError):
            multiply_task.calculator(bad)
    assert multiply_task.score(s, f" {s['answer']}\n") == 1.0 and multiply_task.score(s, "x") == 0.0


def test_tokenizer_round_trip_and_one_token_per_char(tok):
    text = "What is 12*34? <call>12*34</call><res>408</res>408<|end|> ~!\n\t"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text
    for ch in "0123456789+-*?":
        assert len(tok(ch, add_special_tokens=False)["input_ids"]) == 1
    assert len(tok("12*34", add_special_tokens=False)["input_ids"]) == 5
    specials = ("<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<call>", "</call>", "<res>", "</res>")
    for special in specials:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|end|>" and tok.pad_token_id != tok.eos_token_id
    assert build_tokenizer().get_vocab() == tok.get_vocab()  # deterministic


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_saved_tokenizer_round_trips_any_text(built, text):
    """What every role loads (load_tokenizer, i.e. AutoTokenizer on the saved directory, as SGLang and
    users do with final/) keeps every character: spaces, newlines, punctuation, any unicode (NFC)."""
    tokenizer = _saved_tokenizer(built[1])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_newcomer_prompt_reaches_the_model_with_its_spaces(built):
    tokenizer = _saved_tokenizer(built[1])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "sum 12 34\n5?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "<|user|>sum 12 34\n5?<|end|><|assistant|>"
    assert tokenizer.decode(tokenizer("error: numbers must be below 50")["input_ids"]) == "error: numbers must be below 50"


def test_load_tokenizer_refuses_one_that_drops_whitespace(tmp_path):
    """The transformers 5.x trap that hid the bug: a char-level tokenizer.json under a qwen2 config is
    rebuilt by AutoTokenizer as byte-level BPE and loses whitespace; load_tokenizer names it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    char = Tokenizer(models.WordLevel(unk_token="<unk>"))
    char.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    char.decoder = decoders.Fuse()
    char.train_from_iterator(["a b\nc  d"], trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=char, unk_token="<unk>").save_pretrained(tmp_path)
    Qwen2Config(vocab_size=16).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="drops whitespace"):
        load_tokenizer(str(tmp_path))


_SAVED = {}


def _saved_tokenizer(path: str):
    if path not in _SAVED:
        _SAVED[path] = load_tokenizer(path)
    return _SAVED[path]


def test_chat_template_exact_strings(tok):
    msgs = tool_episode(12, 34)
    render = lambda m, **kw: tok.apply_chat_template(m, tokenize=False, **kw)  # noqa: E731
    assert render(msgs[:1], add_generation_prompt=True) == "<|user|>12*34?<|end|><|assistant|>"
    assert render(msgs) == "<|user|>12*34?<|end|><|assistant|><call>12*34</call><res>408</res>408<|end|>"
    direct = [msgs[0], {"role": "assistant", "content": "408"}]
    assert render(direct) == "<|user|>12*34?<|end|><|assistant|>408<|end|>"
    assert render([{"role": "system", "content": "hi"}] + direct).startswith("<|system|>hi<|end|><|user|>")
    with_tools = render(msgs[:1], tools=[multiply_task.calculator], add_generation_prompt=True)
    assert with_tools == "<|system|>tools: calculator(expression)<|end|><|user|>12*34?<|end|><|assistant|>"
    # after a tool result the assistant continues the same turn: no new header
    assert render(msgs[:3], add_generation_prompt=True) == render(msgs[:3])
    assert render([{"role": "tool", "content": "408"}]) == "<res>408</res>"


@pytest.mark.parametrize("tools", [False, True])
def test_chat_template_prefix_consistent(tok, tools):
    call2 = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "408+1"}}}
    msgs = tool_episode(12, 34)[:3] + [
        {"role": "assistant", "content": "", "tool_calls": [call2]},
        {"role": "tool", "content": "error: bad"},
        {"role": "assistant", "content": "409"},
    ]
    kw = {"tokenize": False, "tools": [multiply_task.calculator] if tools else None}
    full = tok.apply_chat_template(msgs, **kw)
    for k in range(1, len(msgs)):
        head = tok.apply_chat_template(msgs[:k], add_generation_prompt=msgs[k]["role"] == "assistant", **kw)
        assert full.startswith(head), k
        if msgs[k]["role"] == "tool":  # the agent loop renders tool results alone, as a delta
            delta = tok.apply_chat_template([msgs[k]], tokenize=False)
            assert full[len(head):].startswith(delta)
    # token level: the ids of the head are a prefix of the ids of the whole
    head_ids = tok(tok.apply_chat_template(msgs[:3], **kw), add_special_tokens=False)["input_ids"]
    assert tok(full, add_special_tokens=False)["input_ids"][: len(head_ids)] == head_ids
    pieces = demo_pieces(tok, tools)  # the SFT demos use the same renderings
    assert full.startswith(pieces["prompt"].replace("{Q}", "12*34?"))


def test_demo_batch_trains_only_sampled_tokens(tok):
    recipe = TinyRecipe(batch_size=400)
    pieces = [demo_pieces(tok, False), demo_pieces(tok, True)]
    call, res, res_end = tok.convert_tokens_to_ids(["<call>", "<res>", "</res>"])
    decisions, tool_rows, rows = 0, 0, 0
    for sub in demo_batch(tok, pieces, recipe, random.Random(0)):
        columns = (sub["input_ids"].tolist(), sub["labels"].tolist(), sub["attention_mask"].tolist())
        for ids, labels, mask in zip(*columns):
            rows += 1
            n = sum(mask)
            text = tok.decode(ids[:n], skip_special_tokens=False)
            start = ids.index(tok.convert_tokens_to_ids("<|assistant|>")) + 1
            assert all(x == -100 for x in labels[:start]) and all(x == -100 for x in labels[n:])
            assert labels[n - 1] == tok.eos_token_id  # the answer's <|end|> is trained
            if call in ids:
                tool_rows += 1
                assert all(x == -100 for x in labels[ids.index(res): ids.index(res_end) + 1])  # tool result
                decisions += labels[start] == call
                a, b = text.split("<|user|>")[1].split("?")[0].split("*")
                assert f"<call>{a}*{b}</call><res>{int(a) * int(b)}</res>{int(a) * int(b)}<|end|>" in text
    assert abs(tool_rows / rows - recipe.tool_fraction) < 0.1
    assert abs(decisions / tool_rows - recipe.call_keep) < 0.1
    f, q = recipe.tool_fraction, recipe.call_keep
    assert abs(f * q / (f * q + 1 - f) - recipe.call_rate) < 1e-9
    with pytest.raises(ValueError):
        TinyRecipe(call_rate=0.6, tool_fraction=0.5)


def test_build_save_reload_exact(built, tok, tmp_path):
    _, path = built
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok2 = load_tokenizer(path)
    assert type(AutoTokenizer.from_pretrained(path)).__name__ == type(tok2).__name__
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.tie_word_embeddings
    assert tok2.get_vocab() == tok.get_vocab() and tok2.chat_template == tok.chat_template
    assert (tok2.pad_token_id, tok2.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    msgs = tool_episode(5, 6)
    assert tok2.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    ids = torch.tensor([tok2(tok2.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]])
    assert model.config.eos_token_id == tok.eos_token_id and model.config.vocab_size == len(tok)
    # the in-memory model and its saved copy agree bit for bit
    fresh = build_model(tok, FAST)
    warm_start(fresh, tok, FAST)
    fresh.save_pretrained(tmp_path, safe_serialization=True)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, again(ids).logits)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_cache_reused_and_recipe_keyed(built, capsys):
    cache, path = built
    capsys.readouterr()
    assert build_tiny(cache, FAST) == path
    assert "building" not in capsys.readouterr().err  # found, not built again (whatever the machine's load)
    other = TinyRecipe(steps=2, batch_size=4, warmup_steps=1, seed=1)
    assert recipe_digest(other.contents()) != recipe_digest(FAST.contents())
    assert recipe_digest(TinyRecipe().contents()) == recipe_digest(TinyRecipe().contents())
    leftovers = [n for n in os.listdir(cache) if n.startswith(".tiny-build-")]
    assert not leftovers  # the temp dir was renamed, nothing half-built remains


@pytest.mark.slow
def test_concurrent_builds_build_once(tmp_path):
    """Two processes racing on an empty cache: one builds, the other waits and reuses it."""
    code = (
        "import sys, torch; torch.set_num_threads(1);"
        "from nanoverl_async.models.tiny import TinyRecipe, build_tiny;"
        f"print(build_tiny(sys.argv[1], TinyRecipe(steps=2, batch_size=4, warmup_steps=1, seed=7)))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0]
    assert sum("building builtin:tiny" in err for _, err in outs) == 1


def test_resolve_model_path(tmp_path, monkeypatch):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)  # a directory, unchanged
    assert resolve_model_path("Qwen/Qwen2.5-0.5B", str(tmp_path)) == "Qwen/Qwen2.5-0.5B"  # a hub id, unchanged
    with pytest.raises(ValueError, match="'/some/hf/dir' is not a directory"):  # only local, and missing
        resolve_model_path("/some/hf/dir")
    with pytest.raises(ValueError, match="'builtin:huge' is not a built-in model.*builtin:tiny"):
        resolve_model_path("builtin:huge", str(tmp_path))
    builder = tmp_path / "my_model.py"  # model.path may name a function that makes (and caches) a model directory
    builder.write_text(f"def build(cache_dir):\n    return {str(tmp_path)!r}\n\n\n"
                       "def broken(cache_dir):\n    return 'x'\n")
    assert resolve_model_path(f"{builder}:build") == str(tmp_path)
    with pytest.raises(ValueError, match="returned 'x', not a model directory"):
        resolve_model_path(f"{builder}:broken")
    monkeypatch.setenv("NANOVERL_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path and default_cache_dir("/x") == default_cache_dir("/x")


def test_default_builtin_if_already_built(capsys):
    """The real default recipe, only if it is already in the cache (building it takes ~a minute)."""
    final = default_cache_dir() / f"tiny-{recipe_digest(TinyRecipe().contents())}"
    if not final.is_dir():
        pytest.skip("builtin:tiny not built yet (python -m nanoverl_async.models.tiny builds it)")
    assert resolve_model_path("builtin:tiny") == str(final)
    assert "building" not in capsys.readouterr().err  # found, not built again
    model = AutoModelForCausalLM.from_pretrained(str(final))
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
