"""TransformersEngine: batched decoding with our own KV cache, checked against a full forward pass.

Fast CPU tests on a tiny random Qwen2 (hidden 64, 2 layers): logprobs of concurrent requests of
different lengths equal those of a recomputed forward pass, stop tokens and max_new_tokens hold, and
an interrupt-mode weight swap re-tags later tokens with the new version and samples them from the new
weights.
"""

import asyncio

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from nanoverl_async.generators.engine import SamplingParams
from nanoverl_async.generators.hf_engine import TransformersEngine

VOCAB = 96
TOL = 1e-4


def tiny_qwen2(vocab_size: int = VOCAB, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
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
    engine = TransformersEngine(model_dir, seed=1)
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


def test_stop_tokens_and_late_requests(model_dir):
    engine = TransformersEngine(model_dir, seed=2)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    stops = tuple(range(0, VOCAB, 3))  # a third of the vocabulary: rows stop after a few tokens

    async def late():
        while engine.decode_steps < 2:  # arrives while the first batch is decoding: joins the next one
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
        engine = TransformersEngine(model_dir, seed=seed)
        return (await engine.generate([1, 2, 3], SamplingParams(10, 1.0))).token_ids

    assert asyncio.run(run(7)) == asyncio.run(run(7))
    assert asyncio.run(run(7)) != asyncio.run(run(8))


@pytest.mark.parametrize("recompute", [True, False])
def test_interrupt_weight_swap_retags_later_tokens(model_dir, recompute):
    engine = TransformersEngine(model_dir, seed=3, recompute_cache_on_swap=recompute)
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
        if recompute:  # the cache was recomputed: exactly the new weights on the whole context
            assert completion.logprobs[4:] == pytest.approx(after, abs=TOL)
        else:  # stale keys/values of earlier tokens: a mixture, not the new weights' logprobs
            assert completion.logprobs[4:] != pytest.approx(after, abs=TOL)


def test_weights_that_do_not_fit_are_refused(model_dir):
    engine = TransformersEngine(model_dir)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = tiny_qwen2(seed=5).state_dict()
    for bad in ({k: v for k, v in good.items() if "layers.1." not in k},  # missing keys
                {**good, "model.extra.weight": torch.zeros(1)},  # unexpected key
                {**good, "model.norm.weight": torch.zeros(3)}):  # wrong shape
        with pytest.raises(KeyError, match="do not fit"):
            engine.stage_weights(bad, 1)
    assert engine.version == 0
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())  # nothing half-loaded


def test_a_failing_batch_fails_its_callers(model_dir):
    engine = TransformersEngine(model_dir)

    async def main():
        return await engine.generate([VOCAB + 5], SamplingParams(3))  # out-of-vocabulary id

    with pytest.raises(IndexError):
        asyncio.run(main())
    assert asyncio.run(asyncio.wait_for(engine.generate([1], SamplingParams(2)), 10)).finish_reason == "length"
