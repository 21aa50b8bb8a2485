"""BuiltinEngine: continuous batching with our own forward and paged KV cache, checked against a
full forward pass (the cache's budget, preemption, copy on write and prefix hashes: test_kv_blocks.py).

Fast CPU tests on tiny random models (hidden 64, 2 layers): logprobs of concurrent requests of
different lengths, and of requests that join a running batch at different steps (rows leaving and
moving in the block table), equal those of a recomputed unpadded forward pass; a late request
finishes while a long one still decodes; stop tokens and max_new_tokens hold; an interrupt-mode weight
swap re-tags later tokens with the new version and samples them from the new weights; the Llama family
(Llama untied without bias, Qwen2 with qkv bias, Qwen3 q/k norms, Mistral sliding window) matches HF;
lengths are not capped at max_position_embeddings; other model types and rope types are refused; an
episode's later turns find its blocks by hash and still match a full forward of the whole history; a group
that joins running rows computes its prompt once and still matches; seeded random workloads that mix all
of these (a cancelled request, small pools that preempt rows, blocks of 1, 4 and 16 positions) match token
by token under each token's version, also with the decode
step of CUDA graphs emulated on the CPU (each replay runs the captured step again, first checking that the
engine still keeps every tensor the step reads where the capture found it, as a real graph would read there),
and no step reads a value back from its tensors (HostWaits).
"""

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from host_waits import HostWaits
from nanoverl_async.generators import checkpoint_reader, decode_graphs, llama_forward
from nanoverl_async.generators.decode_graphs import DecodeGraphs
from nanoverl_async.agents.engine import SamplingParams
from nanoverl_async.generators.builtin_engine import BuiltinEngine

VOCAB = 96
TOL = 1e-4


def tiny_qwen2(vocab_size: int = VOCAB, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    torch.set_num_threads(1)  # the tests' models are tiny: more threads only wait for each other


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_qwen2().save_pretrained(path)
    return str(path)


def reference_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of each completion token, from one unpadded forward over everything."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def test_concurrent_requests_match_a_full_forward(model_dir):
    engine = BuiltinEngine(model_dir, seed=1)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [20, 21, 22], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
    limits = [9, 4, 12, 6]

    async def main():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(n, 0.7)) for p, n in zip(prompts, limits)))

    completions = asyncio.run(main())
    assert engine.decode_steps == max(limits)  # one batch: a prefill plus one step per extra token
    for prompt, limit, completion in zip(prompts, limits, completions):
        assert len(completion.token_ids) == limit and completion.finish_reason == "length"
        assert completion.versions == [0] * limit
        expected = reference_logprobs(reference, prompt, completion.token_ids, 0.7)
        assert completion.logprobs == pytest.approx(expected, abs=TOL)
    assert engine.in_flight() == 0


def test_a_groups_shared_prompt_is_computed_once_and_its_samples_differ(model_dir):
    engine = BuiltinEngine(model_dir, seed=4)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    group, other = [5, 6, 7, 8, 9, 10], [20, 21, 22]

    async def main():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(8, 1.0)) for p in [group, other] + [group] * 5))

    completions = asyncio.run(main())
    assert sum(c.cached_tokens for c in completions) == 5 * len(group)  # 5 copies of the first sample's prompt cache
    for prompt, completion in zip([group, other] + [group] * 5, completions):
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, prompt, completion.token_ids, 1.0),
                                                    abs=TOL)
    samples = [tuple(c.token_ids) for c in completions[:1] + completions[2:]]
    assert len(set(samples)) == len(samples)  # each sample draws its own tokens from the shared logits


def test_a_group_joining_running_rows_shares_its_prompt_and_matches_a_full_forward(model_dir):
    """The copies' cache and logits come from their first sample's row, after the rows already running."""
    engine = BuiltinEngine(model_dir, seed=11)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    group = [9, 8, 7, 6, 5, 4, 3]
    requests = [(0, [1, 2, 3], 20), (0, [40] * 12, 15)] + [(3, group, 6)] * 4 + [(3, [30, 31], 6)]
    completions = staggered(engine, requests, temperature=1.0)
    assert sum(c.cached_tokens for c in completions) == 3 * len(group)
    for (_, prompt, limit), completion in zip(requests, completions):
        assert len(completion.token_ids) == limit
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, prompt, completion.token_ids, 1.0),
                                                    abs=TOL)


def test_stop_tokens_and_late_requests(model_dir):
    engine = BuiltinEngine(model_dir, seed=2)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    stops = tuple(range(0, VOCAB, 3))  # a third of the vocabulary: rows stop after a few tokens

    async def late():
        while engine.decode_steps < 2:  # arrives while the others decode: joins them
            await asyncio.sleep(0)
        assert engine.in_flight() > 0
        return await engine.generate([30, 31], SamplingParams(5, 1.3))

    async def main():
        return await asyncio.gather(*(engine.generate([i + 1] * (i + 1), SamplingParams(20, 1.3, stops))
                                      for i in range(4)), late())

    *stopped, late_completion = asyncio.run(main())
    for i, completion in enumerate(stopped):
        assert completion.finish_reason == "stop" and completion.token_ids[-1] in stops
        assert not set(completion.token_ids[:-1]) & set(stops)
        expected = reference_logprobs(reference, [i + 1] * (i + 1), completion.token_ids, 1.3)
        assert completion.logprobs == pytest.approx(expected, abs=TOL)
    assert len(late_completion.token_ids) == 5 and late_completion.finish_reason == "length"
    expected = reference_logprobs(reference, [30, 31], late_completion.token_ids, 1.3)
    assert late_completion.logprobs == pytest.approx(expected, abs=TOL)


def test_same_seed_same_samples(model_dir):
    async def run(seed):
        engine = BuiltinEngine(model_dir, seed=seed)
        return (await engine.generate([1, 2, 3], SamplingParams(10, 1.0))).token_ids

    assert asyncio.run(run(7)) == asyncio.run(run(7))
    assert asyncio.run(run(7)) != asyncio.run(run(8))


def test_interrupt_weight_swap_retags_later_tokens(model_dir):
    engine = BuiltinEngine(model_dir, seed=3)
    old = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    new = tiny_qwen2(seed=1)
    state_dict = {k: v for k, v in new.state_dict().items() if k != "lm_head.weight"}  # tied: sent once
    prompts = [[1, 2, 3, 4], [9, 8]]

    async def swap():
        while engine.decode_steps < 4:
            await asyncio.sleep(0)
        engine.stage_weights(state_dict, 1)

    async def main():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(10, 0.9)) for p in prompts), swap())

    *completions, _ = asyncio.run(main())
    assert engine.version == 1
    for prompt, completion in zip(prompts, completions):
        assert completion.versions == [0] * 4 + [1] * 6  # 4 forwards under v0, the rest under v1
        before = reference_logprobs(old, prompt, completion.token_ids, 0.9)[:4]
        after = reference_logprobs(new, prompt, completion.token_ids, 0.9)[4:]
        assert completion.logprobs[:4] == pytest.approx(before, abs=TOL)
        assert completion.logprobs[4:] == pytest.approx(after, abs=TOL)  # the cache was recomputed


def test_weights_that_do_not_fit_are_refused(model_dir):
    engine = BuiltinEngine(model_dir)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = tiny_qwen2(seed=5).state_dict()
    for bad in ({k: v for k, v in good.items() if "layers.1." not in k},  # missing keys
                {**good, "model.extra.weight": torch.zeros(1)},  # unexpected key
                {**good, "model.norm.weight": torch.zeros(3)}):  # wrong shape
        with pytest.raises(KeyError, match="do not fit"):
            engine.stage_weights(bad, 1)
    assert engine.version == 0
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())  # nothing half-loaded


def test_a_failing_step_fails_its_callers_and_later_requests_are_served(model_dir):
    engine = BuiltinEngine(model_dir)
    with pytest.raises(ValueError, match=r"token ids 101\.\.101 are not all in the model's vocabulary \[0, 96\)"):
        asyncio.run(engine.generate([VOCAB + 5], SamplingParams(3)))  # refused before it can fail a step
    logits = engine.model.logits

    def broken(hidden):
        engine.model.logits = logits  # fails once
        raise RuntimeError("the forward failed")

    engine.model.logits = broken

    async def main():
        return await asyncio.gather(engine.generate([1, 2], SamplingParams(3)), engine.generate([3], SamplingParams(3)),
                                    return_exceptions=True)

    assert [str(error) for error in asyncio.run(main())] == ["the forward failed"] * 2
    assert asyncio.run(asyncio.wait_for(engine.generate([1], SamplingParams(2)), 10)).finish_reason == "length"


def staggered(engine: BuiltinEngine, requests: list[tuple[int, list[int], int]], temperature: float = 0.9,
              swap=None):
    """Run `requests` (arrival step, prompt, max_new_tokens), each sent once engine.decode_steps reaches
    its arrival step; `swap` = (step, state_dict, version) stages weights at that step."""

    async def one(at, prompt, limit):
        while engine.decode_steps < at:
            await asyncio.sleep(0)
        return await engine.generate(prompt, SamplingParams(limit, temperature))

    async def stage(at, state_dict, version):
        while engine.decode_steps < at:
            await asyncio.sleep(0)
        engine.stage_weights(state_dict, version)

    async def main():
        swapping = [stage(*swap)] if swap else []
        return (await asyncio.gather(*(one(*r) for r in requests), *swapping))[: len(requests)]

    return asyncio.run(main())


def test_a_late_request_finishes_while_a_long_one_decodes(model_dir):
    engine = BuiltinEngine(model_dir, seed=4)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()

    async def main():
        long = asyncio.ensure_future(engine.generate([7, 8, 9], SamplingParams(60, 1.0)))
        while engine.decode_steps < 3:
            await asyncio.sleep(0)
        short = await engine.generate([30, 31], SamplingParams(5, 1.0))
        finished_at = engine.decode_steps
        assert not long.done() and engine.in_flight() == 1  # joined the running row, did not wait for it
        return short, await long, finished_at

    short, long, finished_at = asyncio.run(main())
    assert finished_at == 3 + 5  # it joined the long row's steps from step 3: its five tokens in five of them
    assert len(short.token_ids) == 5 and len(long.token_ids) == 60
    assert engine.decode_steps == 60  # the long row's 60 steps: the short row joined them, no forward of its own
    for prompt, completion in (([30, 31], short), ([7, 8, 9], long)):
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, prompt, completion.token_ids, 1.0),
                                                    abs=TOL)


# (arrival step, prompt, max_new_tokens): 12 rows outgrow the first 8 slots, the longest row its first 64
# positions; rows finish out of order, so running rows move slots while others keep decoding.
STAGGERED = [(0, [5, 6, 7, 8, 9, 10, 11], 30), (0, [3], 4), (2, list(range(20, 60)), 35), (2, [40, 41], 3),
             (5, [1, 2], 12), (5, [9] * 9, 7), (6, [12, 13, 14], 20), (6, [50], 2), (9, list(range(60, 90)), 9),
             (9, [4, 4], 25), (9, [70, 71, 72], 6), (11, [33] * 5, 15)]


def test_rows_joining_at_different_steps_match_a_full_forward(model_dir):
    engine = BuiltinEngine(model_dir, seed=5)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    completions = staggered(engine, STAGGERED)
    assert engine.cache.pool.in_use() == 0 and engine.cache.pool.peak == 14  # every block back in the pool
    for (_, prompt, limit), completion in zip(STAGGERED, completions):
        assert len(completion.token_ids) == limit and completion.finish_reason == "length"
        expected = reference_logprobs(reference, prompt, completion.token_ids, 0.9)
        assert completion.logprobs == pytest.approx(expected, abs=TOL)
    assert engine.in_flight() == 0


def test_swap_mid_decode_recomputes_every_running_row(model_dir):
    engine = BuiltinEngine(model_dir, seed=6)
    old = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    new = tiny_qwen2(seed=2)
    state_dict = {k: v for k, v in new.state_dict().items() if k != "lm_head.weight"}
    completions = staggered(engine, STAGGERED, swap=(8, state_dict, 1))
    assert engine.version == 1
    swapped_mid_row = 0
    for (_, prompt, _), completion in zip(STAGGERED, completions):
        cut = completion.versions.count(0)
        assert completion.versions == [0] * cut + [1] * (len(completion.versions) - cut)
        swapped_mid_row += 0 < cut < len(completion.versions)
        before = reference_logprobs(old, prompt, completion.token_ids, 0.9)[:cut]
        after = reference_logprobs(new, prompt, completion.token_ids, 0.9)[cut:]
        assert completion.logprobs == pytest.approx(before + after, abs=TOL)
    assert swapped_mid_row == 5


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_lengths_are_not_capped_at_max_position_embeddings(model_dir, graphs, monkeypatch):
    """As with HF (its positions extrapolate): prompt + max_new_tokens past the model's 256. The block table
    widens from 256 positions mid-decode: a new tensor, so the decode graphs are captured again (the short
    row, alone before and after the long one, would otherwise replay its first graph on the old table)."""
    engine = BuiltinEngine(model_dir, seed=8)
    captured = emulate_decode_graphs(engine, monkeypatch) if graphs else []
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    requests = [(0, [1, 2, 3], 40), (3, [1 + i % (VOCAB - 1) for i in range(250)], 12)]
    completions = staggered(engine, requests, temperature=1.0)
    assert engine.cache.table.shape[1] * engine.cache.pool.block_size > 256  # the block table widened
    assert not graphs or sum(graph.replays for graph in captured) == engine.decode_steps - 1 == 39  # not the prefill
    for (_, prompt, limit), completion in zip(requests, completions):
        assert len(completion.token_ids) == limit
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, prompt, completion.token_ids, 1.0),
                                                    abs=TOL)


def randomized(model):
    """HF initializes norms to 1 and biases to 0, which would hide a forward that skips them."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.eval()


SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILY = {
    "llama-untied-no-bias": (LlamaForCausalLM, LlamaConfig(**SIZES, tie_word_embeddings=False)),
    "qwen2-qkv-bias": (Qwen2ForCausalLM, Qwen2Config(**SIZES, tie_word_embeddings=True)),
    "qwen3-qk-norm": (Qwen3ForCausalLM, Qwen3Config(**SIZES, head_dim=24)),
    "mistral-sliding-window": (MistralForCausalLM, MistralConfig(**SIZES, sliding_window=6)),
}


@pytest.mark.parametrize("name", FAMILY)
def test_llama_family_matches_hf(name, tmp_path):
    cls, config = FAMILY[name]
    torch.manual_seed(0)
    randomized(cls(config)).save_pretrained(tmp_path)
    engine = BuiltinEngine(str(tmp_path), seed=7)
    reference = cls.from_pretrained(tmp_path).eval()
    if name.startswith("llama"):
        assert engine.model.lm_head.weight.data_ptr() != engine.model.model.embed_tokens.weight.data_ptr()
    requests = STAGGERED[:6]
    for (_, prompt, _), completion in zip(requests, staggered(engine, requests)):
        expected = reference_logprobs(reference, prompt, completion.token_ids, 0.9)
        assert completion.logprobs == pytest.approx(expected, abs=TOL)


@pytest.mark.parametrize("name", ["qwen2-qkv-bias", "mistral-sliding-window"])
def test_later_turns_reuse_the_episodes_cache_and_match_a_full_forward(name, tmp_path):
    """Episodes of 3 turns, with tool tokens between turns and turns that join a running batch: each later
    turn finds the full blocks of its earlier turns by their prefix hashes and computes only the rest, and
    every logprob still equals one full forward over the whole history; a turn that does not continue its
    episode's tokens finds none."""
    cls, config = FAMILY[name]
    torch.manual_seed(0)
    randomized(cls(config)).save_pretrained(tmp_path)
    engine = BuiltinEngine(str(tmp_path), seed=8, block_size=4)
    reference = cls.from_pretrained(tmp_path).eval()
    prompts = {f"e{i}": [5 + i, 6, 7 + i, 8, 9][: 2 + i % 4] for i in range(6)}
    turns = []  # (episode, context, completion, weights version at the end)

    async def episode(key, prompt):
        ids = list(prompt)
        for turn, limit in enumerate((4 + len(key), 7, 3)):
            await asyncio.sleep(0.001 * (hash(key) % 3))  # the "tool" of each episode takes its own time
            context = ids if key != "e5" or turn < 2 else [1] + ids[1:]  # e5's last turn rewrites its history
            completion = await engine.generate(context, SamplingParams(limit, 0.9), episode_id=key)
            turns.append((key, list(context), completion))
            ids = context + completion.token_ids + [2, 3 + turn]

    async def main():
        await asyncio.gather(*(episode(key, prompt) for key, prompt in prompts.items()))

    asyncio.run(main())
    for _, context, completion in turns:
        expected = reference_logprobs(reference, context, completion.token_ids, 0.9)
        assert completion.logprobs == pytest.approx(expected, abs=TOL)
    continued = [context for key, context, _ in turns if len(context) > len(prompts[key]) and context[0] != 1]
    assert len(continued) == 2 * len(prompts) - 1  # every later turn but e5's rewritten one
    # a later turn's context = the previous context + completion + 2 tool tokens; the cache held all of it
    # but the last sampled token, its full blocks by hash
    assert sum(c.cached_tokens for *_, c in turns) == sum(4 * ((len(context) - 3) // 4) for context in continued)
    assert [c.prefill_tokens for *_, c in turns] == [len(context) for _, context, _ in turns]


def test_a_later_turn_admitted_beside_a_longer_prompt_fits_the_cache(model_dir):
    # the later turn reuses the 56 cached tokens of its 14 full blocks and computes 4 beside a 20-token prompt,
    # in one span: both rows' 15 columns of the block table are read, the prompt's 10 past its own 5 masked
    engine = BuiltinEngine(model_dir, seed=2, block_size=4)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    prompt = list(range(10, 60))
    first = asyncio.run(engine.generate(prompt, SamplingParams(8, 1.0), episode_id="e"))
    context, fresh = prompt + first.token_ids + [2, 3], list(range(60, 80))

    async def together():
        return await asyncio.gather(engine.generate(context, SamplingParams(4, 1.0), episode_id="e"),
                                    engine.generate(fresh, SamplingParams(4, 1.0)))

    later, other = asyncio.run(together())
    assert later.cached_tokens == 56 and len(context) == 60
    for ids, completion in ((context, later), (fresh, other)):
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, ids, completion.token_ids, 1.0),
                                                    abs=TOL)


def test_a_weight_swap_between_turns_drops_the_cached_blocks(model_dir):
    engine = BuiltinEngine(model_dir, seed=9, block_size=4)
    new = tiny_qwen2(seed=3)
    first = asyncio.run(engine.generate([4, 5, 6], SamplingParams(5, 1.0), episode_id="e"))
    engine.stage_weights({k: v for k, v in new.state_dict().items() if k != "lm_head.weight"}, 1)
    context = [4, 5, 6] + first.token_ids + [2]
    second = asyncio.run(engine.generate(context, SamplingParams(5, 1.0), episode_id="e"))
    assert second.cached_tokens == 0 and second.versions == [1] * 5
    assert second.logprobs == pytest.approx(reference_logprobs(new, context, second.token_ids, 1.0), abs=TOL)
    third = asyncio.run(engine.generate(context + second.token_ids + [2], SamplingParams(2, 1.0), episode_id="e"))
    # same weights: the 3 full blocks of the 13 positions the second turn cached are reused
    assert third.cached_tokens == 12 and len(context) + 4 == 13 and len(third.token_ids) == 2


def test_unsupported_models_are_refused_in_one_line(tmp_path):
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"model.path=.*gpt2.*model_type 'gpt2'"):
        BuiltinEngine(str(tmp_path / "gpt2"))
    dynamic = LlamaConfig(**SIZES, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    LlamaForCausalLM(dynamic).save_pretrained(tmp_path / "dynamic")
    with pytest.raises(ValueError, match=r"config.rope_parameters=.*dynamic"):
        BuiltinEngine(str(tmp_path / "dynamic"))


def test_lockstep_waves_do_not_depend_on_timing(model_dir):
    """run.deterministic: episodes that reach the engine in another order and at other times (a tool call
    that took longer) get the same tokens and logprobs, because each wave waits for every live episode.
    Without lockstep, the same schedules batch differently (and one row's logits change in their last bits)."""
    prompts = {f"0-{g}-{s}": [5 + g, 6 + s, 7, 8 + g * s] for g in range(3) for s in range(3)}

    async def episode(engine, episode_id, prompt, delays):
        ids, out = list(prompt), []
        for delay in delays:  # two turns, a "tool call" of `delay` seconds before each
            await asyncio.sleep(delay)
            completion = await engine.generate(ids, SamplingParams(5, 1.0), episode_id=episode_id)
            ids += completion.token_ids + [3]
            out.append((completion.token_ids, completion.logprobs))
        return out

    async def run(order, delays, lockstep):
        engine, live = BuiltinEngine(model_dir, seed=3), [len(order)]
        if lockstep:
            engine.lockstep = lambda: live[0]  # the worker's count of episodes that will call generate again
        episodes = [asyncio.ensure_future(episode(engine, key, prompts[key], delays[key])) for key in order]
        for future in episodes:
            future.add_done_callback(lambda _: live.__setitem__(0, live[0] - 1))
        return dict(zip(order, await asyncio.gather(*episodes)))

    keys = list(prompts)
    calm = {key: (0.0, 0.0) for key in keys}
    jittery = {key: (0.002 * (i % 3), 0.004 * ((i * 7) % 5)) for i, key in enumerate(keys)}
    first = asyncio.run(run(keys, calm, lockstep=True))
    assert asyncio.run(run(keys[::-1], jittery, lockstep=True)) == first
    assert asyncio.run(run(keys[::-1], jittery, lockstep=False)) != first


class EmulatedGraph:
    """A CUDA graph as the CPU can stand in for one: `replay` runs the captured step again and writes its output
    where the capture left it, after checking that each tensor the step reads (`reads()`: the engine's buffers,
    cache and weights) is still the memory it was captured on; a real graph would read that memory."""

    def __init__(self, step, reads):
        self.step, self.reads = step, reads
        self.addresses = [tensor.data_ptr() for tensor in reads()]
        self.hidden = step()  # the warm-up run before a capture: it writes the same keys and values
        self.replays = 0

    def replay(self) -> None:
        assert [tensor.data_ptr() for tensor in self.reads()] == self.addresses, "a replay would read stale memory"
        self.hidden.copy_(self.step())
        self.replays += 1


def emulate_decode_graphs(engine: BuiltinEngine, monkeypatch) -> list[EmulatedGraph]:
    """The engine's CUDA path on the CPU: its decode steps go through DecodeGraphs, with EmulatedGraphs (all
    it captures, returned), and blocks of queries through CUDA's attention (kv heads repeated)."""
    monkeypatch.setattr(llama_forward, "_gqa_sdpa", llama_forward._expanded_sdpa)
    graphs, captured = DecodeGraphs(engine.model, engine.runner.next_tokens, engine.runner.lens), []

    def capture(step, pool):
        runner = engine.runner
        captured.append(EmulatedGraph(step, lambda: [runner.next_tokens, runner.lens, engine.cache.table,
                                                     engine.cache.kv, *engine.model.parameters()]))
        return captured[-1], captured[-1].hidden

    monkeypatch.setattr(decode_graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    engine.runner.graphs = graphs
    return captured


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_match_a_full_forward_under_their_versions(seed, graphs, tmp_path, monkeypatch):
    """Everything at once, drawn from `seed`: a few rows (requests queue), blocks of 1, 4 or 16 positions in
    a pool that holds the longest request and little more (rows are preempted) or a large one, groups that
    repeat a prompt, episodes of 1-3 turns with tool tokens and their own latencies (their blocks found by
    hash), stop tokens, a request cancelled at the third step (running, or still queued), and a weight swap
    mid-decode. Every token's logprob equals a full forward over its context under the weights of the
    version it is tagged with; stops and lengths hold; after every step the blocks in use are those the
    running rows hold, within the pool; the engine ends empty. Dropping the temperatures' move in
    `ModelRunner.compact`, or the copies' blocks in `BlockPool.share`, fails it."""
    rng = random.Random(seed)
    randomized(tiny_qwen2()).save_pretrained(tmp_path)
    block_size, rows, tight = rng.choice([1, 4, 16]), rng.choice([3, 6, 16]), seed % 2 == 0
    engine = BuiltinEngine(str(tmp_path), seed=seed, max_batch_size=rows, block_size=block_size,
                           num_blocks=-(-82 // block_size) + 1 if tight else 4096)  # a request: <= 82 positions
    captured = emulate_decode_graphs(engine, monkeypatch) if graphs else []
    waits, step = HostWaits(), engine._step  # the step's one wait (.tolist() of what it sampled) is no op here

    def watched_step():
        with waits:
            step()
        held = {block for request in engine.scheduler.running for block in request.blocks}
        assert engine.cache.pool.in_use() == len(held) <= engine.cache.pool.capacity

    engine._step = watched_step
    weights = [Qwen2ForCausalLM.from_pretrained(tmp_path).eval(), randomized(tiny_qwen2(seed=seed + 100))]
    stops, swap_at = tuple(rng.sample(range(VOCAB), 4)), rng.randint(1, 30)
    shared_prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    turns = []  # (context, params, completion)

    async def episode(key):
        ids = list(rng.choice(shared_prompts)) if rng.random() < 0.5 else \
            [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
        for _ in range(rng.randint(1, 3)):
            await asyncio.sleep(0.0005 * rng.randint(0, 6))
            params = SamplingParams(rng.randint(1, 18), rng.choice([0.7, 1.0]), stops)
            completion = await engine.generate(ids, params, episode_id=key if rng.random() < 0.8 else None)
            turns.append((ids, params, completion))
            ids = ids + completion.token_ids + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 4))]

    async def swap():
        while engine.decode_steps < swap_at and (engine.in_flight() or not engine.decode_steps):
            await asyncio.sleep(0)
        engine.stage_weights({k: v for k, v in weights[1].state_dict().items() if k != "lm_head.weight"}, 1)

    async def cancelled():
        task = asyncio.ensure_future(engine.generate([7, 8, 9], SamplingParams(40, 1.0), episode_id="gone"))
        while engine.decode_steps < 3:
            await asyncio.sleep(0)
        task.cancel()
        return (await asyncio.gather(task, return_exceptions=True))[0]

    async def main():
        return await asyncio.gather(cancelled(), swap(), *(episode(f"e{i}") for i in range(14)))

    assert isinstance(asyncio.run(main())[0], asyncio.CancelledError)
    assert engine.in_flight() == 0 and engine.version == 1 and engine.cache.pool.in_use() == 0
    assert not (tight and rows > 3) or sum(c.preemptions for *_, c in turns) > 0
    assert not graphs or sum(graph.replays for graph in captured) > engine.decode_steps / 2
    assert waits.ops == []  # on a GPU, each would stall the host before the next step's kernels
    for context, params, completion in turns:
        tokens, versions = completion.token_ids, completion.versions
        assert not set(tokens[:-1]) & set(stops) and 1 <= len(tokens) <= params.max_new_tokens
        assert (completion.finish_reason == "stop") == (tokens[-1] in stops)
        assert completion.finish_reason == "stop" or len(tokens) == params.max_new_tokens
        assert versions == sorted(versions)
        expected = [reference_logprobs(model, context, tokens, params.temperature) for model in weights]
        assert completion.logprobs == pytest.approx([expected[v][i] for i, v in enumerate(versions)], abs=TOL)


def save_checkpoint(model, path: Path, layout: str) -> None:
    """`model` as transformers saves it: sharded safetensors under an index, or PyTorch's pickles (older
    transformers, many Hub checkpoints) in one file or two shards under pytorch_model.bin.index.json."""
    if layout == "safetensors shards":
        model.save_pretrained(path, max_shard_size="30KB")
        return
    model.config.save_pretrained(path)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    if layout == "bin":
        torch.save(state, path / "pytorch_model.bin")
        return
    names = sorted(state)
    shards = {"pytorch_model-1.bin": names[: len(names) // 2], "pytorch_model-2.bin": names[len(names) // 2:]}
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, path / file)
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("layout", ["safetensors shards", "bin", "bin shards"])
def test_every_checkpoint_layout_loads_the_same_weights(model_dir, tmp_path, layout):
    save_checkpoint(tiny_qwen2(), tmp_path, layout)
    loaded, reference = BuiltinEngine(str(tmp_path)).model, BuiltinEngine(model_dir).model
    assert loaded.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], reference.state_dict()[k]) for k in reference.state_dict())


def test_a_hub_id_with_only_pytorch_pickles_downloads_them(model_dir, tmp_path, monkeypatch):
    """A Hub repository that ships pytorch_model.bin and no safetensors: the first download (safetensors) finds
    none, the second fetches the pickles (a fake hub: a folder, each download copying the patterns asked for)."""
    hub = tmp_path / "hub"
    save_checkpoint(tiny_qwen2(), hub, "bin")
    asked = []

    def download(repo_id, allow_patterns):
        asked.append(allow_patterns)
        local = tmp_path / f"snapshot{len(asked)}"
        local.mkdir()
        for file in hub.iterdir():
            if any(file.match(pattern) for pattern in allow_patterns):
                shutil.copy(file, local / file.name)
        return str(local)

    monkeypatch.setattr(checkpoint_reader, "snapshot_download", download)
    loaded, reference = BuiltinEngine("someone/tiny-bin-only").model, BuiltinEngine(model_dir).model
    assert asked == [["*.json", "*.safetensors"], ["*.json", "*.bin"]]
    assert all(torch.equal(loaded.state_dict()[k], reference.state_dict()[k]) for k in reference.state_dict())


def test_a_folder_without_weights_names_the_model_path(model_dir, tmp_path):
    (tmp_path / "config.json").write_text((Path(model_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model.path='.*': .* holds no model.safetensors or pytorch_model.bin"):
        BuiltinEngine(str(tmp_path))

