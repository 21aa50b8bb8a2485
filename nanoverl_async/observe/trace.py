"""The pipeline trace: what every role did and when, as Chrome trace events in output_dir/trace.json.

    nanoverl-async launch configs/agent_grpo.yaml run.trace=true    # then open trace.json in ui.perfetto.dev

One process per role, each with its tracks (docs/design.md "The pipeline trace"):
  - "learners": the controller's wait for a batch and its prepare, update and publish calls, per step;
  - "buffer": every lease from its grant to its group's completion, and each spell in which the gate
    refused a generator (the staleness bound holding generation back);
  - "generator i": every trained episode with its model calls ("generate") and tool calls ("tool")
    inside it, and every weight version from its receipt to its application ("weights").

Where events come from: an episode's spans ride in its trajectory (`Trajectory.spans`, validated like every
wire field); the buffer and the generators keep their other spans in a `SpanLog`, which the controller
takes once a step. Nothing is recorded, sent or fetched with run.trace off.

Clocks: every role stamps time.time() of its own host. At the first step the controller estimates each
role's offset with round trips (`estimate_offset`, NTP's rule) and writes every event on its own clock;
the error is at most half the shortest round trip, written as each process's `clock_uncertainty_s`.

Invariants of the file:
  - on each track (pid, tid), spans nest or are disjoint: concurrent spans of one kind go to lanes (`place`),
    an episode's calls stay on its lane, inside it;
  - it is a JSON array written and flushed once a step; only `close` adds the closing `]`, which the format
    lets a crashed run's file lack (Perfetto and chrome://tracing open it all the same);
  - a resumed run keeps the earlier trace as trace-until-step-N.json (N: the step it resumes at).

Run alone: `python -m pytest tests/test_trace.py -q` (its real run is marked slow).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Iterable, NamedTuple

from nanoverl_async import checkpoint
from nanoverl_async.wire.trajectory import Trajectory

ROUND_TRIPS = 8  # per role, at the first step; the shortest trip bounds the offset's error best
STEP_PHASES = ("wait batch", "prepare", "update", "publish")  # the learners' spans, between the step's marks


@dataclass
class Span:
    """One interval of a role, on that role's clock (time.time() seconds), on one of its tracks."""
    track: str  # e.g. "episodes", "leases", "weights"
    name: str
    start: float
    end: float
    args: dict = field(default_factory=dict)
    children: list[Span] = field(default_factory=list)  # inside this one, drawn on its lane (an episode's calls)


class SpanLog:
    """A role's spans until the controller takes them. Thread-safe: the buffer records on its socket thread
    while the controller's call takes them on another. Disabled (run.trace off), every call returns at once."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._open: dict[Hashable, Span] = {}
        self._done: list[Span] = []
        self._lock = threading.Lock()

    def begin(self, key: Hashable, track: str, name: str, **args) -> None:
        """Open a span under `key` now, unless one is open under it already (a spell that goes on)."""
        if self.enabled:
            with self._lock:
                self._open.setdefault(key, Span(track, name, time.time(), 0.0, args))

    def end(self, key: Hashable, **args) -> None:
        """Close the span open under `key` now, with `args` added; nothing if none is (a restored lease, or
        run.trace off: nothing was opened)."""
        with self._lock:
            span = self._open.pop(key, None)
        if span is not None:
            span.args.update(args)
            self.add(span.track, span.name, span.start, time.time(), **span.args)

    def add(self, track: str, name: str, start: float, end: float, **args) -> None:
        if self.enabled:
            with self._lock:
                self._done.append(Span(track, name, start, end, args))

    def take(self) -> list[Span]:
        """The closed spans since the last take (open ones stay until they end)."""
        with self._lock:
            done, self._done = self._done, []
        return done


def estimate_offset(fetch: Callable[[], tuple[float, list]]) -> tuple[float, float, list[Span]]:
    """A role's clock minus ours -> (offset, uncertainty, the spans the trips fetched). Around each trip we
    read our clock (t0, t1); offset = theirs - (t0 + t1) / 2 is exact when both legs take equally long and
    off by at most (t1 - t0) / 2 otherwise, so the shortest trip's is kept (NTP's choice)."""
    best, spans = (0.0, float("inf")), []
    for _ in range(ROUND_TRIPS):
        t0 = time.time()
        theirs, fetched = fetch()
        t1 = time.time()
        spans += fetched
        if t1 - t0 < best[1]:
            best = (theirs - (t0 + t1) / 2, t1 - t0)
    return best[0], best[1] / 2, spans


def place(lanes: list[float], start: float, end: float) -> int:
    """The lane of a span on a track whose lanes are free from `lanes` (each lane's last end, updated): the
    first lane whose spans all ended by its start, so the spans of a lane are disjoint. Spans may come out of
    order (an episode comes with the batch that trained it); such a span may open a lane more than strictly
    needed, never overlap another."""
    for lane, free_at in enumerate(lanes):
        if free_at <= start:
            lanes[lane] = end
            return lane
    lanes.append(end)
    return len(lanes) - 1


def sequential(spans: list[Span]) -> list[Span]:
    """`spans` in start order, less any that overlaps the one kept before it: one episode's calls are
    sequential (each extends the same token record), and a lane can only show disjoint children."""
    kept: list[Span] = []
    for span in sorted(spans, key=lambda s: s.start):
        if not kept or span.start >= kept[-1].end:
            kept.append(span)
    return kept


def episode_span(t: Trajectory, step: int) -> Span:
    """A trained trajectory's `spans` (the episode's first, validated on the wire) -> its episode Span."""
    (_, start, end), calls = t.spans[0], t.spans[1:]
    args = {"id": t.id, "prompt_index": t.prompt_index, "sample_index": t.sample_index, "group_id": t.group_id,
            "generated_tokens": t.num_generated, "turns": t.num_turns, "tool_calls": t.tool_calls,
            "reward": t.reward, "finish_reason": t.finish_reason,
            "versions": sorted(set(t.versions[t.versions >= 0].tolist())), "trained_step": step}
    return Span("episodes", "episode", start, end, args, [Span("episodes", kind, s, e) for kind, s, e in calls])


def complete(name: str, pid: int, tid: int, start: float, end: float, args: dict) -> dict:
    """A complete ("X") event in whole microseconds. Start and end are rounded each (never the duration),
    so spans that nest or are disjoint in seconds still do."""
    ts = round(start * 1e6)
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": max(0, round(end * 1e6) - ts),
            "args": args}


class TracedRole(NamedTuple):
    """A role as the controller's trace reaches it (controller/roles.py wraps its actor's `trace_events`)."""
    name: str  # the trace's process: "buffer", "generator 0", ...
    fetch: Callable[[], tuple[float, list[Span]]]  # one round trip: (its time.time(), its SpanLog.take())


class PipelineTrace:
    """The controller's side: each role's clock offset at the first step, then once a step the learners'
    phases, the episodes just trained and every role's spans, on the controller's clock, into trace.json."""

    def __init__(self, output_dir: str | Path, roles: list[TracedRole], resume_step: int = 0):
        path = checkpoint.claim(output_dir, "trace.json")  # never a link's target; listed in the run's marker
        if path.exists():  # only a resumed run finds one (a fresh run's directory is empty): keep it
            kept, n = path.with_name(f"trace-until-step-{resume_step}.json"), 2
            while kept.exists():  # a step resumed at twice: -2, -3, ...
                kept, n = path.with_name(f"trace-until-step-{resume_step}-{n}.json"), n + 1
            path.rename(checkpoint.claim(output_dir, kept.name))
        self.file = path.open("w")  # Chrome trace events, "JSON Array Format": `[` now, `]` at close
        self.file.write("[")
        self.events = 0  # written so far
        self.roles = roles
        self.offsets: dict[str, tuple[float, float]] = {}  # role -> (offset, uncertainty), from the first step
        # process -> pid; (process, track, lane) -> tid; (process, track) -> its lanes (`place`)
        self.pids = {}
        self.tids = {}
        self.lanes = {}

    def step(self, step: int, trajectories: list[Trajectory], marks: tuple[float, ...]) -> None:
        """After step `step` (counted from 1, as metrics.jsonl does): its phases (`marks`: time.monotonic() when its
        wait began and after each of STEP_PHASES; "publish" names the weights version it published, `step`), the
        episodes it trained, and the spans every role closed since the last step."""
        to_wall = time.time() - time.monotonic()  # read now: the marks are seconds old, clock slew cannot matter
        spans = [("learners", Span("steps", name, to_wall + a, to_wall + b,
                                   {"step": step, **({"version": step} if name == "publish" else {})}))
                 for name, a, b in zip(STEP_PHASES, marks, marks[1:])]
        spans += [(f"generator {t.generator_id}", episode_span(t, step)) for t in trajectories if t.spans]
        if not self.pids:  # the first step: every role's offset, then the processes' names (learners first)
            for role in self.roles:
                offset, uncertainty, fetched = estimate_offset(role.fetch)
                self.offsets[role.name] = (offset, uncertainty)
                spans += [(role.name, span) for span in fetched]  # what the trips fetched
            names = ["learners", *(role.name for role in self.roles)]
            self._write([event for name in names for event in self._pid(name)[1]])
        for role in self.roles:
            spans += [(role.name, span) for span in role.fetch()[1]]
        self._write([event for process, span in spans for event in self._events(process, span)])

    def _write(self, events: Iterable[dict]) -> None:
        for event in events:
            self.file.write(("\n" if not self.events else ",\n") + json.dumps(event, separators=(",", ":")))
            self.events += 1
        self.file.flush()  # a crashed run leaves every step written so far

    def close(self) -> None:
        self.file.write("\n]\n")
        self.file.close()

    def _events(self, process: str, span: Span) -> list[dict]:
        """One span (and its children) of `process`, moved onto the controller's clock and placed on a lane."""
        offset = self.offsets.get(process, (0.0, 0.0))[0]
        pid, events = self._pid(process)
        lane = place(self.lanes.setdefault((process, span.track), []), span.start - offset, span.end - offset)
        if (process, span.track, lane) not in self.tids:
            tid = self.tids[(process, span.track, lane)] = len(self.tids) + 1
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": f"{span.track} {lane}" if lane else span.track}})
        tid = self.tids[(process, span.track, lane)]
        return events + [complete(s.name, pid, tid, s.start - offset, s.end - offset, s.args)
                         for s in (span, *sequential(span.children))]

    def _pid(self, process: str) -> tuple[int, list[dict]]:
        """The process's id, and its metadata events when it is new (a trajectory may name any generator)."""
        if process in self.pids:
            return self.pids[process], []
        pid = self.pids[process] = len(self.pids) + 1
        offset, uncertainty = self.offsets.get(process, (0.0, 0.0))
        return pid, [{"name": "process_name", "ph": "M", "pid": pid,
                      "args": {"name": process, "clock_offset_s": offset, "clock_uncertainty_s": uncertainty}},
                     {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
