"""The admission gate: the rule groups_started < (u + eta + 1) * B, slots given back on release and
expiry, re-issued prompts leased first, counters. Fast, no sockets. (The randomised property test of
gate + replay together lives in tests/test_replay.py.)"""

import numpy as np
import pytest

from nanoverl_async.buffer.gate import AdmissionGate


def make_gate(B=2, eta=1, timeout=10.0):
    return AdmissionGate(B, eta, timeout, prompt_fn=lambda i: {"index": i, "question": f"q{i}"})


def test_admission_rule_caps_groups_started_by_version():
    gate = make_gate(B=2, eta=1)
    leases = gate.lease(version=0, max_groups=10, now=0.0)  # (0 + 1 + 1) * 2 = 4 slots
    assert [l.prompt_index for l in leases] == [0, 1, 2, 3]
    assert [l.sample["index"] for l in leases] == [0, 1, 2, 3]
    assert gate.lease(0, 1, 0.0) == [] and gate.capacity(0) == 0
    assert len(gate.lease(1, 10, 0.0)) == 2  # version 1 opens B more slots
    assert gate.groups_started == 6 and gate.in_flight() == 6
    assert len(gate.lease(3, 1, 0.0)) == 1  # max_groups is respected
    assert gate.counters["leased"] == 7


def test_eta_zero_is_synchronous():
    gate = make_gate(B=3, eta=0)
    assert len(gate.lease(0, 100, 0.0)) == 3
    assert gate.lease(0, 100, 0.0) == []


def test_release_gives_the_slot_back_and_reissues_first():
    gate = make_gate(B=2, eta=0)
    a, b = gate.lease(0, 2, 0.0)
    gate.complete(a.group_id)
    gate.release(a.group_id)  # e.g. stale at consumption
    assert gate.groups_started == 1 and gate.counters["released"] == 1 and gate.counters["reissued"] == 1
    (c,) = gate.lease(0, 5, 1.0)
    assert c.prompt_index == a.prompt_index and c.group_id not in (a.group_id, b.group_id)
    assert c.sample == a.sample  # the same prompt, deterministically
    (d,) = gate.lease(1, 1, 1.0)
    assert d.prompt_index == 2  # the re-issue queue is empty again: fresh index


def test_release_without_reissue_retires_the_prompt():
    gate = make_gate(B=1, eta=0)
    (a,) = gate.lease(0, 1, 0.0)
    gate.release(a.group_id, reissue=False)  # e.g. a filtered group
    assert gate.frontier() == {"next_index": 1, "reissue": [], "live": {}}
    assert gate.lease(0, 1, 0.0)[0].prompt_index == 1


def test_consumed_groups_keep_their_slot():
    gate = make_gate(B=1, eta=0)
    (a,) = gate.lease(0, 1, 0.0)
    with pytest.raises(AssertionError):
        gate.consume(a.group_id)  # not complete yet
    gate.complete(a.group_id)
    gate.consume(a.group_id)
    assert gate.groups_started == 1 and gate.lease(0, 1, 0.0) == []
    assert gate.counters["completed"] == 1 and gate.counters["consumed"] == 1
    with pytest.raises(KeyError, match="not a live lease"):
        gate.release(a.group_id)


def test_expire_frees_incomplete_leases_only():
    gate = make_gate(B=3, eta=0, timeout=10.0)
    a, b, c = gate.lease(0, 3, now=0.0)
    gate.complete(b.group_id)  # complete groups wait for the learner, they do not expire
    assert gate.expire(9.9) == []
    assert gate.expire(10.0) == [a.group_id, c.group_id]
    assert gate.counters["expired"] == 2 and gate.counters["reissued"] == 2
    assert gate.groups_started == 1 and gate.in_flight() == 0
    assert gate.frontier()["reissue"] == [a.prompt_index, c.prompt_index]
    again = gate.lease(0, 3, now=20.0)
    assert [l.prompt_index for l in again] == [a.prompt_index, c.prompt_index]
    assert all(l.deadline == 30.0 for l in again)
    with pytest.raises(KeyError):
        gate.complete(a.group_id)  # the expired lease is gone for good


def test_bad_arguments_fail_loudly():
    gate = make_gate()
    with pytest.raises(KeyError):
        gate.release(12345)


def test_each_gate_rule_at_its_exact_edge():
    """A generator at version u may start groups while groups_started < (u + eta + 1) * B: exactly that
    many, not one more; a resumed gate leases to version == min_version and refuses min_version - 1; a
    lease expires at its deadline, not a moment before."""
    gate = make_gate(B=3, eta=2, timeout=5.0)
    assert gate.capacity(1) == (1 + 2 + 1) * 3 == 12
    assert len(gate.lease(1, 12, now=0.0)) == 12 and gate.lease(1, 1, now=0.0) == []
    assert len(gate.lease(2, 4, now=0.0)) == 3  # version 2 opens exactly B more
    restored = make_gate(B=1, eta=0)
    restored.restore(make_gate(B=1, eta=0).state(), min_version=4, now=0.0)
    assert restored.lease(3, 1, now=0.0) == [] and len(restored.lease(4, 1, now=0.0)) == 1
    gate = make_gate(B=1, eta=0, timeout=5.0)
    (lease,) = gate.lease(0, 1, now=1.0)
    assert gate.expire(np.nextafter(6.0, 0.0)) == [] and gate.expire(6.0) == [lease.group_id]
