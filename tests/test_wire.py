"""The trajectory wire codec: exact round trip, every malformed message rejected with a WireError
naming the field, and the receiver's bounds (length, vocabulary, newest version) exact at their edges.
Fast, no sockets."""

import msgpack
import numpy as np
import pytest

from nanoverl_async.wire.trajectory import TooLong, Trajectory, WireError, check_bounds, decode, encode


def make_trajectory() -> Trajectory:
    # prompt (3 tokens), a sampled turn (2 tokens, version 4), a tool result (2), a sampled answer (2, version 5)
    mask = np.array([0, 0, 0, 1, 1, 0, 0, 1, 1], dtype=np.uint8)
    return Trajectory(
        id="g7-s1", group_id=7, prompt_index=42, sample_index=1,
        token_ids=np.arange(10, 19, dtype=np.int32),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
        versions=np.array([-1, -1, -1, 4, 4, -1, -1, 5, 5], dtype=np.int32),
        reward=1.0, num_turns=2, tool_calls=1, tool_errors=0, finish_reason="stop", generator_id=3,
        timings={"episode": 0.25}, info={"answer": "408", "nested": [1, 2]},
        spans=[["episode", 100.0, 100.25], ["generate", 100.0, 100.1], ["tool", 100.1, 100.15]],
    )


def record_of(trajectory: Trajectory) -> dict:
    return msgpack.unpackb(encode(trajectory), raw=False)


def pack(record: dict) -> bytes:
    return msgpack.packb(record, use_bin_type=True)


def test_round_trip_keeps_every_field():
    original = make_trajectory()
    decoded = decode(encode(original))
    for name in ("id", "group_id", "prompt_index", "sample_index", "reward", "num_turns", "tool_calls",
                 "tool_errors", "finish_reason", "generator_id", "timings", "info", "spans"):
        assert getattr(decoded, name) == getattr(original, name), name
    for name in ("token_ids", "loss_mask", "behaviour_logprobs", "versions"):
        np.testing.assert_array_equal(getattr(decoded, name), getattr(original, name))
        assert getattr(decoded, name).dtype == getattr(original, name).dtype
    assert decoded.version == 4 and decoded.num_generated == 4


def test_garbage_bytes_are_rejected():
    with pytest.raises(WireError, match="msgpack"):
        decode(b"\xc1\xff not msgpack")
    with pytest.raises(WireError, match="map"):
        decode(msgpack.packb([1, 2, 3]))


def _set(field, value):
    def edit(record):
        record[field] = value
    return edit


def _del(field):
    return lambda record: record.pop(field)


def _array(field, **changes):
    def edit(record):
        record[field].update(changes)
    return edit


def _truncate(field, n):
    def edit(record):
        dtype = np.dtype(record[field]["dtype"])
        record[field]["data"] = record[field]["data"][: n * dtype.itemsize]
        record[field]["shape"] = [n]
    return edit


def _versions(values):
    return _array("versions", data=np.array(values, dtype="<i4").tobytes())


CASES = [
    ("group_id", _set("group_id", "7")),
    ("reward", _set("reward", "high")),
    ("sample_index", _set("sample_index", True)),
    ("info", _set("info", [1])),
    ("finish_reason", _del("finish_reason")),
    ("versions", _del("versions")),
    ("surprise", _set("surprise", 1)),
    ("token_ids", _array("token_ids", dtype="<i8")),
    ("token_ids", _array("token_ids", strides=[4])),  # an array record has exactly dtype, shape and data
    ("behaviour_logprobs", _array("behaviour_logprobs", dtype="<f8")),
    ("loss_mask", _array("loss_mask", shape=[3, 3])),
    ("token_ids", _array("token_ids", data=b"\x00" * 5)),
    ("versions", _set("versions", [1, 2, 3])),
    ("loss_mask", _truncate("loss_mask", 8)),
    ("behaviour_logprobs", _truncate("behaviour_logprobs", 2)),
    ("token_rewards", _set("token_rewards", {"dtype": "<f4", "shape": [9], "data": b"\x00" * 36})),  # removed field
    # versions say token 0 was sampled but the mask says it was not (and vice versa)
    ("versions", _versions([0, -1, -1, 4, 4, -1, -1, 5, 5])),
    ("versions", _versions([-1, -1, -1, -1, 4, -1, -1, 5, 5])),
    ("versions", _versions([-2, -1, -1, 4, 4, -1, -1, 5, 5])),
    ("loss_mask", _array("loss_mask", data=bytes([0, 0, 0, 1, 2, 0, 0, 1, 1]))),
    ("behaviour_logprobs", _array("behaviour_logprobs", data=np.full(9, 0.5, "<f4").tobytes())),
    ("token_ids", _array("token_ids", data=np.full(9, -3, "<i4").tobytes())),
    ("reward", _set("reward", float("nan"))),
    # run.trace's spans: the episode's first, finite numbers, each call inside the episode
    ("spans", _set("spans", {"episode": [0, 1]})),
    ("spans", _set("spans", [["generate", 100.0, 100.1]])),
    ("spans", _set("spans", [["episode", 100.0, float("inf")]])),
    ("spans", _set("spans", [["episode", 100.0, 100.25], ["tool", 100.2, 100.5]])),
    ("spans", _set("spans", [["episode", 100.0, 100.25], ["sleep", 100.0, 100.1]])),
]


def test_check_bounds_accepts_each_limit_exactly_and_refuses_one_beyond():
    """9 tokens, ids up to 18, versions up to 5: accepted at vocabulary 19, newest version 5 and 9 tokens
    allowed (ids < vocab, versions <= newest, length <= max_tokens); each limit one tighter refuses it."""
    t = make_trajectory()
    assert len(t.token_ids) == 9 and t.token_ids.max() == 18 and t.versions.max() == 5
    check_bounds(t, vocab_size=19, newest_version=5, max_tokens=9)
    check_bounds(t, vocab_size=19, newest_version=5)  # no length limit given: none applied
    with pytest.raises(WireError, match="'token_ids': id 18 >= vocabulary size 18"):
        check_bounds(t, vocab_size=18, newest_version=5, max_tokens=9)
    with pytest.raises(WireError, match="'versions': version 5 was never published"):
        check_bounds(t, vocab_size=19, newest_version=4, max_tokens=9)
    with pytest.raises(TooLong, match="'token_ids': 9 tokens, more than the run's 8"):
        check_bounds(t, vocab_size=19, newest_version=5, max_tokens=8)


def _logprobs(values):
    return _array("behaviour_logprobs", data=np.array(values, dtype="<f4").tobytes())


VALID_EDGES = [  # each exactly at the edge of a rule of `validate`, on the accepting side
    ("token id 0", _array("token_ids", data=np.zeros(9, "<i4").tobytes())),
    ("one token", lambda r: [_truncate(name, 1)(r) for name in ("token_ids", "loss_mask", "behaviour_logprobs",
                                                               "versions")]),
    ("a sampled token of probability 1", _logprobs([0, 0, 0, 0.0, -0.5, 0, 0, -0.5, -0.5])),
    ("logprob at the 1e-4 tolerance", _logprobs([0, 0, 0, 1e-4, -0.5, 0, 0, -0.5, -0.5])),
    ("a call of zero length at the episode's end",
     _set("spans", [["episode", 100.0, 100.25], ["tool", 100.25, 100.25]])),
    ("a call spanning the whole episode", _set("spans", [["episode", 100.0, 100.25], ["generate", 100.0, 100.25]])),
]
INVALID_EDGES = [  # one step past the edge
    ("token_ids", _array("token_ids", data=np.array([-1] + [0] * 8, "<i4").tobytes())),
    ("token_ids", lambda r: [_truncate(name, 0)(r) for name in ("token_ids", "loss_mask", "behaviour_logprobs",
                                                               "versions")]),
    ("behaviour_logprobs", _logprobs([0, 0, 0, 2e-4, -0.5, 0, 0, -0.5, -0.5])),
    ("behaviour_logprobs", _logprobs([0, 0, 0.5, -0.5, -0.5, 0, 0, -0.5, -0.5])),  # unsampled token, not 0
    ("behaviour_logprobs", _logprobs([0, 0, 0, float("nan"), -0.5, 0, 0, -0.5, -0.5])),
    ("spans", _set("spans", [["episode", 100.0, 100.25], ["tool", 99.9, 100.1]])),  # starts before the episode
    ("spans", _set("spans", [["episode", float("-inf"), 100.25]])),
]


@pytest.mark.parametrize("edit", [e for _, e in VALID_EDGES], ids=[name for name, _ in VALID_EDGES])
def test_validate_accepts_each_rule_at_its_edge(edit):
    record = record_of(make_trajectory())
    edit(record)
    decode(pack(record))


@pytest.mark.parametrize("field,edit", CASES + INVALID_EDGES,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES + INVALID_EDGES)])
def test_a_malformed_record_or_one_step_past_an_edge_names_the_field(field, edit):
    record = record_of(make_trajectory())
    edit(record)
    with pytest.raises(WireError, match=f"'{field}'"):
        decode(pack(record))
