"""What-if for the staleness limit and the generator count: a discrete-event simulation driven by a traced run.

    nanoverl-async simulate RUN_DIR --staleness 0,1,2,4,8 --generators 1,2,4 [--cores C] [--seed N]

RUN_DIR is a run launched with run.trace=true. For each setting the simulation replays the pipeline of
docs/design.md "Processes and data flow" with the project's own rules on a simulated clock: `AdmissionGate`
(buffer/gate.py), `ReplayBuffer.take` (buffer/replay.py: the consumption check, stale groups dropped and
re-issued) and `GatedClock` (buffer/service.py: generators/gated_frac). It prints the predicted samples/s,
staleness and gated_frac per setting under the run's measured values, and recommends a setting.

The model; every cost is drawn from the run (run_costs.py) with a seeded RNG:
  - A generator asks for its first groups when it did in the run, counted from the learner's first wait (one
    that loaded its model late leaves the first steps to the others; other generator counts cycle through the
    run's). It keeps up to generator.max_groups_in_flight groups leased: it asks the gate when new weights
    arrive and when a group finishes; an empty reply starts a gated spell (generators/worker.py
    `_lease_loop`). The run's worker noticed a freed slot only after a lag (its event loop was busy
    generating), so a refusal comes after a drawn lag; a grant comes at once, as the lag cost the run little
    generation (its other groups ran faster meanwhile).
  - A group takes the work of one of the run's leases (grant to its last episode), drawn among those granted
    under the nearest policy versions (episodes lengthen as the policy learns to call the tool). A
    generator's groups run side by side, each as long as in the run: its batching is taken as it was there.
  - The learner, per step: `take` until B groups are ready, the batch's hand-over, prepare, update, publish
    and the controller's time before the next step, drawn together from one of the run's nearby steps. Each
    generator holds the new weights after a drawn delay (drain mode: once its groups have finished).
  - Speeds (run_costs.py `speeds`): the computing processes (generators with a group in flight, the learner
    in prepare/update/publish) share the machine's cores equally, and each is slowed by the interference
    measured in the run whenever it is not alone. So a synchronous setting generates and trains at full
    speed, and generators beyond the cores slow each other and the learner down.
Left out: lease expiry, evaluation and checkpoints, and any effect of the setting on what the policy learns
(episode lengths follow the version). samples/s is B x G x steps over the summed time/step_s (wait + train +
publish), as metrics.jsonl and bench/async_vs_sync.py count it. Each setting pools several simulated runs
of the run's length (REPEATS, POOLED_STEPS).

Invariants: the gate, the consumption check and gated_frac are the project's own classes, so no simulated
batch breaks t - u <= eta and staleness 0 trains only on fresh groups; the same seed prints the same table.

Run alone: `python -m pytest tests/test_simulate.py -q` (its real run is marked slow).
"""

from __future__ import annotations

import heapq
import math
import textwrap
from collections import Counter
from dataclasses import dataclass

import numpy as np

from nanoverl_async.buffer.gate import AdmissionGate
from nanoverl_async.buffer.replay import ReplayBuffer
from nanoverl_async.buffer.service import GatedClock
from nanoverl_async.config import ConfigError
from nanoverl_async.observe.run_costs import COMPUTE, STEP_COSTS, Source, read_source, speeds
from nanoverl_async.wire.trajectory import Trajectory

STEP_POOL = 5  # a simulated step after the first draws its costs among the run's this many nearest steps
REPEATS, POOLED_STEPS = 3, 120  # per setting, at least this many simulated runs and steps in all, pooled
WITHIN = 0.05  # the recommendation: the smallest staleness within 5% of the best predicted samples/s
GENERATING, LEARNING = 0, 1  # the two virtual clocks: generators' groups, the learner's compute
HEADER = f"{'setting':<26}{'samples/s':>10}{'mean':>6}{'max':>5}{'gated':>7}  staleness: lag:% of samples"


@dataclass
class Prediction:
    samples_per_s: float
    lags: Counter  # lag -> trajectories trained at that lag
    gated_frac: float


def nearest(keys: np.ndarray, center: int, minimum: int) -> np.ndarray:
    """Indices of the keys closest to `center`, whole keys at a time, until at least `minimum` (or all)."""
    distance = np.abs(keys - center)
    for radius in np.unique(distance):
        chosen = np.flatnonzero(distance <= radius)
        if len(chosen) >= minimum:
            return chosen
    return np.arange(len(keys))


def group_record(lease) -> Trajectory:
    """What a simulated group files in the replay buffer: one trajectory with one token of the lease's version."""
    one = np.ones(1)
    return Trajectory(str(lease.group_id), lease.group_id, lease.prompt_index, 0, one.astype(np.int32),
                      one.astype(np.uint8), one * 0, np.array([lease.version]), 0.0)


class Simulation:
    """One simulated run at one setting. All computing generators run at one speed and the learner at its own
    (run_costs.py `speeds`), so a job ends when its kind's virtual clock, which runs at that kind's speed,
    reaches its start plus its work. Timers (weights in transit, the learner's other phases) run on the real
    clock."""

    def __init__(self, source: Source, staleness: int, generators: int, rng: np.random.Generator):
        self.source, self.staleness, self.generators, self.rng = source, staleness, generators, rng
        self.gate = AdmissionGate(source.batch, staleness, math.inf, lambda index: {})
        self.replay = ReplayBuffer(1)  # one record per group: the G episodes of a group share its version here
        self.gated = GatedClock(0.0)
        self.now, self.virtual = 0.0, [0.0, 0.0]  # the real clock; GENERATING's and LEARNING's virtual clocks
        self.jobs: list = [[], []]  # per virtual clock, a heap of (virtual end, seq, handler, args)
        self.timers: list = []  # heap of (time, seq, handler, args)
        self.seq = 0
        self.version, self.pending = [0] * generators, [None] * generators  # pending: drain mode's next version
        self.in_flight, self.asking = [0] * generators, [False] * generators  # asking: a request is on its way
        self.step, self.phase = 0, -1  # phase: an index into STEP_COSTS; -1 while waiting for a batch
        self.costs, self.delays = source.step_costs[0], source.weight_delays[0]
        self.step_start, self.step_seconds, self.gated_fracs = 0.0, [], []
        self.lags = Counter()
        self.pools: dict = {}  # version -> indices of the run's leases a group of that version draws from
        self.starts = [source.starts[g % len(source.starts)] for g in range(generators)]  # first requests

    def run(self, steps: int) -> Prediction:
        for g, start in enumerate(self.starts):
            self.at(self.timers, start, self.request, g)
        while self.step < steps:
            self.advance()
        return Prediction(self.source.batch * self.source.group * steps / sum(self.step_seconds), self.lags,
                          float(np.mean(self.gated_fracs)))

    def advance(self) -> None:
        """Move the clocks to the next event and handle it."""
        learning = self.phase >= 0 and STEP_COSTS[self.phase] in COMPUTE
        rates = [float(r) for r in speeds(sum(n > 0 for n in self.in_flight), learning, self.source.cores,
                                           self.source.interference)]
        ends = [self.now + (jobs[0][0] - virtual) / rate if jobs else math.inf
                for jobs, virtual, rate in zip(self.jobs, self.virtual, rates)]
        ends.append(self.timers[0][0] if self.timers else math.inf)
        first = int(np.argmin(ends))
        assert ends[first] < math.inf, f"simulation stalled at step {self.step}"
        self.virtual = [virtual + (ends[first] - self.now) * rate for virtual, rate in zip(self.virtual, rates)]
        self.now, (at, _, handler, args) = ends[first], heapq.heappop((*self.jobs, self.timers)[first])
        if first < len(self.jobs):
            self.virtual[first] = at  # exact, whatever the rounding of the line above
        handler(*args)

    def at(self, heap: list, when: float, handler, *args) -> None:
        self.seq += 1  # ties resolve in scheduling order, never by comparing handlers
        heapq.heappush(heap, (when, self.seq, handler, args))

    def request(self, g: int, slot_freed: bool = False) -> None:
        """Generator g asks for as many groups as it has free slots (worker.py `_lease_loop`). It notices a slot
        its finished group freed only after a lag (the run's: its event loop is busy generating), but its
        other groups speed up meanwhile, so a granted group starts at once and only a refusal waits."""
        free = self.source.max_groups - self.in_flight[g]
        if self.pending[g] is not None or free <= 0 or self.now < self.starts[g]:  # not started: weights wait
            return
        leases = self.gate.lease(self.version[g], free, self.now, g)
        if not leases and slot_freed:
            if not self.asking[g]:
                self.asking[g] = True
                self.at(self.timers, self.now + self.rng.choice(self.source.request_lags), self.ask, g)
            return
        self.gated.observe(g, refused=not leases, now=self.now)
        for lease in leases:
            self.replay.open(lease.group_id, lease.prompt_index, lease.version)
            self.in_flight[g] += 1
            if lease.version not in self.pools:
                self.pools[lease.version] = nearest(self.source.lease_versions, lease.version, self.source.batch)
            work = self.source.lease_work[self.rng.choice(self.pools[lease.version])]
            self.at(self.jobs[GENERATING], self.virtual[GENERATING] + work, self.group_done, g, lease)

    def group_done(self, g: int, lease) -> None:
        self.in_flight[g] -= 1
        if self.rng.random() < self.source.filtered_frac:  # the group filter: slot back, prompt done
            self.replay.close(lease.group_id)
            self.gate.release(lease.group_id, reissue=False)
        else:
            self.replay.add(group_record(lease))
            self.gate.complete(lease.group_id)
            self.take()
        if self.pending[g] is not None and not self.in_flight[g]:
            self.version[g], self.pending[g] = self.pending[g], None  # drained: apply, and ask at once
            self.request(g)
        else:
            self.request(g, slot_freed=True)

    def ask(self, g: int) -> None:
        self.asking[g] = False
        self.request(g)

    def weights(self, g: int, version: int) -> None:
        if version <= max(self.version[g], self.pending[g] or 0):
            return
        if self.source.drain and self.in_flight[g]:
            self.pending[g] = version  # no new group until the in-flight ones finish
            return
        self.version[g] = version
        self.request(g)

    def take(self) -> None:
        """The learner's next_batch (buffer/service.py): the consumption check, then B groups or keep waiting."""
        if self.phase != -1:
            return
        groups, dropped = self.replay.take(self.step, self.source.batch, self.staleness)
        for group in dropped:
            self.gate.release(group.group_id, reissue=True)
        for g in self.rng.permutation(self.generators) if dropped else ():  # slots came back
            self.request(int(g))
        if groups:
            for group in groups:
                self.gate.consume(group.group_id)
                self.lags[self.step - group.version] += self.source.group
            self.gated_fracs.append(self.gated.fraction(self.now, self.generators))
            later = np.arange(1, self.source.steps)  # step 0 warms up (allocations, first calls): it stands alone
            chosen = self.rng.choice(nearest(later, self.step, STEP_POOL) + 1) if self.step and len(later) else 0
            self.costs, self.delays = self.source.step_costs[chosen], self.source.weight_delays[chosen]
            self.start_phase(0)

    def start_phase(self, phase: int) -> None:
        self.phase = phase
        if STEP_COSTS[phase] in COMPUTE:
            self.at(self.jobs[LEARNING], self.virtual[LEARNING] + self.costs[phase], self.phase_done)
        else:
            self.at(self.timers, self.now + self.costs[phase], self.phase_done)

    def phase_done(self) -> None:
        if STEP_COSTS[self.phase] == "publish":  # the step's time ends here, as time/step_s does
            self.step_seconds.append(self.now - self.step_start)
            self.step += 1
            for g in range(self.generators):
                self.at(self.timers, self.now + self.rng.choice(self.delays), self.weights, g, self.step)
        if self.phase + 1 < len(STEP_COSTS):
            self.start_phase(self.phase + 1)
        else:
            self.phase, self.step_start = -1, self.now
            self.take()


def predict(source: Source, staleness: int, generators: int, seed: int = 0) -> Prediction:
    """Simulated runs of the run's length at one setting, pooled; the same seed, the same numbers."""
    repeats = max(REPEATS, math.ceil(POOLED_STEPS / source.steps))
    runs = [Simulation(source, staleness, generators, np.random.default_rng([seed, staleness, generators, r]))
            .run(source.steps) for r in range(repeats)]
    return Prediction(float(np.mean([r.samples_per_s for r in runs])), sum((r.lags for r in runs), Counter()),
                      float(np.mean([r.gated_frac for r in runs])))


def parse_list(text: str, flag: str, least: int) -> list[int]:
    """'0,1,2' -> [0, 1, 2], each >= least; a ConfigError naming the flag otherwise."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers >= {least}, e.g. {flag} 0,1,2")
    return sorted(set(values))


def recommend(predictions: dict) -> tuple[int, int]:
    """(staleness, generators): the smallest staleness whose best samples/s is within WITHIN of the best of
    all (less staleness is safer for learning), then the fewest generators within WITHIN of that."""
    best = max(p.samples_per_s for p in predictions.values())
    eta = min(s for (s, _), p in predictions.items() if p.samples_per_s >= (1 - WITHIN) * best)
    top = max(p.samples_per_s for (s, _), p in predictions.items() if s == eta)
    return eta, min(g for (s, g), p in predictions.items() if s == eta and p.samples_per_s >= (1 - WITHIN) * top)


def row(label: str, samples_per_s: float, lags: Counter, gated_frac: float) -> str:
    """One line of the table under HEADER: samples/s, staleness mean and max, gated_frac, the lags' shares."""
    total = sum(lags.values()) or 1
    mean = sum(lag * n for lag, n in lags.items()) / total
    shares = " ".join(f"{lag}:{100 * n / total:.0f}" for lag, n in sorted(lags.items()))
    return f"{label:<26}{samples_per_s:>10.1f}{mean:>6.2f}{max(lags, default=0):>5}{gated_frac:>7.2f}  {shares}"


def model_notes(source: Source) -> str:
    """What the predictions assume, in the words the table is printed with."""
    (generator, learner), fitted = source.slowdowns, source.interference

    def slowed(measured: float | None, factor: float) -> str:
        return f"{'not measured' if measured is None else f'{measured:.2f}x'} (interference {factor:.2f})"
    return (f"Model: generation beside the learner ran at {slowed(generator, fitted[0])} its speed alone, the "
            f"learner beside generation at {slowed(learner, fitted[1])}. "
            f"Other generator counts assume {source.cores:g} cores (--cores) shared equally by the computing "
            f"processes (each generator, the learner), each also slowed by its interference when not alone, and "
            f"each generator batching up to {source.max_groups} groups (generator.max_groups_in_flight) as here.")


def report(run_dir: str, staleness: str, generators: str, cores: float | None = None, seed: int = 0) -> str:
    """The table and the recommendation `nanoverl-async simulate` prints."""
    etas, counts = parse_list(staleness, "--staleness", 0), parse_list(generators, "--generators", 1)
    if cores is not None and not cores > 0:
        raise ConfigError(f"--cores {cores}: expected a number of cores > 0")
    source = read_source(run_dir, cores)
    predictions = {(s, g): predict(source, s, g, seed) for s in etas for g in counts}
    lines = [HEADER, row(f"measured eta={source.staleness} gen={source.generators}", **source.measured)]
    lines += [row(f"predicted eta={s} gen={g}", p.samples_per_s, p.lags, p.gated_frac)
              for (s, g), p in predictions.items()]
    eta, count = recommend(predictions)
    best = max(p.samples_per_s for p in predictions.values())
    lines += [textwrap.fill(model_notes(source), 110),
              textwrap.fill(f"recommend staleness.max={eta} generator.replicas={count}: the smallest staleness within "
                            f"{WITHIN:.0%} of the best predicted samples/s ({best:.1f}), then the fewest generators "
                            f"within {WITHIN:.0%} of that staleness's best.", 110, subsequent_indent="  ")]
    return "\n".join(lines)
