"""The pipeline trace (run.trace): clock offsets, lanes that keep spans nested or disjoint, an episode's
spans from the agent loop, the buffer's lease and gate spans, a file that parses (whole, or cut short by a
crash), an earlier trace kept on resume; and one real run whose trace.json is checked end to end (slow)."""

import asyncio
import json
import random
import time

import msgpack
import pytest
import zmq

from nanoverl_async.agents import multiply_task
from nanoverl_async.buffer.service import BufferService
from nanoverl_async.config import AgentConfig, BufferConfig, GeneratorConfig
from nanoverl_async.agents.agent_loop import run_episode
from nanoverl_async.observe.trace import (PipelineTrace, Span, SpanLog, TracedRole, estimate_offset, place,
                                  sequential)
from nanoverl_async.wire.trajectory import decode, encode
from test_agent_loop import ScriptedEngine
from test_buffer_service import VOCAB, make_trajectory


def tracks(events: list[dict]) -> dict[tuple[int, int], list[tuple[int, int, dict]]]:
    """(pid, tid) -> its complete events as (start, end, event)."""
    by_track: dict = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e))
    return by_track


def overlapping_pairs(spans: list[tuple[int, int, dict]]) -> list:
    """Pairs of spans on one track that neither nest nor are disjoint (touching ends count as disjoint)."""
    bad = []
    for i, (s1, e1, a) in enumerate(spans):
        for s2, e2, b in spans[i + 1:]:
            nested = (s1 <= s2 and e2 <= e1) or (s2 <= s1 and e1 <= e2)
            if not nested and s2 < e1 and s1 < e2:
                bad.append((a, b))
    return bad


def process_names(events: list[dict]) -> dict[int, dict]:
    return {e["pid"]: e["args"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}


def test_offset_of_a_clock_ahead_is_found_within_its_uncertainty():
    offset, uncertainty, spans = estimate_offset(lambda: (time.time() + 100.0, [Span("t", "x", 1.0, 2.0)]))
    assert abs(offset - 100.0) <= uncertainty + 1e-6 and uncertainty < 0.05
    assert len(spans) > 1  # every trip's spans are kept, none lost to the estimate


def test_lanes_keep_every_lane_disjoint_whatever_the_arrival_order():
    rng = random.Random(0)
    lanes, placed = [], {}
    for _ in range(300):
        start = rng.uniform(0, 100)
        end = start + rng.expovariate(0.2)
        placed.setdefault(place(lanes, start, end), []).append((start, end, {}))
    assert len(placed) > 1
    assert all(not overlapping_pairs(spans) for spans in placed.values())


def test_sequential_drops_a_call_that_overlaps_the_one_before():
    calls = [Span("e", "tool", 3, 4), Span("e", "generate", 0, 2), Span("e", "generate", 1, 3)]
    assert [(s.name, s.start) for s in sequential(calls)] == [("generate", 0), ("tool", 3)]


def test_an_episode_carries_its_calls_inside_its_span_over_the_wire():
    from nanoverl_async.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    sample = multiply_task.make_prompt(0, 5)
    engine = ScriptedEngine(tokenizer, [f"<call>{sample['a']}*{sample['b']}</call>", f"{sample['answer']}<|end|>"])
    config = AgentConfig(max_turns=3, max_new_tokens=16, max_total_tokens=96)
    off = asyncio.run(run_episode(engine, tokenizer, sample, multiply_task.MultiplyEnv(), config, 1.0))
    assert off.spans == []  # run.trace off: nothing extra on the wire
    engine = ScriptedEngine(tokenizer, [f"<call>{sample['a']}*{sample['b']}</call>", f"{sample['answer']}<|end|>"])
    t = decode(encode(asyncio.run(run_episode(engine, tokenizer, sample, multiply_task.MultiplyEnv(), config, 1.0,
                                              trace=True))))
    assert [kind for kind, _, _ in t.spans] == ["episode", "generate", "tool", "generate"]
    (_, start, end), calls = t.spans[0], t.spans[1:]
    assert all(start <= s <= e <= end for _, s, e in calls) and abs(start - time.time()) < 60


def test_the_buffer_records_leases_until_complete_and_the_gate_while_closed():
    service = BufferService(1, 1, 0, BufferConfig(lease_timeout_s=30), "127.0.0.1",
                            GeneratorConfig(replicas=1, max_groups_in_flight=4), VOCAB,
                            lambda index: {"index": index}, trace=True)
    context = zmq.Context()
    push, dealer = context.socket(zmq.PUSH), context.socket(zmq.DEALER)
    push.connect(service.endpoints["trajectories"])
    dealer.connect(service.endpoints["leases"])

    def lease(version: int) -> list:
        dealer.send(msgpack.packb({"op": "lease", "generator_id": 0, "version": version, "max_groups": 2}))
        assert dealer.poll(5000), "no reply"
        return msgpack.unpackb(dealer.recv(), raw=False)["leases"]

    try:
        (granted,) = lease(0)  # B=1, eta=0: one group for version 0, then the gate is closed
        assert lease(0) == [] and lease(0) == []  # one spell, however many refusals
        push.send(encode(make_trajectory(granted, 0, [0, 0], generator_id=0)))
        service.next_batch(0, timeout_s=10)
        service.publishing(1)
        assert len(lease(1)) == 1  # new weights open the gate: the spell ends
        spans = {s.name: s for s in service.trace.take()}
        assert set(spans) == {"lease", "gate closed"} and service.trace.take() == []
        assert spans["lease"].args == {"group_id": granted["group_id"], "prompt_index": granted["prompt_index"],
                                       "generator_id": 0, "version": 0, "outcome": "completed"}
        assert spans["lease"].start <= spans["gate closed"].start <= spans["gate closed"].end
    finally:
        context.destroy(linger=0)
        service.close()


def test_events_land_on_the_controller_clock_and_the_file_parses_whole_or_cut_short(tmp_path):
    log = SpanLog(True)
    ahead = 50.0  # the role's clock runs 50 s ahead of ours
    log.add("leases", "lease", time.time() + ahead - 2.0, time.time() + ahead - 1.0, group_id=3)
    trace = PipelineTrace(tmp_path, [TracedRole("buffer", lambda: (time.time() + ahead, log.take()))])
    now = time.monotonic()
    trace.step(0, [], (now - 4, now - 3, now - 2, now - 1, now))
    text = (tmp_path / "trace.json").read_text()
    assert text.startswith("[") and not text.rstrip().endswith("]")  # as a crash would leave it
    events = json.loads(text + "]")  # the one thing a crashed file lacks
    names = {pid: args["name"] for pid, args in process_names(events).items()}
    (lease,) = [e for e in events if e["name"] == "lease"]
    assert names[lease["pid"]] == "buffer" and lease["args"] == {"group_id": 3}
    assert abs(lease["ts"] / 1e6 - (time.time() - 2.0)) < 0.5  # moved by the offset, not 50 s away
    phases = [e["name"] for e in events if names.get(e["pid"]) == "learners" and e["ph"] == "X"]
    assert phases == ["wait batch", "prepare", "update", "publish"]
    trace.close()
    assert json.loads((tmp_path / "trace.json").read_text()) == events


def test_a_resumed_run_keeps_the_earlier_trace(tmp_path):
    PipelineTrace(tmp_path, []).close()  # the first run's trace
    for resume_step in (0, 4, 4):  # each resumed run moves the one before aside
        PipelineTrace(tmp_path, [], resume_step=resume_step).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace-until-step-0.json", "trace-until-step-4-2.json",
                                                          "trace-until-step-4.json", "trace.json"]


@pytest.mark.slow
def test_a_real_run_traces_every_role_and_each_episode_before_its_training(observed_run):
    events = json.loads((observed_run / "trace.json").read_text())  # 4 steps, 2 generators, 4 x 4 (conftest.py)
    processes = process_names(events)
    names = {pid: args["name"] for pid, args in processes.items()}
    assert sorted(names.values()) == ["buffer", "generator 0", "generator 1", "learners"]
    by_track = tracks(events)
    assert {names[pid] for pid, _ in by_track} == set(names.values())  # every process has spans
    for spans in by_track.values():
        assert not overlapping_pairs(spans)
    span_names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"episode", "generate", "tool", "lease", "prepare", "update", "publish"} <= span_names
    assert any(name.startswith("weights v") for name in span_names)
    prepare = {e["args"]["step"]: e["ts"] for e in events if e["name"] == "prepare"}
    assert sorted(prepare) == [1, 2, 3, 4]
    assert [e["args"] for e in events if e["name"] == "publish"] == [{"step": s, "version": s} for s in (1, 2, 3, 4)]
    episodes = [(s, e, ev) for spans in by_track.values() for s, e, ev in spans if ev["name"] == "episode"]
    assert len(episodes) == 4 * 4 * 4  # every trained trajectory, once
    for start, end, episode in episodes:
        slack = processes[episode["pid"]]["clock_uncertainty_s"] * 1e6  # the offset estimate's error bound
        assert end <= prepare[episode["args"]["trained_step"]] + slack
        calls = [(s, e) for s, e, ev in by_track[(episode["pid"], episode["tid"])]
                 if ev["name"] in ("generate", "tool") and start <= s < end]
        assert calls and all(e <= end for _, e in calls)
        assert set(episode["args"]) >= {"prompt_index", "sample_index", "group_id", "generated_tokens", "turns",
                                        "reward", "versions", "trained_step"}
