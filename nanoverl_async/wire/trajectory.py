"""The trajectory record: one type from the agent loop to the loss, and its wire format.

A trajectory is one episode of one prompt: every token the engine saw (prompt, sampled turns, tool
results) in order, with per-token masks, behaviour logprobs and weight versions. Invariants
(checked by `validate`, on every decode):
  - all per-token arrays have the same length T >= 1;
  - loss_mask is 1 exactly on tokens the policy sampled, and versions[i] >= 0 exactly there
    (versions[i] = -1 on prompt and tool tokens), never decreasing along the episode (weights only move
    forward while it runs);
  - behaviour_logprobs are <= 0 and finite on sampled tokens, 0 elsewhere;
  - spans (run.trace only, else empty): ["episode", start, end] first, then one ["generate" | "tool",
    start, end] per model or tool call, inside it; wall-clock seconds, finite, start <= end (trace.py).

Wire: msgpack, numpy arrays as raw little-endian bytes with dtype and shape (decoded zero-copy with
np.frombuffer). Never pickle. `decode` raises WireError naming the bad field; `check_bounds` adds what
only the receiver knows (the run's length limit, the model's vocabulary, the newest published version).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, get_type_hints

import msgpack
import numpy as np


class WireError(ValueError):
    """A message that does not decode to a valid trajectory."""


class TooLong(WireError):
    """A trajectory longer than the run allows (counted apart: buffer/too_long)."""


ARRAY_DTYPES = {
    "token_ids": np.dtype("<i4"),
    "loss_mask": np.dtype("<u1"),
    "behaviour_logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
}
CALL_SPANS = ("generate", "tool")  # what may follow an episode's own span in `spans`: its model and tool calls


@dataclass
class Trajectory:
    id: str  # unique per episode
    group_id: int  # the lease this episode belongs to (one prompt, G samples)
    prompt_index: int  # the prompt's index in the dataset (the frontier counts these)
    sample_index: int  # 0..G-1 within the group
    token_ids: np.ndarray  # int32 [T], prompt + every turn, exactly as the engine saw them
    loss_mask: np.ndarray  # uint8 [T], 1 only on sampled tokens
    behaviour_logprobs: np.ndarray  # float32 [T], log mu(token) of the distribution sampled; 0 where mask 0
    versions: np.ndarray  # int32 [T], weight version that produced each token; -1 where not generated
    reward: float
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str = ""  # stop | length | max_turns | ...
    generator_id: int = 0
    timings: dict = field(default_factory=dict)  # seconds, e.g. {"episode": 0.8}
    info: dict = field(default_factory=dict)  # JSON-able extras
    # run.trace: [kind, start, end] of the episode, then of each call inside it (module docstring; trace.py)
    spans: list = field(default_factory=list)

    @property
    def version(self) -> int:
        """The oldest weights that produced any token of this episode (-1 if none were sampled)."""
        generated = self.versions[self.versions >= 0]
        return int(generated.min()) if generated.size else -1

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())


def _unpack_array(name: str, packed: Any, dtype: np.dtype) -> np.ndarray:
    if not isinstance(packed, dict) or set(packed) != {"dtype", "shape", "data"}:
        raise WireError(f"field '{name}': expected an array record with dtype, shape and data")
    if packed["dtype"] != dtype.str:
        raise WireError(f"field '{name}': dtype {packed['dtype']!r}, expected {dtype.str!r}")
    shape = packed["shape"]
    if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int) and shape[0] >= 0):
        raise WireError(f"field '{name}': shape {shape!r} is not one non-negative length")
    data = packed["data"]
    if not isinstance(data, bytes) or len(data) != shape[0] * dtype.itemsize:
        raise WireError(f"field '{name}': {len(data) if isinstance(data, bytes) else 'no'} bytes for shape {shape}")
    return np.frombuffer(data, dtype=dtype)


def encode(trajectory: Trajectory) -> bytes:
    record = {f.name: getattr(trajectory, f.name) for f in fields(Trajectory)}
    for name, dtype in ARRAY_DTYPES.items():
        array = np.ascontiguousarray(record[name], dtype=dtype)
        record[name] = {"dtype": dtype.str, "shape": list(array.shape), "data": array.tobytes()}
    return msgpack.packb(record, use_bin_type=True)


# the type of every other field, as Trajectory declares it (a float may arrive as an int)
_SCALAR_TYPES = {name: (int, float) if kind is float else kind
                 for name, kind in get_type_hints(Trajectory).items() if name not in ARRAY_DTYPES}


def unpack_map(message: bytes) -> dict:
    """Every message on the wire is a msgpack map (never pickle): the map, or WireError."""
    try:
        record = msgpack.unpackb(message, raw=False)
    except Exception as error:
        raise WireError(f"not a msgpack message: {type(error).__name__}: {error}") from None
    if not isinstance(record, dict):
        raise WireError(f"expected a map, got {type(record).__name__}")
    return record


def check_fields(record: dict, expected: set) -> None:
    """WireError naming a field of `record` beyond `expected`, or one it lacks."""
    for problem, names in (("unknown", set(record) - expected), ("missing", expected - set(record))):
        if names:
            raise WireError(f"{problem} field '{sorted(names, key=str)[0]}'")


def decode(message: bytes) -> Trajectory:
    """Bytes -> a validated Trajectory, or WireError naming what is wrong."""
    record = unpack_map(message)
    check_fields(record, {f.name for f in fields(Trajectory)})
    for name, kind in _SCALAR_TYPES.items():
        if not isinstance(record[name], kind) or isinstance(record[name], bool):
            raise WireError(f"field '{name}': expected {getattr(kind, '__name__', 'a number')}, "
                            f"got {type(record[name]).__name__}")
    for name, dtype in ARRAY_DTYPES.items():
        record[name] = _unpack_array(name, record[name], dtype)
    record["reward"] = float(record["reward"])
    trajectory = Trajectory(**record)
    validate(trajectory)
    return trajectory


def validate(t: Trajectory) -> None:
    """The invariants of the module docstring; raises WireError naming the field."""
    length = len(t.token_ids)
    if length == 0:
        raise WireError("field 'token_ids': empty")
    for name in ("loss_mask", "behaviour_logprobs", "versions"):
        if len(getattr(t, name)) != length:
            raise WireError(f"field '{name}': length {len(getattr(t, name))} != len(token_ids) {length}")
    if t.token_ids.min() < 0:
        raise WireError("field 'token_ids': negative token id")
    if not ((t.loss_mask == 0) | (t.loss_mask == 1)).all():  # np.isin costs 60 us a trajectory
        raise WireError("field 'loss_mask': values other than 0 and 1")
    sampled = t.loss_mask == 1
    if not np.array_equal(sampled, t.versions >= 0) or (t.versions < -1).any():
        raise WireError("field 'versions': must be >= 0 exactly on sampled tokens and -1 elsewhere")
    if (np.diff(t.versions[sampled]) < 0).any():
        raise WireError("field 'versions': decrease along the episode")
    logprobs = t.behaviour_logprobs
    if not np.isfinite(logprobs).all() or (logprobs[sampled] > 1e-4).any() or (logprobs[~sampled] != 0).any():
        raise WireError("field 'behaviour_logprobs': must be finite, <= 0 on sampled tokens and 0 elsewhere")
    if not np.isfinite(t.reward):
        raise WireError("field 'reward': not finite")
    _check_spans(t.spans)


def _check_spans(spans: list) -> None:
    """The episode's span first, each call's inside it: the controller writes them into trace.json."""
    for i, span in enumerate(spans):
        kinds = ("episode",) if i == 0 else CALL_SPANS
        if not (isinstance(span, list) and len(span) == 3 and span[0] in kinds
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in span[1:])
                and span[1] <= span[2]):
            raise WireError(f"field 'spans': entry {i} is not [{' | '.join(map(repr, kinds))}, start, end] with "
                            f"finite seconds, start <= end")
        if i and not spans[0][1] <= span[1] <= span[2] <= spans[0][2]:
            raise WireError(f"field 'spans': entry {i} ({span[0]}) lies outside the episode's span")


def check_bounds(t: Trajectory, vocab_size: int, newest_version: int, max_tokens: Optional[int] = None) -> None:
    """A decoded trajectory against the run it claims to belong to: at most `max_tokens` tokens
    (agent.max_total_tokens, which the launcher checked against the model's positions; a longer one would
    cost the learner out of all proportion, or outrun the model; TooLong), token ids inside the model's
    vocabulary (an id beyond it would fail the learner's embedding lookup) and no token from weights
    newer than the newest version published (it would train as negative staleness). WireError otherwise.
    `max_tokens=None`: no length limit (a component tested alone)."""
    if max_tokens is not None and len(t.token_ids) > max_tokens:
        raise TooLong(f"field 'token_ids': {len(t.token_ids)} tokens, more than the run's {max_tokens} "
                      f"(agent.max_total_tokens)")
    if t.token_ids.max() >= vocab_size:
        raise WireError(f"field 'token_ids': id {int(t.token_ids.max())} >= vocabulary size {vocab_size}")
    if t.versions.max() > newest_version:
        raise WireError(f"field 'versions': version {int(t.versions.max())} was never published "
                        f"(newest: {newest_version})")
