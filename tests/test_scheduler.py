"""The builtin engine's scheduler on its own, with no model and no tensor: it imports no torch; it admits in arrival
order up to the row, block and prefill-token limits, each exactly at its edge; it preempts the most recently
admitted rows when blocks run short and puts them back at the queue's front, oldest first; requests with the
same context share blocks, and a later one finds a cached prefix; a lockstep wave waits for every episode, is
admitted sorted by episode id with a seed of its make-up, and admits nothing more until it has finished.
(Through the engine, against a full forward: tests/test_kv_blocks.py and tests/test_engine.py.)
"""

import asyncio
import subprocess
import sys

import pytest

from nanoverl_async.agents.engine import SamplingParams
from nanoverl_async.generators.kv_blocks import BlockPool
from nanoverl_async.generators.scheduler import Scheduler
from nanoverl_async.generators.sequence import Request


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make(loop, prompt_tokens: int, first: int = 1, max_new_tokens: int = 8, episode: str = "") -> Request:
    """A request of `prompt_tokens` tokens first, first + 1, ... (its name: `first`)."""
    prompt = list(range(first, first + prompt_tokens))
    return Request(prompt, SamplingParams(max_new_tokens, 1.0, (0,)), loop.create_future(), episode)


def scheduler(blocks: int = 64, block_size: int = 4, rows: int = 8, prefill: int = 1000) -> Scheduler:
    return Scheduler(BlockPool(blocks + 1, block_size), rows, prefill, seed=0)  # + the null block


def names(requests) -> list[int]:
    return [r.input_ids[0] for r in requests]


def sample(scheduler: Scheduler, token: int = 5) -> None:
    """What the runner and the engine do after admission: a token for every row, recorded under version 0."""
    scheduler.postprocess([token] * len(scheduler.running), [-1.0] * len(scheduler.running), 0)


def step(scheduler: Scheduler, token: int = 5):
    """One engine step without its model: preemptions, blocks for the running rows, admissions, a token each."""
    while scheduler.short_of_blocks():
        scheduler.requeue(1, preempted=True)
    scheduler.grow()
    admission = scheduler.admit()
    sample(scheduler, token)
    return admission


def test_the_scheduler_and_the_block_pool_import_no_torch():
    probe = ("import sys\nimport nanoverl_async.generators.scheduler, nanoverl_async.generators.kv_blocks\n"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_admission_is_in_arrival_order_up_to_the_rows(loop):
    s = scheduler(rows=3)
    for name in (10, 20, 30, 40, 50):
        s.add(make(loop, 2, name))
    admission = s.admit()
    assert names(admission.requests) == names(s.running) == [10, 20, 30] and names(s.waiting) == [40, 50]
    assert admission.offsets == [0, 0, 0] and admission.sources == [] and admission.wave_seed is None
    assert s.admit().requests == []  # 3 running rows of 3: nothing more
    sample(s, token=0)  # a stop token: all three finish and leave
    assert s.running == [] and all(r.future.result().finish_reason == "stop" for r in admission.requests)
    assert names(s.admit().requests) == [40, 50]


def test_the_prefill_cap_admits_up_to_exactly_its_tokens(loop):
    for sizes, admitted in (((6, 4), 2), ((6, 5), 1), ((12, 1), 1)):  # the first is admitted whatever its length
        s = scheduler(prefill=10)
        for index, size in enumerate(sizes):
            s.add(make(loop, size, 10 * (index + 1)))
        assert len(s.admit().requests) == admitted, sizes


def test_blocks_admit_up_to_exactly_the_free_ones_and_a_request_past_the_pool_is_refused(loop):
    s = scheduler(blocks=4)  # 4 blocks of 4: 16 positions
    more = make(loop, 17, 40)
    for request in (make(loop, 16, 10), more, make(loop, 1, 50)):
        s.add(request)
    assert names(s.admit().requests) == [10] and s.pool.free() == 0 and names(s.waiting) == [50]
    assert str(more.future.exception()) == ("17 input tokens + 0 sampled tokens need 17 positions of KV cache; "
                                            "generator.kv_cache_memory holds 16")  # never placed, not waiting forever
    assert s.unfit(16, "max_new_tokens=1", 16) == "" and "need 17 positions" in s.unfit(16, "max_new_tokens=2", 17)
    s.release(s.running)
    for name in (10, 20, 30):
        s.add(make(loop, 8, name))  # 2 blocks each, behind 50's one
    assert names(s.admit().requests) == [50, 10] and names(s.waiting) == [20, 30]  # 3 of 4 blocks: 20 waits


def test_blocks_for_the_next_tokens_exactly_free_are_enough(loop):
    """4-token prompts fill a block each and their next tokens start a block each; a 3-token one's does not."""
    for blocks, prompts, short in ((4, (4, 4), False), (3, (4, 4), True), (5, (4, 4, 3), False), (4, (4, 4, 3), True)):
        s = scheduler(blocks=blocks)
        for index, size in enumerate(prompts):
            s.add(make(loop, size, 10 * (index + 1)))
        step(s)
        assert s.pool.need(s.running) == 2 and s.pool.free() == blocks - len(prompts)
        assert s.short_of_blocks() == short, (blocks, prompts)


def test_short_of_blocks_the_most_recent_rows_go_back_to_the_front_oldest_first(loop):
    s = scheduler(blocks=4)
    for name in (10, 20):
        s.add(make(loop, 8, name))  # 2 full blocks each: the pool is full
    step(s)
    s.add(make(loop, 1, 30))
    assert s.short_of_blocks()
    s.requeue(1, preempted=True)
    assert names(s.running) == [10] and names(s.waiting) == [20, 30] and not s.short_of_blocks()
    assert s.waiting[0].completion.preemptions == 1 and s.waiting[0].blocks == [] and s.pool.free() == 2
    s.requeue(1, preempted=True)  # the older row goes in front of the one preempted before it
    assert s.running == [] and names(s.waiting) == [10, 20, 30]
    assert names(step(s).requests) == [10] and s.running[0].completion.token_ids == [5, 5]  # 9 tokens: 3 blocks


def test_the_same_context_is_computed_once_and_a_later_one_finds_its_cached_prefix(loop):
    s = scheduler()
    group = [make(loop, 6, 10) for _ in range(3)]
    for request in group:
        s.add(request)
    admission = step(s)
    assert admission.offsets == [0] and admission.sources == [0, 0]  # one computes, two copy its logits
    assert group[1].blocks == group[2].blocks == group[0].blocks and s.pool.refs[group[0].blocks[0]] == 3
    assert [(r.completion.prefill_tokens, r.completion.cached_tokens) for r in group] == [(6, 0), (6, 6), (6, 6)]
    _, copies = s.grow()  # each row writes its token into the shared second block: all but the last copy it
    assert len(copies) == 2 and len({r.blocks[1] for r in group}) == 3 and s.pool.refs[group[0].blocks[0]] == 3
    s.release(s.running)
    later = make(loop, 9, 10)  # the group's first 4 tokens are a full cached block; the rest is computed
    s.add(later)
    assert s.admit().offsets == [4] and later.completion.cached_tokens == 4
    s.new_weights(1)  # the running row is computed again, and no block of the old weights can match
    assert names(s.waiting) == [10] and s.admit().offsets == [0] and later.completion.preemptions == 0


def test_a_lockstep_wave_waits_for_every_episode_and_admits_nothing_more_until_it_ends(loop):
    def wave(order):
        s, live = scheduler(), [3]
        s.lockstep = lambda: live[0]
        for index, episode in enumerate(order):
            assert s.waits_for_wave()  # until all 3 episodes wait
            s.add(make(loop, 2, 10 * int(episode[-1]), max_new_tokens=1, episode=episode))
        assert not s.waits_for_wave()
        admission = s.admit()
        s.add(make(loop, 2, 99, episode="e0"))
        assert not s.waits_for_wave() and s.admit().requests == []  # the wave runs: nothing joins it
        sample(s)  # max_new_tokens=1: the wave ends
        live[0] = 1
        assert not s.waits_for_wave() and names(s.admit().requests) == [99]
        return names(admission.requests), admission.wave_seed

    first = wave(["e1", "e2", "e3"])
    assert first[0] == [10, 20, 30] and first == wave(["e3", "e1", "e2"])  # by episode id, whatever the arrival
    assert first[1] != wave(["e1", "e2", "e4"])[1]  # another wave, another seed


def test_finished_rows_leave_and_the_last_rows_move_into_their_places(loop):
    s = scheduler()
    for name, limit in ((10, 1), (20, 5), (30, 1), (40, 5), (50, 5)):
        s.add(make(loop, 2, name, max_new_tokens=limit))
    s.admit()
    holes, movers = s.postprocess([5, 6, 7, 8, 9], [-0.5, -1.0, -1.5, -2.0, -2.5], 3)
    assert (holes, movers) == ([0, 2], [3, 4]) and names(s.running) == [40, 20, 50]
    assert s.running[1].completion.token_ids == [6] and s.running[1].completion.logprobs == [-1.0]
    assert s.running[1].completion.versions == [3]
