"""What a traced run measured, as `nanoverl-async simulate` (simulate.py) samples it.

    source = read_source("outputs/agent_grpo")    # a run launched with run.trace=true

From RUN_DIR's config.yaml, metrics.jsonl and trace.json (written by observe/trace.py, as docs/design.md
"The pipeline trace" tells): per completed lease, its policy version and its work; per learner step, the
hand-over of its batch (the wait after its B-th group was complete), the work of prepare, update and
publish, the controller's time before the next step, and how long its weights took to reach each
generator; how long a generator took to ask for a slot its finished group freed, and for its first groups
after the learner began; the run's own samples/s,
staleness and generators/gated_frac.

The speed model, fitted here: a process computes (a generator with a group in flight, the learner in
prepare/update/publish) at speed min(1, cores / k) x (its interference if k >= 2), k the processes computing
(`speeds`). cores: the run's machine's (the --cores of simulate; default this machine's CPUs). Interference:
how much slower a process of each kind ran beside the other than core sharing explains (`fit_interference`),
from two measurements: a generator's seconds per token of its one-call episodes with the learner computing
vs idle, among calls at or above its median concurrency (a half-empty batch is faster anyway) made after
the engine's first, warm-up calls, that no weight swap landed in (`generation_slowdown`); the learner's
seconds per batch token with a generator computing vs none, a least-squares fit over the steps
(`learner_steps`). One not measured (too few of either kind) takes the other's value; neither, 1. A span's
work is its duration at speed 1: the integral of the source's own speed over it, less what the weight swaps
that landed in it cost (`swap_cost`: the simulation charges them where they land).

Invariants: every cost is >= 0 and finite; `Source.weight_delays` has one non-empty list per step.

Run alone: `python -m pytest tests/test_simulate.py -q`.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from nanoverl_async.config import ConfigError, load_config
from nanoverl_async.observe.plot import read_rows

COMPUTE = ("prepare", "update", "publish")  # the learner's phases that compete for the cores
STEP_COSTS = ("handover", *COMPUTE, "between")  # per step: seconds, work (COMPUTE) and seconds, in this order
MIN_CALLS = 20  # one-call episodes needed in each class (busy / idle learner) to measure the slowdown
MIN_STEPS = 5  # steps (after the first) needed to fit the learner's slowdown
IDLE, BUSY = 0.2, 0.8  # a call is "idle" when the learner computed <= 20% of it, "busy" when >= 80%
TRACE = "trace.json"


@dataclass
class Source:
    """What the simulation needs from a traced run: its settings and the costs it measured."""
    batch: int  # B
    group: int  # G
    staleness: int  # eta
    generators: int
    max_groups: int  # generator.max_groups_in_flight
    drain: bool  # weight_sync.mode == drain
    steps: int  # complete steps in the trace
    lease_versions: np.ndarray  # per completed lease: the version it was granted under
    lease_work: np.ndarray  # ... and its duration at speed 1 (`speeds`)
    filtered_frac: float  # share of completed groups the group filter dropped
    step_costs: np.ndarray  # [steps, len(STEP_COSTS)]
    weight_delays: list  # per step: seconds from its publish to each generator holding its weights
    request_lags: np.ndarray  # seconds from a group's completion to its generator asking for the free slot
    starts: np.ndarray  # per generator that leased: seconds from the learner's first wait to its first lease
    slowdowns: tuple  # (generator, learner): speed beside the other kind / alone, as measured; None: not
    interference: tuple  # (generator, learner): the `speeds` factors fitted to them
    noise: float | None  # the learner's step-to-step noise (`learner_steps`): another job on the machine
    swap_work: float  # what a weight swap adds to each group in flight on its generator (`swap_cost`)
    cores: float
    measured: dict  # the run's own samples_per_s, lags (Counter), gated_frac


def trace_path(run_dir: Path) -> Path:
    """RUN_DIR's trace: trace.json as the run wrote it, else trace.json.gz as bench/simulator_check.py keeps it."""
    whole = run_dir / TRACE
    return whole if whole.is_file() or not (run_dir / f"{TRACE}.gz").is_file() else run_dir / f"{TRACE}.gz"


def load_trace(path: Path) -> list[dict]:
    """trace.json's events (gzipped when its name ends in .gz); a crashed run's file lacks the closing `]`,
    which is added."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (launch the run with run.trace=true)")
    text = (gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()).rstrip()
    try:
        events = json.loads(text if text.endswith("]") else text.rstrip(",") + "]")
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not a Chrome trace (a JSON array of events): {error}") from None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ConfigError(f"{path}: not a Chrome trace (a JSON array of events)")
    return events


def in_progress(intervals: list[tuple[float, float]]):
    """times -> how many of `intervals` contain each time (start <= t < end)."""
    starts, ends = np.sort([a for a, _ in intervals]), np.sort([b for _, b in intervals])
    return lambda times: np.searchsorted(starts, times, "right") - np.searchsorted(ends, times, "right")


def integral(points: np.ndarray, values: np.ndarray) -> Callable[[float, float], float]:
    """(a, b) -> the integral over [a, b] of the step function that holds values[i] on [points[i], points[i + 1])."""
    cumulative = np.concatenate([[0.0], np.cumsum(values * np.diff(points))])
    return lambda a, b: float(np.interp(b, points, cumulative) - np.interp(a, points, cumulative))


def read_events(events: list[dict], path: Path) -> dict:
    """The spans the model reads, as (start, end, args) in seconds, by kind; the generate calls as (start, end)
    per track (pid, tid) and per generator process ("calls of" its pid), and each generator's leases under
    "leases of" its generator_id; errors name what is missing."""
    names = {e.get("pid"): e["args"].get("name", "") for e in events if e.get("name") == "process_name"}
    spans: dict = {"steps": {}, "lease": [], "episode": [], "generate": {}, "calls of": {}, "weights": [],
                   "gate closed": []}
    learners = [e for e in events if e.get("ph") == "X" and names.get(e.get("pid")) == "learners"]
    # A trace written before 2026-11-29 counted steps from 0, as its metrics.jsonl did (metrics.current_rows), and
    # its publish spans named no version: its steps are counted as now.
    shift = 0 if any("version" in e.get("args", {}) for e in learners) else 1
    for e in events:
        if e.get("ph") != "X":
            continue
        start = e["ts"] / 1e6
        end = (e["ts"] + e["dur"]) / 1e6
        args = e.get("args", {})
        kind = "weights" if e["name"].startswith("weights v") else e["name"]
        if names.get(e.get("pid")) == "learners":
            spans["steps"].setdefault(args["step"] + shift, {})[kind] = (start, end)
        elif kind == "episode":
            spans[kind].append((start, end, {**args, "trained_step": args["trained_step"] + shift, "pid": e["pid"],
                                             "tid": e["tid"]}))
        elif kind in ("lease", "gate closed", "weights"):
            spans[kind].append((start, end, {**args, "pid": e["pid"], "tid": e["tid"]}))
        elif kind == "generate":
            spans["generate"].setdefault((e["pid"], e["tid"]), []).append((start, end))
            spans["calls of"].setdefault(e["pid"], []).append((start, end))
    spans["steps"] = [(s, phases) for s, phases in sorted(spans["steps"].items())
                      if {"wait batch", *COMPUTE} <= set(phases)]  # (step, {phase: (start, end)})
    spans["leases of"] = {}
    for start, end, args in spans["lease"]:
        spans["leases of"].setdefault(args["generator_id"], []).append((start, end))
    if not spans["episode"]:
        raise ConfigError(f"{path}: no episode events (a run launched with run.trace=true that trained a step)")
    if not spans["steps"] or not spans["lease"]:
        raise ConfigError(f"{path}: no complete learner step or no lease in the trace")
    return spans


def one_call_episodes(spans: dict) -> np.ndarray:
    """Episodes of one generate call that started once the learner had (the engine's first calls warm up, as
    the learner's first step does), at or above the median concurrency of them (mean calls in flight on its
    generator: a half-empty batch generates each token faster, whatever the learner does): rows (start, end,
    generated tokens, its generator's pid)."""
    warm = spans["steps"][0][1]["prepare"][0]
    flight = {pid: in_progress(calls) for pid, calls in spans["calls of"].items()}
    rows = []
    for start, end, args in spans["episode"]:  # an episode's calls are on its own track, inside it
        track = spans["generate"].get((args["pid"], args["tid"]), ())
        inside = [c for c in track if start <= c[0] and c[1] <= end]
        if len(inside) == 1 and warm <= inside[0][0] < inside[0][1] and args.get("generated_tokens", 0) > 0:
            a, b = inside[0]
            rows.append((a, b, args["generated_tokens"], args["pid"], flight[args["pid"]](np.linspace(a, b, 9)).mean()))
    rows = np.array(rows).reshape(-1, 5)
    loaded = rows[:, 4] >= (np.median(rows[:, 4]) if len(rows) else 0)
    return rows[loaded, :4]


def per_token(calls: np.ndarray, chosen: np.ndarray) -> float | None:
    """Seconds per generated token over the `chosen` calls (`one_call_episodes`); None under MIN_CALLS of them."""
    start, end, tokens, _ = calls[chosen].T
    return float((end - start).sum() / tokens.sum()) if chosen.sum() >= MIN_CALLS else None


def generation_slowdown(calls: np.ndarray, learner: Callable, swapped: np.ndarray) -> float | None:
    """Seconds per token of one-call episodes while the learner was idle / while it computed (<= 1 when
    the learner slows generation down), among those no weight swap landed in (`swapped`: per call,
    `swaps_inside`; swaps land between the learner's steps, when it is idle)."""
    busy = np.array([learner(a, b) / (b - a) for a, b, *_ in calls])
    idle = per_token(calls, (swapped == 0) & (busy <= IDLE))
    computing = per_token(calls, (swapped == 0) & (busy >= BUSY))
    return None if idle is None or computing is None else idle / computing


def swap_times(spans: dict) -> dict:
    """A generator's pid -> the times new weights were applied there (the ends of its `weights v` spans), sorted."""
    swaps: dict = {}
    for _, end, args in spans["weights"]:
        swaps.setdefault(args["pid"], []).append(end)
    return {pid: np.sort(times) for pid, times in swaps.items()}


def swaps_inside(rows, swaps: dict) -> np.ndarray:
    """Per row (start, end, ..., its generator's pid): how many swaps landed strictly inside it."""
    return np.array([np.searchsorted(swaps.get(pid, ()), end) - np.searchsorted(swaps.get(pid, ()), start, "right")
                     for start, end, *_, pid in rows], dtype=int)


def swap_cost(calls: np.ndarray, swapped: np.ndarray) -> float:
    """Seconds a weight swap adds to each call in flight: the engine computes the running rows again under the
    new weights (docs/design.md "The builtin engine"). From one-call episodes (`swapped`: how many swaps landed in each,
    `swaps_inside`): the seconds of those a swap landed in, beyond their tokens at the seconds per token of
    those none did, per swap; 0 when too few of either kind (MIN_CALLS) or none is slower."""
    clean, hit = per_token(calls, swapped == 0), swapped > 0
    if clean is None or hit.sum() < MIN_CALLS:
        return 0.0
    start, end, tokens, _ = calls[hit].T
    return max(0.0, float((end - start - tokens * clean).sum() / swapped[hit].sum()))


def learner_steps(spans: dict, rows: list[dict], generating: Callable, samples_per_step: int) -> tuple:
    """(the learner's slowdown beside generation, its step-to-step noise), from the steps after the first (a
    warm-up). A least-squares fit of seconds = tokens x (alone x (1 - h) + beside x h), h the share of the step's
    compute with a generator computing, tokens the batch's; the slowdown alone / beside is None unless both
    kinds hold >= 10% of the tokens (then seconds = tokens x their median ratio). The noise: the interquartile
    range of log(seconds / fitted seconds) / 1.349 (a normal's standard deviation, blind to a lone slow step):
    the same work taking different times, which on a machine of its own it does not (simulate.py `NOISY`).
    Each None under MIN_STEPS steps."""
    length = {row.get("step"): row.get("episodes/length_mean") for row in rows}
    samples = []
    for step, phases in spans["steps"][1:]:
        seconds = sum(phases[p][1] - phases[p][0] for p in COMPUTE)
        if length.get(step) and seconds > 0:
            shared = sum(generating(*phases[p]) for p in COMPUTE) / seconds
            samples.append((seconds, length[step] * samples_per_step, shared))
    if len(samples) < MIN_STEPS:
        return None, None
    seconds, tokens, shared = np.array(samples).T
    fitted, slowdown = tokens * np.median(seconds / tokens), None
    if min((tokens * shared).sum(), (tokens * (1 - shared)).sum()) >= 0.1 * tokens.sum():
        shares = np.stack([tokens * (1 - shared), tokens * shared], 1)
        (alone, beside), *_ = np.linalg.lstsq(shares, seconds, rcond=None)
        if alone > 0 and beside > 0:
            fitted, slowdown = shares @ [alone, beside], float(alone / beside)
    return slowdown, float(np.subtract(*np.percentile(np.log(seconds / fitted), [75, 25])) / 1.349)


def speeds(generators, learner, cores: float, interference: tuple):
    """(a generator's speed, the learner's) with `generators` generators and `learner` (0 or 1) computing."""
    k = np.asarray(generators + learner)
    share = np.minimum(1.0, cores / np.maximum(k, 1))
    return share * np.where(k >= 2, interference[0], 1.0), share * np.where(k >= 2, interference[1], 1.0)


def fit_interference(slowdowns: tuple, generators: int, cores: float) -> tuple[float, float]:
    """The factors under which `speeds` reproduces the measured slowdowns of a run with `generators` generators
    computing: a generator's speed changes by share(R+1) / share(R) x interference when the learner joins (R = 1;
    for R >= 2 the part core sharing leaves unexplained), the learner's by share(R+1) x interference."""
    share = [min(1.0, cores / k) for k in (generators, generators + 1)]
    generator, learner = slowdowns
    fitted = [None if generator is None else generator * share[0] / share[1],
              None if learner is None else learner / share[1]]
    fitted = [value if value is not None else other for value, other in zip(fitted, fitted[::-1])]
    return tuple(1.0 if value is None else float(min(1.0, value)) for value in fitted)


def computing(spans: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over the source run, constant between consecutive `points`: (points, the learner computing (0 or 1),
    the generators computing: those with a lease in flight)."""
    compute = [phases[p] for _, phases in spans["steps"] for p in COMPUTE]
    points = np.unique([t for interval in compute + [l[:2] for l in spans["lease"]] for t in interval])
    middles = (points[:-1] + points[1:]) / 2
    learner = (in_progress(compute)(middles) > 0).astype(float)
    return points, learner, sum((in_progress(own)(middles) > 0).astype(float) for own in spans["leases of"].values())


def step_costs(spans: dict, learner_work: Callable, drain: bool) -> tuple[np.ndarray, list]:
    """Per source step, STEP_COSTS (compute phases as work at speed 1) and the delays of its weights."""
    lease_end = {args["group_id"]: end for _, end, args in spans["lease"]}
    ready: dict = {}  # step -> when the last group it trained was complete
    for _, _, args in spans["episode"]:
        step, end = args["trained_step"], lease_end.get(args["group_id"], -math.inf)
        ready[step] = max(ready.get(step, -math.inf), end)
    rows = []
    delays = []
    steps = spans["steps"]
    for step, phases in steps:
        waited, published = phases["wait batch"], phases["publish"][1]
        handover = waited[1] - min(waited[1], max(waited[0], ready.get(step, waited[0])))
        rows.append([handover, *(learner_work(*phases[p]) for p in COMPUTE)])
        # publish end -> the generator holds the weights (drain: -> receipt; the simulation drains itself)
        delays.append([max(0.0, (start if drain else end) - published) for start, end, args in spans["weights"]
                       if args.get("version") == step])  # step N publishes version N
    between = [max(0.0, after["wait batch"][0] - before["publish"][1])
               for (_, before), (_, after) in zip(steps, steps[1:])]
    between.append(np.median(between) if between else 0.0)  # the last step has none of its own: the others' median
    every = [d for own in delays for d in own] or [0.0]  # a step whose weights no generator applied (the last)
    return np.column_stack([rows, between]), [own or every for own in delays]


def request_lags(spans: dict) -> np.ndarray:
    """How long a generator took to ask for a slot its finished group freed: from a grant, its next request
    (a grant, or a refusal that opened a gate-closed spell) minus the first completion of its groups
    between the two. The worker asks at once in theory; on a busy event loop it does not."""
    lags = []
    for g, leases in sorted(spans["leases of"].items()):
        ends = np.sort([end for _, end in leases])
        requests = sorted({(start, "grant") for start, _ in leases} |
                          {(start, "refusal") for start, _, args in spans["gate closed"] if args["generator_id"] == g})
        for (before, kind), (after, _) in zip(requests, requests[1:]):
            first = np.searchsorted(ends, before, "right")
            if kind == "grant" and first < len(ends) and ends[first] <= after:
                lags.append(after - ends[first])
    return np.array(lags or [0.0])


def generator_starts(spans: dict) -> np.ndarray:
    """Per generator that leased, seconds from the learner's first wait for a batch to its first lease (0 if
    earlier), sorted: a generator that loaded its model late left the first steps to the others."""
    begun = spans["steps"][0][1]["wait batch"][0]
    return np.sort([max(0.0, min(start for start, _ in own) - begun) for own in spans["leases of"].values()])


def measured(rows: list[dict], samples_per_step: int) -> dict:
    """The source run's own figures from metrics.jsonl, counted as `Prediction` counts them."""
    lags = Counter()
    for row in rows:
        lags.update({int(lag): n for lag, n in row.get("staleness/histogram", {}).items()})
    return {"samples_per_s": len(rows) * samples_per_step / sum(row["time/step_s"] for row in rows),
            "lags": lags, "gated_frac": float(np.mean([row.get("generators/gated_frac", 0.0) for row in rows]))}


def read_source(run_dir: str, cores: float | None = None) -> Source:
    """RUN_DIR's config.yaml, metrics.jsonl and trace.json -> Source, for a machine of `cores` cores (default:
    this one's CPUs); ConfigError naming what is wrong."""
    path = Path(run_dir)
    cfg = load_config(str(path / "config.yaml"))
    rows, trace = read_rows(path / "metrics.jsonl"), trace_path(path)
    drain, cores = cfg.weight_sync.mode == "drain", float(cores or os.cpu_count() or 1)
    try:
        spans = read_events(load_trace(trace), trace)
        pid_of_group = {args["group_id"]: args["pid"] for _, _, args in spans["episode"]}  # its generator's
        done = [(args["version"], start, end, args["outcome"], pid_of_group.get(args["group_id"]))
                for start, end, args in spans["lease"] if args.get("outcome") in ("completed", "filtered")]
        if not done:
            raise ConfigError(f"{trace}: no lease completed its group")
        points, learner, generators = computing(spans)
        generating = integral(points, (generators > 0).astype(float))
        learner_slowdown, noise = learner_steps(spans, rows, generating, cfg.data.episodes_per_step)
        calls, swaps = one_call_episodes(spans), swap_times(spans)
        swapped = swaps_inside(calls, swaps)
        slowdowns = generation_slowdown(calls, integral(points, learner), swapped), learner_slowdown
        swap = 0.0 if drain else swap_cost(calls, swapped)  # drain: no group is in flight when weights land
        interference = fit_interference(slowdowns, cfg.generator.replicas, cores)
        generator_speed, learner_speed = speeds(generators, learner, cores, interference)
        costs, delays = step_costs(spans, integral(points, learner_speed), drain)
        sampled = measured(rows, cfg.data.episodes_per_step)
    except (KeyError, TypeError) as error:  # an event or a row without a field the trace and metrics always have
        raise ConfigError(f"{path}: trace.json or metrics.jsonl lacks the field {error}") from None
    versions, starts, ends, outcomes, pids = zip(*done)
    generator_work = integral(points, generator_speed)
    # a lease's own work leaves out the swaps that landed in it (the simulation adds those where they land), at
    # least a tenth of it kept: a generated token costs something whatever the estimate of a swap
    work = np.array([generator_work(a, b) for a, b in zip(starts, ends)])
    work = np.maximum(work - swap * swaps_inside(list(zip(starts, ends, pids)), swaps), 0.1 * work)
    return Source(
        batch=cfg.data.prompts_per_step, group=cfg.data.samples_per_prompt, staleness=cfg.staleness.max,
        generators=cfg.generator.replicas, max_groups=cfg.generator.max_groups_in_flight, drain=drain,
        steps=len(costs), lease_versions=np.array(versions), lease_work=work,
        filtered_frac=outcomes.count("filtered") / len(outcomes), step_costs=costs, weight_delays=delays,
        request_lags=request_lags(spans), starts=generator_starts(spans), slowdowns=slowdowns,
        interference=interference, noise=noise, swap_work=swap, cores=cores, measured=sampled)

