"""The buffer service: ZeroMQ front end of the admission gate and the replay buffer.

One background thread owns both sockets, bound on `host` (wire.host as placed) at random ports (`endpoints`):
  - "trajectories": PULL; each frame is `trajectory.encode(t)` from a generator's PUSH socket;
  - "leases": ROUTER; generators (DEALER or REQ) send single msgpack maps (docs/design.md "The lease protocol")
        {"op": "lease", "generator_id": int, "version": int, "max_groups": int[, "clock_ms": int,
             "busy_ms": int, "tool_wait_ms": int]}
            -> {"leases": [{"group_id": int, "prompt_index": int, "sample": {...}}, ...]}  ([] = gate closed)
            (the generator's time so far, and of it computing and waiting on tools: worker.GeneratorClock)
        {"op": "report", "generator_id": int, "version": int[, "weights_refetched": int]} -> {"ok": true}
            (weights_refetched: how often the generator asked for weights again, weights.py; absent while 0)
        anything else -> {"error": "..."}
    A request is refused ({"error"}, counted) from a generator id the run does not have, claiming
    weights newer than the newest published (`publishing`: the controller says so before publishing), or
    asking for more than generator.max_groups_in_flight groups (a generator never holds more; counted
    apart too: oversized_leases); a lease gets at most that many incomplete groups per generator. A
    refusal names the field, never the buffer's state (the newest version, what is in flight).
The learner side calls `next_batch(version, timeout_s)` for the batch that will update weights `version` (step
version + 1), which blocks on a condition until B fresh complete groups are ready, applying the consumption check
(replay.py) first.

Invariants: a message that fails to decode or validate is dropped, counted and logged, and the thread
keeps running (validation includes at most agent.max_total_tokens tokens, counted apart too: too_long,
token ids inside the model's vocabulary and versions no newer than the newest published:
trajectory.check_bounds); gate and replay are only touched under one lock; a crash of
the thread is re-raised by `next_batch`, never a silent hang. msgpack only, never pickle.

With run.trace, `trace` keeps each lease (granted -> its group complete, filtered or expired) and each
spell of the gate refusing a generator, until the controller takes them (trace.py).

Checkpoints: `state_bytes(version)` is one msgpack map {"format", "version", "gate", "replay",
"service"} taken under the lock while generators keep streaming (a consistent cut: every trajectory
is either in it or arrives after it); `restore(data)` loads it into a fresh service before any
generator connects (gate.py, replay.py: in-flight leases are re-issued, complete groups kept).

Run alone: `python -m pytest tests/test_buffer_service.py -q`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import msgpack
import numpy as np
import zmq

from nanoverl_async.wire import trajectory as wire
from nanoverl_async.buffer.gate import AdmissionGate
from nanoverl_async.buffer.generator_time import GatedClock, TokenRate, WorkShares
from nanoverl_async.buffer.replay import ADDED, COMPLETED, FILTERED, Group, ReplayBuffer
from nanoverl_async.config import BufferConfig, GeneratorConfig
from nanoverl_async.observe.trace import SpanLog
from nanoverl_async.wire.trajectory import Trajectory
from nanoverl_async.wire.auth import CONTROL_MESSAGE_BYTES, CurveKeys, serve

log = logging.getLogger(__name__)

POLL_MS = 20  # the thread wakes at least this often to expire leases and notice close()
DRAIN_MAX = 256  # messages taken from one socket before looking at the other (no starvation)
STATE_FORMAT = 2  # buffer.msgpack's layout (state_bytes); bump when it changes (2: trajectories have spans)
# A trajectory's bytes per token, at most: 13 in its arrays, and the text of its kept messages (a token is a
# few bytes of text, the longest in common vocabularies a few hundred). Bounds what the PULL socket takes in.
TRAJECTORY_BYTES_PER_TOKEN = 1024
TOKEN_RATE_WINDOWS = 5  # windows between batches that tokens/generated_per_s is measured over (TokenRate)


class OversizedLease(ValueError):
    """A lease asking for more groups than a generator may ever hold (counted apart: oversized_leases)."""


@dataclass
class Batch:
    trajectories: list[Trajectory]  # B groups of G, group-contiguous, each group ordered by sample_index
    stats: dict  # batch_stats(...) plus the service counters at hand-out time


def parse_request(payload: bytes) -> dict:
    """A lease/report request -> a checked dict, or ValueError (a WireError) naming the bad field."""
    request = wire.unpack_map(payload)
    keys = {"lease": ("op", "generator_id", "version", "max_groups"), "report": ("op", "generator_id", "version")}
    op = request.get("op")
    if op not in keys:
        raise ValueError(f"field 'op': {op!r} is not one of {', '.join(keys)}")
    optional = {"lease": ("clock_ms", "busy_ms", "tool_wait_ms"), "report": ("weights_refetched",)}[op]
    names = keys[op] + tuple(name for name in optional if name in request)
    wire.check_fields(request, set(names))
    for name in names[1:]:
        if not isinstance(request[name], int) or isinstance(request[name], bool) or request[name] < 0:
            raise ValueError(f"field '{name}': expected a non-negative int, got {request[name]!r}")
    return request


def batch_stats(version: int, groups: list[Group]) -> dict:
    """Per-batch staleness (lag = `version`, the weights the batch updates, - the sampling version) per trajectory
    and per generated token, and episode shape; the only place these are computed: metrics.step_metrics logs them
    (metrics.BUFFER_STAT_KEYS)."""
    trajectories = [t for g in groups for t in g.trajectories]
    lags = [version - t.version for t in trajectories if t.version >= 0]
    token_lags = Counter()
    for t in trajectories:
        values, counts = np.unique(version - t.versions[t.versions >= 0], return_counts=True)
        token_lags.update(dict(zip(values.tolist(), counts.tolist())))
    tokens = sum(token_lags.values())
    return {
        "staleness_hist": dict(sorted(Counter(lags).items())),
        "staleness_token_hist": dict(sorted(token_lags.items())),
        "staleness_mean": float(np.mean(lags)) if lags else 0.0,
        "staleness_max": max(lags, default=0),
        "staleness_token_mean": sum(k * n for k, n in token_lags.items()) / tokens if tokens else 0.0,
        "turns_mean": float(np.mean([t.num_turns for t in trajectories])),
        "tool_calls_mean": float(np.mean([t.tool_calls for t in trajectories])),
        "tool_errors_mean": float(np.mean([t.tool_errors for t in trajectories])),
        "reward_mean": float(np.mean([t.reward for t in trajectories])),
        "batch_tokens_generated": tokens,
    }


class BufferService:
    def __init__(self, prompts_per_step: int, group_size: int, staleness: int, config: BufferConfig,
                 host: str, generators: GeneratorConfig, vocab_size: int,
                 prompt_fn: Callable[[int], dict], group_filter: bool = False, curve: Optional[CurveKeys] = None,
                 trace: bool = False, max_tokens: Optional[int] = None):
        """`host`: the address both sockets bind (this node's); `generators`: how many there are (replicas: ids
        0..replicas-1) and how many groups each may run; `vocab_size`: the model's, which bounds every token id;
        `max_tokens`: agent.max_total_tokens, which bounds every trajectory's length (None: no bound, for tests);
        `curve`: the run's keys (wire/auth.py): only the run's generators can then connect."""
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.staleness = staleness
        self.generators = generators
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self._published = 0  # the newest weights version published (or about to be): no token is newer
        self.gate = AdmissionGate(prompts_per_step, staleness, config.lease_timeout_s, prompt_fn)
        self.replay = ReplayBuffer(group_size, group_filter)  # group_filter: DAPO dynamic sampling
        self._cond = threading.Condition()  # guards gate, replay and the counters below (re-entrant: an RLock)
        self._counters = Counter(malformed=0, malformed_requests=0, too_long=0, oversized_leases=0,
                                 weights_refetched=0)
        self._generator_versions: dict[int, int] = {}
        self._refetches: dict[int, int] = {}  # generator -> the weights_refetched it last reported
        self._tokens = TokenRate(TOKEN_RATE_WINDOWS)  # sampled tokens received, per window between batches
        self._gated = GatedClock(time.monotonic())
        self._work = WorkShares()
        self.trace = SpanLog(trace)
        self._error: BaseException | None = None
        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.MAXMSGSIZE, CONTROL_MESSAGE_BYTES)  # a lease request is a few dozen bytes
        if max_tokens is not None:  # and 1 MiB more for its other fields (rewards' extras, spans)
            self._pull.setsockopt(zmq.MAXMSGSIZE, max_tokens * TRAJECTORY_BYTES_PER_TOKEN + (1 << 20))
        self._stop_authenticator = serve(self._context, curve, self._pull, self._router)
        self.endpoints = {name: f"tcp://{host}:{socket.bind_to_random_port(f'tcp://{host}')}"
                          for name, socket in (("trajectories", self._pull), ("leases", self._router))}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="buffer-service", daemon=True)
        self._thread.start()
        log.info("buffer service: trajectories %s, leases %s", self.endpoints["trajectories"],
                 self.endpoints["leases"])

    # ---- learner side ----
    def next_batch(self, version: int, timeout_s: float) -> Batch:
        """The trajectories of the B oldest fresh complete groups for the update of weights `version`."""
        start = time.monotonic()
        deadline = start + timeout_s
        with self._cond:
            while True:
                if self._error is not None:  # its message here: the cause does not survive a trip through Ray
                    raise RuntimeError(f"buffer service thread died: {type(self._error).__name__}: "
                                       f"{self._error}") from self._error
                groups, dropped = self.replay.take(version, self.prompts_per_step, self.staleness)
                for group in dropped:
                    self.gate.release(group.group_id, reissue=True)
                if dropped:
                    log.info("step %d: dropped %d stale groups (versions %s, eta %d)", version + 1, len(dropped),
                             sorted(g.version for g in dropped), self.staleness)
                if groups:
                    for group in groups:
                        self.gate.consume(group.group_id)
                    now = time.monotonic()
                    stats = {**batch_stats(version, groups), **self.stats(), "wait_s": now - start,
                             "generators_gated_frac": self._gated.fraction(now, self.generators.replicas),
                             **self._work.fractions()}
                    stats["tokens_per_s"] = self._tokens.rate(now)  # after stats(): it ends the window's count
                    return Batch([t for g in groups for t in g.trajectories], stats)
                if self._stop.is_set():
                    raise RuntimeError(f"buffer service closed while step {version + 1} waited for a batch")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"buffer: step {version + 1} waited {timeout_s:.1f}s for {self.prompts_per_step} complete "
                        f"groups of {self.group_size} with version >= {version - self.staleness}; "
                        f"{len(self.replay.ready)} ready, {self.gate.in_flight()} in flight, "
                        f"{self.replay.counters['dropped_stale']} dropped as stale so far, "
                        f"generator versions {self._generator_versions or 'none reported'}")
                self._cond.wait(remaining)

    def stats(self) -> dict:
        with self._cond:
            return {
                **self.gate.counters,
                **self.replay.counters,  # dropped_stale, _filtered, _stragglers, _duplicates, _mismatched
                # malformed (too_long among them), malformed_requests (oversized_leases among them), weights_refetched
                **self._counters,
                "groups_in_flight": self.gate.in_flight(),
                "groups_ready": len(self.replay.ready),
                "groups_started": self.gate.groups_started,
                "generator_versions": dict(self._generator_versions),
                "tokens_generated": self._tokens.tokens,
            }

    def publishing(self, version: int) -> None:
        """The controller is about to publish weights `version`: from now on tokens and requests may carry it."""
        with self._cond:
            self._published = max(self._published, version)

    def state_bytes(self, version: int) -> bytes:
        """The whole buffer state at weights `version` (the checkpoint's step), as msgpack bytes."""
        with self._cond:
            state = {"format": STATE_FORMAT, "version": version, "gate": self.gate.state(),
                     "replay": self.replay.state(), "service": dict(self._counters)}
        return msgpack.packb(state, use_bin_type=True)

    def restore(self, data: bytes) -> None:
        """Load `state_bytes` into this fresh service; generators below its version get no lease. `data` is a
        checkpoint's buffer.msgpack: msgpack is data only, and every restored trajectory is held to the bounds
        of an arriving one (the learner trains on it); anything else: ValueError, one line naming the file."""
        try:
            state = msgpack.unpackb(data, raw=False, strict_map_key=False)
            if state.get("format") != STATE_FORMAT:
                raise ValueError(f"format {state.get('format')!r}, expected {STATE_FORMAT}")
            with self._cond:
                kept = self.gate.restore(state["gate"], state["version"], time.monotonic())
                self._published = state["version"]  # the resumed run publishes it before any generator leases
                self.replay.restore(state["replay"], kept)
                self._counters.update(state["service"])
                for trajectory in (t for group in self.replay.ready.values() for t in group.trajectories):
                    wire.check_bounds(trajectory, self.vocab_size, self._published, self.max_tokens)
        except Exception as error:  # noqa: BLE001 - whatever the file holds, the run ends in one line naming it
            raise ValueError(f"checkpoint file buffer.msgpack is not a buffer state ({type(error).__name__}: "
                             f"{error})") from None
        log.info("buffer: restored at version %d: %d complete groups kept, frontier %s", state["version"],
                 len(kept), {k: v for k, v in self.gate.frontier().items() if k != "live"})

    def close(self) -> None:
        """Stop the thread and close both sockets (linger 0); returns within ~POLL_MS."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        with self._cond:
            self._cond.notify_all()
        self._stop_authenticator()
        if not self._thread.is_alive() and not self._context.closed:
            self._context.term()

    # ---- the socket thread ----
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for socket, _ in poller.poll(POLL_MS):
                    for _ in range(DRAIN_MAX):  # then the other socket: neither starves
                        try:
                            frames = socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if socket is self._pull:  # a trajectory
                            self._on_trajectory(frames[-1])
                        else:  # a request, answered to the peer its routing frames name
                            socket.send_multipart(frames[:-1] + [self._on_request(frames[-1])])
                self._expire(time.monotonic())
        except BaseException as error:  # noqa: BLE001 - surfaced to next_batch, never swallowed
            log.exception("buffer service thread died")
            self._error = error
        finally:
            self._pull.close(linger=0)
            self._router.close(linger=0)
            with self._cond:
                self._cond.notify_all()

    def _on_trajectory(self, message: bytes) -> None:
        try:
            trajectory = wire.decode(message)
            wire.check_bounds(trajectory, self.vocab_size, self._published, self.max_tokens)
        except Exception as error:  # noqa: BLE001 - no input may kill the service
            with self._cond:
                self._counters.update(malformed=1, too_long=isinstance(error, wire.TooLong))
            log.warning("buffer: dropped a malformed trajectory message (%d bytes): %s", len(message), error)
            return
        with self._cond:
            self._tokens.tokens += trajectory.num_generated
            outcome = self.replay.add(trajectory)
            if outcome == COMPLETED:
                self.gate.complete(trajectory.group_id)
                self._cond.notify_all()
            elif outcome == FILTERED:  # all rewards tie: slot back, prompt consumed (not retried)
                self.gate.release(trajectory.group_id, reissue=False)
            if outcome in (COMPLETED, FILTERED):
                self.trace.end(trajectory.group_id, outcome=outcome)
        if outcome not in (ADDED, COMPLETED, FILTERED):
            log.info("buffer: dropped trajectory %s of group %d (%s)", trajectory.id, trajectory.group_id, outcome)

    def _on_request(self, payload: bytes) -> bytes:
        try:
            request = parse_request(payload)
            self._check_claims(request)
        except ValueError as error:
            with self._cond:
                self._counters.update(malformed_requests=1, oversized_leases=isinstance(error, OversizedLease))
            log.warning("buffer: malformed lease request: %s", error)
            return msgpack.packb({"error": str(error)}, use_bin_type=True)
        with self._cond:
            self._generator_versions[request["generator_id"]] = request["version"]
            generator_id = request["generator_id"]
            if request["op"] == "report":  # a generator's count since it started -> the run's, kept in checkpoints
                refetched = request.get("weights_refetched", 0)
                self._counters["weights_refetched"] += max(0, refetched - self._refetches.get(generator_id, 0))
                self._refetches[generator_id] = refetched
                return msgpack.packb({"ok": True}, use_bin_type=True)
            now = time.monotonic()
            self._tokens.start(now)
            self._work.observe(generator_id, request)
            room = self.generators.max_groups_in_flight - self.gate.in_flight(generator_id)
            leases = self.gate.lease(request["version"], max(0, min(request["max_groups"], room)), now, generator_id)
            refused = not leases and request["max_groups"] > 0
            self._gated.observe(generator_id, refused=refused, now=now)
            # the trace: a refusal opens the generator's gate-closed spell, a grant ends it; a span per lease
            if refused:
                self.trace.begin(("gate", generator_id), f"gate closed, generator {generator_id}", "gate closed",
                                 generator_id=generator_id, version=request["version"])
            else:
                self.trace.end(("gate", generator_id))
            for lease in leases:
                self.replay.open(lease.group_id, lease.prompt_index, lease.version)
                self.trace.begin(lease.group_id, "leases", "lease", group_id=lease.group_id,
                                 prompt_index=lease.prompt_index, generator_id=generator_id, version=lease.version)
        reply = [{"group_id": l.group_id, "prompt_index": l.prompt_index, "sample": l.sample} for l in leases]
        return msgpack.packb({"leases": reply}, use_bin_type=True)

    def _check_claims(self, request: dict) -> None:
        """What a well-formed request claims, against what the buffer knows; ValueError if it cannot be so."""
        if request["generator_id"] >= self.generators.replicas:
            raise ValueError(f"field 'generator_id': {request['generator_id']} is not one of this run's "
                             f"{self.generators.replicas} generators")
        if request["version"] > self._published:  # the newest version is the buffer's state: not named
            raise ValueError(f"field 'version': {request['version']} was never published")
        limit = self.generators.max_groups_in_flight
        if request.get("max_groups", 0) > limit:
            raise OversizedLease(f"field 'max_groups': {request['max_groups']} is more than a generator may hold "
                                 f"(generator.max_groups_in_flight={limit})")

    def _expire(self, now: float) -> None:
        with self._cond:
            expired = self.gate.expire(now)
            for group_id in expired:
                self.replay.close(group_id)
                self.trace.end(group_id, outcome="expired")
        if expired:
            log.warning("buffer: expired %d leases (groups %s): prompts re-issued", len(expired), expired)
