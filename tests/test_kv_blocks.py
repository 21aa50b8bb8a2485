"""The paged KV cache: kv_blocks.BlockPool on its own, and BuiltinEngine under a block budget.

Pool: the budget's units (a fraction in (0, 1] of free memory, a size with its unit, a bare number above 1 in
GiB; the engine's default for 0 in any spelling) at their boundaries, and the one line naming the key for every
value that is none of them; never-used blocks
are handed out first, then released ones, least recent first, those holding no full prefix before those that
do; refcounts; prefix hashes chain (one different token early changes every later hash) and name the seed.
Engine, against a full forward under each token's weights version (tests/test_engine.py's machinery): a
request that needs exactly the pool runs and one more position is refused in one line, and so is a row that
outgrows the pool (a planted bug: one token past max_new_tokens) rather than waiting forever; preempted rows
return to the queue's front in admission order and find their cached blocks; rows that fill the pool exactly
run together, one position more waits; a pool too small for every row preempts rows (never drops one), the
blocks in use never pass the pool and every block is back when the engine is empty; a group's samples share
their prompt's blocks, and each copies the shared last block before writing into it (copy on write), leaving
the others' tokens unchanged; another group with the same system prompt finds its full blocks by hash; a
4k-token row on a builtin:tiny-shaped model, with a weight swap mid-decode and preemptions, matches token by
token; a step computes at most `prefill_tokens` of the requests it admits, past their cached prefixes; a span
pads its queries to at most twice its tokens; the config keys' bounds.
"""

import asyncio
import dataclasses

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from nanoverl_async.config import ConfigError, load_config
from nanoverl_async.agents.engine import SamplingParams
from nanoverl_async.generators.builtin_engine import BuiltinEngine
from nanoverl_async.generators.kv_blocks import GIB, BlockPool, pool_blocks, prefix_hashes, version_seed
from nanoverl_async.generators.llama_forward import Tokens
from nanoverl_async.validation import kv_cache_budget, validate
from test_engine import TOL, model_dir, one_thread, randomized, reference_logprobs, staggered  # noqa: F401


def test_the_budget_is_a_fraction_up_to_one_a_size_with_its_unit_and_gib_above_one():
    assert pool_blocks(0.5, free_bytes=1000, block_bytes=100) == 5
    assert pool_blocks(1.0, free_bytes=1000, block_bytes=100) == 10  # 1 is the whole free memory, not 1 GiB
    assert pool_blocks(1, free_bytes=1000, block_bytes=100) == 10
    assert pool_blocks(1.0001, free_bytes=1000, block_bytes=GIB // 4) == 4  # just above 1: GiB
    assert pool_blocks(1.5, free_bytes=1000, block_bytes=GIB // 4) == 6
    assert pool_blocks("1GiB", free_bytes=1000, block_bytes=GIB // 4) == 4  # 1 GiB needs its unit
    assert pool_blocks("0.5GiB", free_bytes=1000, block_bytes=GIB // 4) == 2  # under 1 GiB, in GiB
    assert pool_blocks("512MiB", free_bytes=1000, block_bytes=2**20) == 512
    assert pool_blocks(" 3 MiB ", free_bytes=1000, block_bytes=2**20) == 3
    assert pool_blocks(0.2, free_bytes=1000, block_bytes=100) == 2  # the least: the null block and one
    with pytest.raises(ValueError, match=r"generator.kv_cache_memory=0.19 .*less than two KV blocks"):
        pool_blocks(0.19, free_bytes=1000, block_bytes=100)
    with pytest.raises(ValueError, match=r"generator.kv_cache_memory=1MiB .*less than two KV blocks"):
        pool_blocks("1MiB", free_bytes=1000, block_bytes=2**20)


@pytest.mark.parametrize("value, budget", [
    (0, (0, 0)), (0.0, (0, 0)), ("0", (0, 0)), ("0.0", (0, 0)),  # the engine's default, however written
    (1e-9, (1e-9, 0)), (0.5, (0.5, 0)), ("0.5", (0.5, 0)), (1, (1.0, 0)), (1.0, (1.0, 0)),  # fractions up to 1
    (1.0001, (0, int(1.0001 * GIB))), (2, (0, 2 * GIB)), ("1e3", (0, 1000 * GIB)),  # a bare number above 1: GiB
    ("4GiB", (0, 4 * GIB)), ("0.5GiB", (0, GIB // 2)), (".5GiB", (0, GIB // 2)), ("1GiB", (0, GIB)),
    ("512MiB", (0, 2**29)), ("1MiB", (0, 2**20)), ("4 GiB", (0, 4 * GIB))])
def test_the_kv_cache_memory_key_reads_fractions_sizes_and_gib(value, budget):
    cfg = load_config(None, [f"generator.kv_cache_memory={value}"])
    assert kv_cache_budget(cfg.generator.kv_cache_memory) == budget


@pytest.mark.parametrize("value, error", [
    (-0.01, "must be >= 0, got -0.01"), (".inf", "must be a finite number"), (".nan", "must be a finite number"),
    ("0GiB", "a size must be more than 0 bytes, got '0GiB'"), ("0.0MiB", "more than 0 bytes"),
    ("-1GiB", "must be a fraction in (0, 1] of the free device memory, a size in GiB or MiB (4GiB, 512MiB) or 0 "
              "(the engine's default), got '-1GiB'"),
    ("4GB", "got '4GB'"), ("4gib", "got '4gib'"), ("4 G", "got '4 G'"), ("GiB", "got 'GiB'"), ("4GiBs", "got '4GiBs'"),
    ("4KiB", "got '4KiB'"), ("50%", "got '50%'"), ("nan", "got 'nan'"), ("inf", "got 'inf'"), ("-1", "got '-1'")])
def test_a_bad_kv_cache_memory_is_refused_in_one_line_naming_the_key(value, error):
    if isinstance(value, str) and value[0] == "-":
        value = f"'{value}'"  # quoted: a string, past the check of every number
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"generator.kv_cache_memory={value}"])
    message = str(refused.value)
    assert message.startswith("config key 'generator.kv_cache_memory': ") and "\n" not in message
    assert error in message


def test_the_engine_takes_its_default_for_zero_however_written_and_a_size_in_bytes(model_dir):
    blocks = [BuiltinEngine(model_dir, kv_cache_memory=memory, block_size=4).cache.pool.num_blocks
              for memory in (0, "0", 0.0, "2GiB", "2048MiB", "1MiB")]
    assert blocks[:5] == [blocks[0]] * 5  # 0 on the CPU is 2GiB
    assert blocks[5] * 1024 * 2 == blocks[0]


def test_the_pool_reuses_blocks_without_a_prefix_then_fresh_ones_then_the_least_recently_released():
    pool = BlockPool(6, block_size=2)
    a, b = pool.allocate(2), pool.allocate(2)
    assert (a, b, pool.in_use(), pool.free(), pool.peak) == ([1, 2], [3, 4], 4, 1, 4)
    pool.register(b"a0", a[0])  # a's first block is full and holds a prefix; its second does not
    pool.release(a)
    pool.release(b)
    assert pool.in_use() == 0 and pool.free() == 5 and pool.match([b"a0", b"x"]) == [1]
    # the released blocks that hold no prefix (the latest released first), then fresh 5, then block 1
    assert pool.allocate(2) == [3, 4] and pool.match([b"a0"]) == [1]
    assert pool.allocate(2) == [2, 5] and pool.match([b"a0"]) == [1]  # the last without a prefix, one fresh
    assert pool.allocate(1) == [1]
    assert pool.match([b"a0"]) == [] and pool.free() == 0  # handing block 1 out evicted its prefix
    with pytest.raises(RuntimeError, match="1 KV blocks asked, 0 free"):
        pool.allocate(1)


def test_shared_blocks_are_refcounted_and_a_released_hit_stops_being_free():
    pool = BlockPool(4, block_size=2)
    blocks = pool.allocate(2)
    pool.register(b"p", blocks[0])
    assert pool.take(blocks) == blocks and pool.refs[blocks[0]] == 2 and pool.in_use() == 2
    pool.release(blocks)
    assert pool.refs[blocks[0]] == 1
    pool.release(blocks)
    hits = pool.match([b"p"])
    assert hits == [blocks[0]] and pool.free() == 3
    assert pool.fits(hits, 2) and not pool.fits(hits, 3)  # taking the hit leaves 2 free, not 3
    pool.register(b"q", blocks[0])  # a block keeps its first prefix, a prefix its first block
    pool.register(b"p", blocks[1])
    assert pool.match([b"q"]) == [] and pool.match([b"p"]) == [blocks[0]]
    pool.forget()
    assert pool.match([b"p"]) == []


def test_prefix_hashes_chain_over_full_blocks_and_name_the_weights():
    tokens = list(range(10))
    hashes = prefix_hashes(tokens, 4, version_seed(0))
    assert len(hashes) == 2  # the last 2 tokens do not fill a block
    assert prefix_hashes(tokens + [7, 7], 4, version_seed(0), hashes[:1]) == prefix_hashes(tokens + [7, 7], 4,
                                                                                          version_seed(0))
    changed = prefix_hashes([99] + tokens[1:], 4, version_seed(0))
    assert changed[0] != hashes[0] and changed[1] != hashes[1]  # a prefix differs: every later block differs
    assert prefix_hashes(tokens, 4, version_seed(1))[0] != hashes[0]


class Budgeted:
    """Runs an engine's steps, recording the blocks in use after each and checking they never pass the pool and
    are exactly those the running rows hold (none leaks)."""

    def __init__(self, engine: BuiltinEngine):
        self.engine, self.step, self.in_use = engine, engine._step, []
        engine._step = self

    def __call__(self):
        self.step()
        engine = self.engine
        held = {block for request in engine.scheduler.running for block in request.blocks}
        assert engine.cache.pool.in_use() == len(held) <= engine.cache.pool.capacity
        self.in_use.append(len(held))


def test_a_request_that_needs_exactly_the_pool_runs_and_one_position_more_is_refused(model_dir):
    engine = BuiltinEngine(model_dir, seed=3, block_size=4, num_blocks=9)  # 8 blocks: 32 positions
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    budget, prompt = Budgeted(engine), list(range(1, 21))
    completion = asyncio.run(engine.generate(prompt, SamplingParams(13, 1.0)))  # 20 + 13 - 1 = 32 positions
    assert len(completion.token_ids) == 13 and max(budget.in_use) == engine.cache.pool.peak == 8
    assert completion.logprobs == pytest.approx(reference_logprobs(reference, prompt, completion.token_ids, 1.0),
                                                abs=TOL)
    with pytest.raises(ValueError, match=r"20 input tokens \+ max_new_tokens=14 need 33 positions of KV cache; "
                                         r"generator.kv_cache_memory holds 32"):
        asyncio.run(engine.generate(prompt, SamplingParams(14, 1.0)))
    assert engine.cache.pool.in_use() == 0


def one_token_past(engine: BuiltinEngine) -> None:
    """Plant the bug `Scheduler.postprocess` must not have: each request samples one token past its
    max_new_tokens, so a row can outgrow the pool that `generate` checked it against."""
    admissions = engine._admissions

    def admitted():
        new = admissions()
        for request in new[0]:
            if not request.completion.token_ids:  # its first admission (a readmitted row has sampled)
                request.params = dataclasses.replace(request.params, max_new_tokens=request.params.max_new_tokens + 1)
        return new

    engine._admissions = admitted


def test_a_row_that_outgrows_the_pool_fails_in_one_line_instead_of_waiting_forever(model_dir):
    """A row past generate's check (the bug above) that reaches exactly the pool's 32 positions finishes; one
    position more and, preempted with the whole pool free, it could never be placed again: its caller gets the
    error at once (requeued, it would wait forever), and the engine serves the next request."""
    engine = BuiltinEngine(model_dir, seed=3, block_size=4, num_blocks=9)  # 8 blocks: 32 positions
    one_token_past(engine)
    exact = asyncio.run(engine.generate(list(range(1, 20)), SamplingParams(13, 1.0)))  # 19 + 14 - 1 = 32
    assert len(exact.token_ids) == 14 and exact.preemptions == 0 and engine.cache.pool.peak == 8
    with pytest.raises(ValueError, match=r"^20 input tokens \+ 13 sampled tokens need 33 positions of KV cache; "
                                         r"generator.kv_cache_memory holds 32$"):
        asyncio.run(asyncio.wait_for(engine.generate(list(range(1, 21)), SamplingParams(13, 1.0)), 60))
    assert engine.in_flight() == 0 and engine.cache.pool.in_use() == 0
    assert len(asyncio.run(engine.generate([5, 6], SamplingParams(3, 1.0))).token_ids) == 4


class Scheduled:
    """Records an engine's scheduling: (step, "admit", the admitted requests) and (step, "preempt", the request),
    each request named by its first input token."""

    def __init__(self, engine: BuiltinEngine):
        self.engine, self.events = engine, []
        self.admissions, self.requeue = engine._admissions, engine.scheduler.requeue
        engine._admissions, engine.scheduler.requeue = self.admitted, self.requeued

    def admitted(self):
        new = self.admissions()
        if new[0]:
            self.events.append((self.engine.decode_steps, "admit", [r.input_ids[0] for r in new[0]]))
        return new

    def requeued(self, count: int, preempted: bool = False):
        if preempted:
            rows = self.engine.scheduler.running[-count:]
            self.events += [(self.engine.decode_steps, "preempt", [r.input_ids[0]]) for r in rows]
        self.requeue(count, preempted)


def test_preempted_rows_are_admitted_again_first_oldest_first_and_find_their_cached_blocks(model_dir):
    """8 blocks of 4, steps numbered by the forwards before them. Rows 10, 20, 30 and 40 (4-token prompts) hold
    2 blocks each from step 1, and 50 arrives at step 3 to a full pool. At step 5 each running row needs a
    third block: the most recently admitted give theirs back, 40 then 30, and return to the front of the queue
    in admission order, ahead of 50; 10 and 20 take 40's blocks (the least recently released), so 30's prefix
    stays cached, and 10 ends (6 tokens). At step 6, 30 finds its 8 positions by hash and takes one block; 40
    needs 3 and waits, and 50 behind it (the queue is served in order), until 20 ends at step 11. Readmitting
    the first preempted first (40 before 30), queueing them at the back (50 first), or evicting the most
    recently released blocks first (30's prefix) each changes this schedule."""
    engine = BuiltinEngine(model_dir, seed=5, block_size=4, num_blocks=9)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    scheduled = Scheduled(engine)
    requests = [(0, [10] * 4, 6)] + [(0, [name] * 4, 12) for name in (20, 30, 40)] + [(3, [50] * 4, 4)]
    completions = staggered(engine, requests, temperature=1.0)
    assert scheduled.events == [(0, "admit", [10, 20, 30, 40]), (5, "preempt", [40]), (5, "preempt", [30]),
                                (6, "admit", [30]), (12, "admit", [40, 50])]
    # (preemptions, prefill tokens, of which cached): 30 and 40 prefill their 4 + 5 tokens again
    assert [(c.preemptions, c.prefill_tokens, c.cached_tokens) for c in completions] == [
        (0, 4, 0), (0, 4, 0), (1, 13, 8), (1, 13, 0), (0, 4, 0)]
    assert engine.cache.pool.peak == 8 and engine.cache.pool.in_use() == 0
    for (_, prompt, limit), completion in zip(requests, completions):
        assert len(completion.token_ids) == limit
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, prompt, completion.token_ids, 1.0),
                                                    abs=TOL)


@pytest.mark.parametrize("prompts,limits,events", [
    ((4, 4, 4), (5, 5, 5), [(0, "admit", [1, 2, 3])]),  # 3 x (4 + 5 - 1) positions = the 6 blocks exactly
    ((4, 4, 5), (5, 5, 5), [(0, "admit", [1, 2, 3]), (4, "preempt", [3]), (5, "admit", [3])]),  # 1 position more
    ((8, 8, 8), (1, 1, 1), [(0, "admit", [1, 2, 3])]),  # the third prompt takes the last 2 free blocks
    ((8, 8, 9), (1, 1, 1), [(0, "admit", [1, 2]), (1, "admit", [3])]),  # 3 blocks: it waits for the first two
], ids=["decode-exact", "decode-one-more", "admit-exact", "admit-one-more"])
def test_rows_that_fill_the_pool_exactly_run_together_and_one_position_more_waits(model_dir, prompts, limits, events):
    """6 blocks of 4. Rows that need exactly the pool, at admission or as they decode, run side by side with
    every block in use; one position more, and the last row waits: preempted when its 9th position starts a
    block (row 3 of 5 + 5 tokens, at step 4), then readmitted with its 8 cached positions once the others end;
    or, at admission, queued for a step."""
    engine = BuiltinEngine(model_dir, seed=2, block_size=4, num_blocks=7)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    scheduled = Scheduled(engine)
    requests = [(0, [row + 1] * size, limit) for row, (size, limit) in enumerate(zip(prompts, limits))]
    completions = staggered(engine, requests, temperature=1.0)
    assert scheduled.events == events
    preempted = len(events) == 3
    assert [c.preemptions for c in completions] == [0, 0, int(preempted)]
    assert completions[2].cached_tokens == 8 * preempted
    assert engine.cache.pool.peak == (4 if events[-1][0] == 1 else 6)
    for (_, prompt, limit), completion in zip(requests, completions):
        assert len(completion.token_ids) == limit
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, prompt, completion.token_ids, 1.0),
                                                    abs=TOL)


def test_a_short_pool_preempts_rows_and_recomputes_them_exactly(model_dir):
    engine = BuiltinEngine(model_dir, seed=5, block_size=4, num_blocks=13)  # 12 blocks for 5 long rows
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    budget = Budgeted(engine)
    requests = [(0, [i + 1] * (3 + i), 30) for i in range(5)] + [(4, [50, 51], 10)]
    completions = staggered(engine, requests, temperature=1.0)
    assert [c.preemptions for c in completions] == [0, 1, 2, 2, 2, 1]  # the last admitted rows, again and again
    assert max(budget.in_use) == engine.cache.pool.capacity
    assert engine.cache.pool.in_use() == 0 and engine.in_flight() == 0
    for (_, prompt, limit), completion in zip(requests, completions):
        assert len(completion.token_ids) == limit and completion.finish_reason == "length"
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, prompt, completion.token_ids, 1.0),
                                                    abs=TOL)


def test_a_group_shares_its_prompt_and_each_sample_copies_the_shared_block_it_writes(model_dir):
    """6 prompt tokens in blocks of 4: the 4 samples share both blocks; the second is half full, and each sample
    writes its first token there. Without the copies, the samples' second tokens would see the last writer's."""
    engine = BuiltinEngine(model_dir, seed=4, block_size=4)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    group = [5, 6, 7, 8, 9, 10]

    async def main():
        return await asyncio.gather(*(engine.generate(group, SamplingParams(3, 1.0)) for _ in range(4)))

    completions = asyncio.run(main())
    assert len({c.token_ids[0] for c in completions}) > 1  # they wrote different tokens into their copies
    for completion in completions:
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, group, completion.token_ids, 1.0),
                                                    abs=TOL)
    assert engine.cow_copies == 3  # the last writer keeps the block
    assert [(c.prefill_tokens, c.cached_tokens) for c in completions] == [(6, 0)] + [(6, 6)] * 3
    assert engine.cache.pool.peak == 2 + 3  # the shared prompt, then 3 copies of its last block


def test_another_group_with_the_same_system_prompt_finds_its_blocks_by_hash(model_dir):
    engine = BuiltinEngine(model_dir, seed=6, block_size=4)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    system = list(range(30, 43))  # 13 tokens: 3 full blocks
    requests = [(0, system + [1, 2], 6), (0, system + [1, 2], 6), (3, system + [7], 5), (3, [9, 9], 5)]
    completions = staggered(engine, requests, temperature=1.0)
    # the second sample copies its first's 15 tokens; the later group finds the 12 tokens of the 3 full blocks
    # per request, as the agent loop sums them for metrics.jsonl's generators/prefix_cache_hit_frac
    assert [(c.prefill_tokens, c.cached_tokens) for c in completions] == [(15, 0), (15, 15), (14, 12), (2, 0)]
    # the group's 4 blocks, its second sample's copy of the last and a block each at position 16, then 1 each
    assert sum(c.preemptions for c in completions) == 0 and engine.cache.pool.peak == 4 + 1 + 2 + 1 + 1
    for (_, prompt, _), completion in zip(requests, completions):
        assert completion.logprobs == pytest.approx(reference_logprobs(reference, prompt, completion.token_ids, 1.0),
                                                    abs=TOL)


def tiny_shaped(vocab: int, seed: int) -> Qwen2ForCausalLM:
    """builtin:tiny's shape (tiny_model.TinyRecipe: hidden 128, 4 layers, 4/2 heads), positions for 4k tokens."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4_608,
                         tie_word_embeddings=True)
    return randomized(Qwen2ForCausalLM(config))


def test_a_4k_token_row_matches_a_full_forward_across_a_swap_and_preemptions(tmp_path):
    vocab = 128
    tiny_shaped(vocab, seed=0).save_pretrained(tmp_path)
    new = tiny_shaped(vocab, seed=1)
    engine = BuiltinEngine(str(tmp_path), seed=2, block_size=16, num_blocks=258)  # 4,112 positions
    budget = Budgeted(engine)
    generator = torch.Generator().manual_seed(0)
    long = torch.randint(1, vocab, (4_000,), generator=generator).tolist()
    requests = [(0, long, 24), (0, [3, 4, 5], 20), (2, list(range(40, 90)), 16), (5, [7] * 9, 12)]
    state_dict = {k: v for k, v in new.state_dict().items() if k != "lm_head.weight"}
    completions = staggered(engine, requests, temperature=1.0, swap=(8, state_dict, 1))
    assert [c.preemptions for c in completions] == [0, 0, 1, 1] and max(budget.in_use) == engine.cache.pool.capacity
    assert engine.cache.pool.in_use() == 0
    weights = [Qwen2ForCausalLM.from_pretrained(tmp_path).eval(), new.eval()]
    for (_, prompt, limit), completion in zip(requests, completions):
        versions = completion.versions
        assert len(completion.token_ids) == limit and versions == sorted(versions)
        expected = [reference_logprobs(model, prompt, completion.token_ids, 1.0) for model in weights]
        assert completion.logprobs == pytest.approx([expected[v][i] for i, v in enumerate(versions)], abs=TOL)
    assert 0 < completions[0].versions.count(0) < len(completions[0].versions)  # swapped mid-decode


def test_a_step_computes_at_most_prefill_tokens_of_the_requests_it_admits(model_dir):
    """10 tokens a step: requests of 6 and 4 tokens join in one step, of 6 and 5 in two (the first of a step
    is admitted whatever its length, or a long context would never run)."""
    for sizes, steps in (((6, 4), [2]), ((6, 5), [1, 1]), ((12, 1), [1, 1])):
        engine = BuiltinEngine(model_dir, seed=1, prefill_tokens=10)
        admitted, admissions = [], engine._admissions

        def counted():
            new = admissions()
            if new[0]:
                admitted.append(len(new[0]))
            return new

        engine._admissions = counted

        async def main():
            return await asyncio.gather(*(engine.generate(list(range(1, 1 + n)), SamplingParams(3, 1.0))
                                          for n in sizes))

        assert [len(c.token_ids) for c in asyncio.run(main())] == [3, 3] and admitted == steps


@pytest.mark.parametrize("later_first", [True, False], ids=["later-turn-first", "fresh-prompt-first"])
def test_the_prefill_cap_counts_what_a_later_turn_computes_past_its_cached_prefix(model_dir, later_first):
    """An episode's later turn of 27 tokens finds 24 cached (its first turn's 6 full blocks) and computes 3;
    beside a fresh 20-token prompt that is 23: one step under prefill_tokens=23 in either order, two under 22.
    Counting the cached tokens as computed, or the cap's edge as over it, splits the 23."""
    for cap, steps in ((23, [2]), (22, [1, 1])):
        engine = BuiltinEngine(model_dir, seed=2, block_size=4, prefill_tokens=cap)
        prompt = list(range(10, 30))
        first = asyncio.run(engine.generate(prompt, SamplingParams(5, 1.0), episode_id="e"))
        later, fresh = prompt + first.token_ids + [2, 3], list(range(60, 80))
        scheduled = Scheduled(engine)
        calls = [(later, "e"), (fresh, None)] if later_first else [(fresh, None), (later, "e")]

        async def together():
            return await asyncio.gather(*(engine.generate(ids, SamplingParams(2, 1.0), episode_id=episode)
                                          for ids, episode in calls))

        completions = dict(zip(("later", "fresh") if later_first else ("fresh", "later"), asyncio.run(together())))
        assert [len(names) for _, _, names in scheduled.events] == steps, cap
        assert (completions["later"].prefill_tokens, completions["later"].cached_tokens) == (27, 24)
        assert (completions["fresh"].prefill_tokens, completions["fresh"].cached_tokens) == (20, 0)


def test_the_config_keys_hold_their_bounds():
    for key, good, bad in (("generator.kv_cache_memory", 0, -0.01), ("generator.kv_block_size", 1, 0)):
        validate(load_config(None, [f"{key}={good}"]))
        with pytest.raises(ConfigError, match=f"'{key}': must be"):
            validate(load_config(None, [f"{key}={bad}"]))


def test_a_span_pads_its_queries_to_at_most_twice_its_tokens():
    tokens = Tokens()
    tokens.add(0, [0] * 5, [[1, 1, 1], [1], [1], [1], [1]])  # 4 rows: 3 x 4 = 2 x 6 tokens; a fifth: 15 > 14
    tokens.add(5, [0, 7], [[2] * 100, [3]])  # 100 x 2 <= 2 x 101
    assert [(span.first, span.rows) for span in tokens.spans] == [(0, 4), (4, 1), (5, 2)]
    assert tokens.rows == [0, 0, 0, 1, 2, 3, 4] + [5] * 100 + [6] and tokens.positions[-1] == 7


def test_a_later_turn_that_differs_only_at_the_last_cached_token_does_not_reuse_its_block(model_dir):
    """The audit's planted bug: a kept cache reused for a turn that differs from it only at its last cached
    token. Turn 1 caches 12 tokens (3 full blocks of 4); turn 2 changes token 11 only: 2 blocks are reused."""
    engine = BuiltinEngine(model_dir, seed=3, block_size=4)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    prompt = list(range(10, 18))
    first = asyncio.run(engine.generate(prompt, SamplingParams(5, 1.0), episode_id="e"))
    cached = prompt + first.token_ids[:4]  # the last sampled token is never cached
    changed = cached[:11] + [(cached[11] + 1) % 50 + 1] + [2, 3]
    second = asyncio.run(engine.generate(changed, SamplingParams(3, 1.0), episode_id="e"))
    assert (second.prefill_tokens, second.cached_tokens) == (len(changed), 8)
    assert second.logprobs == pytest.approx(reference_logprobs(reference, changed, second.token_ids, 1.0), abs=TOL)
    third = asyncio.run(engine.generate(cached + [2, 3], SamplingParams(3, 1.0), episode_id="e"))
    assert third.cached_tokens == 12  # the unchanged history still finds all 3 of its blocks
    assert third.logprobs == pytest.approx(reference_logprobs(reference, cached + [2, 3], third.token_ids, 1.0),
                                           abs=TOL)
