"""What-if for the staleness limit and the generator count: a discrete-event simulation driven by a traced run.

    nanoverl-async simulate RUN_DIR --staleness 0,1,2,4,8 --generators 1,2,4 [--cores C] [--seed N]

RUN_DIR is a run launched with run.trace=true. For each setting the simulation replays the pipeline of
docs/design.md "Processes and data flow" with the project's own rules on a simulated clock: `AdmissionGate`
(buffer/gate.py), `ReplayBuffer.take` (buffer/replay.py: the consumption check, stale groups dropped and
re-issued) and `GatedClock` (buffer/generator_time.py: generators/gated_frac). It prints the predicted samples/s,
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
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from nanoverl_async.buffer.gate import AdmissionGate
from nanoverl_async.buffer.replay import ReplayBuffer
from nanoverl_async.buffer.generator_time import GatedClock
from nanoverl_async.config import ConfigError
from nanoverl_async.simulator.run_costs import COMPUTE, STEP_COSTS, Source, read_source, speeds
from nanoverl_async.wire.trajectory import Trajectory

STEP_POOL = 5  # a simulated step after the first draws its costs among the run's this many nearest steps
REPEATS = 40  # simulated runs per setting, each of the run's length on its own bootstrap replicate of its costs
INTERVAL = (10, 90)  # an interval spans these percentiles of the simulated runs: 80% of them
WITHIN = 0.05  # a larger staleness "buys nothing" unless its samples/s may be >= 5% above the chosen one's
NOISY = 0.15  # the learner's step-to-step noise (run_costs.py `learner_steps`) above which another job shared
#               the machine (alone, the same work takes the same time within a few %): then it cannot tell
CROWDED = 0.7  # interference (run_costs.py `fit_interference`) under which another job took cores: alone on a
#               machine, roles that fit its cores barely slow each other (each runs learner/generator.torch_threads)
# A run's samples/s differs from the next one's of the same config on the same machine (the host's other load,
# its caches, its clock): sd of log samples/s, pooled over same-setting pairs of A B B A reruns of the default
# job (docs/benchmarks.md "The simulator against A B B A reruns, CPU"). Each simulated run draws such a factor,
# so an interval says where another run would land, not only where this run's costs, resampled, put it.
RUN_TO_RUN = 0.08
WIDE = 0.15  # an interval wider than +-15% of its median, or a miss of the run's own samples/s by more: cannot tell
GENERATING = 0  # the virtual clock of generators' groups
LEARNING = 1  # the virtual clock of the learner's compute
REAL = 2  # the real clock: timers
HEADER = (f"{'setting':<26}{'samples/s':>10}{'80% of runs':>13}{'mean':>6}{'max':>5}{'gated':>7}"
          "  staleness: lag:% of samples")


@dataclass
class Prediction:
    samples_per_s: np.ndarray  # one per simulated run, on the run's resampled costs
    lags: Counter  # lag -> trajectories trained at that lag, over the runs
    gated_frac: float
    machine: np.ndarray | float = 1.0  # per simulated run: its machine's speed that run (lognormal, sd RUN_TO_RUN)

    def spread(self, run_to_run: bool = True) -> tuple[float, float, float]:
        """(median, low, high) of samples/s over the simulated runs, low and high the INTERVAL percentiles; with
        `run_to_run`, each run at its machine's speed (else only the run's own costs, resampled, vary)."""
        values = self.samples_per_s * self.machine if run_to_run else self.samples_per_s
        return tuple(float(v) for v in np.percentile(values, [50, *INTERVAL]))


def nearest(keys: np.ndarray, center: int, minimum: int) -> np.ndarray:
    """Indices of the keys closest to `center`, whole keys at a time, until at least `minimum` (or all): those
    within the `minimum`-th smallest distance."""
    distance = np.abs(keys - center)
    return np.flatnonzero(distance <= np.sort(distance)[min(minimum, len(keys)) - 1])


def near_step(step: int, steps: int, rng: np.random.Generator) -> int:
    """Which of the run's `steps` steps simulated step `step` takes its costs from: step 0 is itself (a warm-up:
    allocations, first calls), a later one one of the STEP_POOL steps after the first nearest it (costs trend as
    episodes lengthen)."""
    return int(rng.choice(nearest(np.arange(1, steps), step, STEP_POOL) + 1)) if step and steps > 1 else 0


def group_record(lease) -> Trajectory:
    """What a simulated group files in the replay buffer: one trajectory with one token of the lease's version."""
    one = np.ones(1)
    return Trajectory(id=str(lease.group_id), group_id=lease.group_id, prompt_index=lease.prompt_index,
                      sample_index=0, token_ids=one.astype(np.int32), loss_mask=one.astype(np.uint8),
                      behaviour_logprobs=one * 0, versions=np.array([lease.version]), reward=0.0)


class Simulation:
    """One simulated run at one setting. All computing generators run at one speed and the learner at its own
    (run_costs.py `speeds`), so a job ends when its kind's virtual clock, which runs at that kind's speed,
    reaches its start plus its work. Timers (weights in transit, the learner's other phases) run on the real
    clock."""

    def __init__(self, source: Source, staleness: int, generators: int, rng: np.random.Generator):
        self.source = source
        self.staleness = staleness
        self.generators = generators
        self.rng = rng
        self.gate = AdmissionGate(source.batch, staleness, math.inf, lambda index: {})
        self.replay = ReplayBuffer(1)  # one record per group: the G episodes of a group share its version here
        self.gated = GatedClock(0.0)
        self.now, self.virtual = 0.0, [0.0, 0.0]  # the real clock; GENERATING's and LEARNING's virtual clocks
        self.heaps: list = [[], [], []]  # per clock, a heap of (its time at the end, seq, handler, args)
        self.seq = 0
        self.version, self.pending = [0] * generators, [None] * generators  # pending: drain mode's next version
        self.in_flight, self.asking = [0] * generators, [False] * generators  # asking: a request is on its way
        self.step, self.phase = 0, -1  # phase: an index into STEP_COSTS; -1 while waiting for a batch
        self.costs, self.delays = source.step_costs[0], source.weight_delays[0]
        self.step_start = 0.0
        self.step_seconds = []
        self.gated_fracs = []
        self.lags = Counter()
        self.pools: dict = {}  # version -> indices of the run's leases a group of that version draws from
        self.starts = [source.starts[g % len(source.starts)] for g in range(generators)]  # first requests

    def run(self, steps: int) -> Prediction:
        for g, start in enumerate(self.starts):
            self.at(REAL, start, self.request, g)
        while self.step < steps:
            self.advance()
        return Prediction(np.array([self.source.batch * self.source.group * steps / sum(self.step_seconds)]),
                          self.lags, float(np.mean(self.gated_fracs)))

    def advance(self) -> None:
        """Move the clocks to the next event and handle it."""
        learning = self.phase >= 0 and STEP_COSTS[self.phase] in COMPUTE
        rates = [float(r) for r in speeds(sum(n > 0 for n in self.in_flight), learning, self.source.cores,
                                           self.source.interference)]
        ends = [self.now + (jobs[0][0] - virtual) / rate if jobs else math.inf
                for jobs, virtual, rate in zip(self.heaps, self.virtual, rates)]  # the two virtual clocks
        ends.append(self.heaps[REAL][0][0] if self.heaps[REAL] else math.inf)
        first = int(np.argmin(ends))
        assert ends[first] < math.inf, f"simulation stalled at step {self.step}"
        self.virtual = [virtual + (ends[first] - self.now) * rate for virtual, rate in zip(self.virtual, rates)]
        self.now, (at, _, handler, args) = ends[first], heapq.heappop(self.heaps[first])
        if first != REAL:
            self.virtual[first] = at  # exact, whatever the rounding of the line above
        handler(*args)

    def at(self, clock: int, delay: float, handler, *args) -> None:
        """Call handler(*args) once `clock` has advanced by `delay` (work at speed 1, or seconds on REAL)."""
        self.seq += 1  # ties resolve in scheduling order, never by comparing handlers
        when = (self.now if clock == REAL else self.virtual[clock]) + delay
        heapq.heappush(self.heaps[clock], (when, self.seq, handler, args))

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
                self.at(REAL, self.rng.choice(self.source.request_lags), self.ask, g)
            return
        self.gated.observe(g, refused=not leases, now=self.now)
        for lease in leases:
            self.replay.open(lease.group_id, lease.prompt_index, lease.version)
            self.in_flight[g] += 1
            if lease.version not in self.pools:
                self.pools[lease.version] = nearest(self.source.lease_versions, lease.version, self.source.batch)
            work = self.source.lease_work[self.rng.choice(self.pools[lease.version])]
            self.at(GENERATING, work, self.group_done, g, lease)

    def group_done(self, g: int, lease) -> None:
        self.in_flight[g] -= 1
        if self.rng.random() < self.source.filtered_frac:  # the group filter: slot back, prompt done
            self.replay.close(lease.group_id)
            self.gate.release(lease.group_id, reissue=False)
        else:
            self.replay.add(group_record(lease))
            self.gate.complete(lease.group_id)
            self.take()
        drained = self.pending[g] is not None and not self.in_flight[g]
        if drained:  # apply the weights, and ask at once
            self.version[g], self.pending[g] = self.pending[g], None
        self.request(g, slot_freed=not drained)

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
        if self.in_flight[g] and self.source.swap_work:  # its running rows are computed again: each group is later
            self.heaps[GENERATING] = [(end + self.source.swap_work if args[0] == g else end, seq, handler, args)
                                      for end, seq, handler, args in self.heaps[GENERATING]]
            heapq.heapify(self.heaps[GENERATING])
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
            chosen = near_step(self.step, self.source.steps, self.rng)
            self.costs, self.delays = self.source.step_costs[chosen], self.source.weight_delays[chosen]
            self.start_phase(0)

    def start_phase(self, phase: int) -> None:
        self.phase = phase
        self.at(LEARNING if STEP_COSTS[phase] in COMPUTE else REAL, self.costs[phase], self.phase_done)

    def phase_done(self) -> None:
        if STEP_COSTS[self.phase] == "publish":  # the step's time ends here, as time/step_s does
            self.step_seconds.append(self.now - self.step_start)
            self.step += 1
            for g in range(self.generators):
                self.at(REAL, self.rng.choice(self.delays), self.weights, g, self.step)
        if self.phase + 1 < len(STEP_COSTS):
            self.start_phase(self.phase + 1)
        else:
            self.phase, self.step_start = -1, self.now
            self.take()


def resample(source: Source, rng: np.random.Generator) -> Source:
    """A bootstrap replicate of the run (Efron 1979): its completed leases drawn with replacement, each with
    its version and work, and each step replaced by its `near_step`, with its costs and weight delays."""
    leases = rng.integers(len(source.lease_work), size=len(source.lease_work))
    steps = [near_step(step, source.steps, rng) for step in range(source.steps)]
    return replace(source, lease_versions=source.lease_versions[leases], lease_work=source.lease_work[leases],
                   step_costs=source.step_costs[steps], weight_delays=[source.weight_delays[i] for i in steps])


def predict(source: Source, staleness: int, generators: int, seed: int = 0) -> Prediction:
    """REPEATS simulated runs of the run's length at one setting, run r on bootstrap replicate r (the same for
    every setting, so settings compare run by run); the same seed, the same numbers."""
    runs = [Simulation(resample(source, np.random.default_rng([seed, r])), staleness, generators,
                       np.random.default_rng([seed, r, staleness, generators])).run(source.steps)
            for r in range(REPEATS)]
    samples_per_s = np.concatenate([r.samples_per_s for r in runs])
    machine = np.exp(np.random.default_rng([seed, staleness, generators, 1]).normal(0, RUN_TO_RUN, len(samples_per_s)))
    return Prediction(samples_per_s, sum((r.lags for r in runs), Counter()),
                      float(np.mean([r.gated_frac for r in runs])), machine)


def parse_list(text: str, flag: str, least: int) -> list[int]:
    """'0,1,2' -> [0, 1, 2], each >= least; a ConfigError naming the flag otherwise."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers >= {least}, e.g. {flag} 0,1,2")
    return sorted(set(values))


def ratio(a: Prediction, b: Prediction) -> tuple[float, float, float]:
    """(median, low, high) of a's samples/s over b's, simulated run by simulated run (the same replicate of the
    run's costs, each setting's run on a machine speed of its own)."""
    return Prediction(a.samples_per_s * a.machine / (b.samples_per_s * b.machine), Counter(), 0.0).spread()


def cannot_tell(source: Source, predictions: dict) -> str | None:
    """Why the predictions cannot choose, or None. Another job shared the machine: the learner's same work took
    different times (NOISY), or the roles slowed each other more than the cores they fit on explain (CROWDED);
    neither role was seen computing alone (so its speed alone is unknown); an interval is too wide (then the
    steps a run would need, an interval narrowing with the square root of the steps); or the simulation misses
    the run's own samples/s."""
    # what more steps would narrow: the spread of the run's own costs (a machine's run-to-run speed stays)
    width = max((high - low) / 2 / median for median, low, high in (p.spread(False) for p in predictions.values()))
    own, measured = predictions[(source.staleness, source.generators)].spread()[0], source.measured["samples_per_s"]
    needed, slowest = math.ceil(source.steps * (width / WIDE) ** 2), min(source.interference)
    reasons = [  # (whether it holds, why it cannot tell), in order
        ((source.noise or 0) > NOISY, f"the learner's same work took +-{source.noise or 0:.0%} different times from "
         f"step to step (alone on a machine: under {NOISY:.0%}): another job shared the machine"),
        (source.slowdowns == (None, None), "the run never had generation or the learner computing alone: their "
         "speed alone is unknown"),
        (slowest < CROWDED, f"the roles slowed each other to {slowest:.2f}x (under {CROWDED}x) beyond what sharing "
         f"{source.cores:g} cores explains: another job took cores"),
        (width > WIDE, f"{source.steps} steps leave an 80% interval of +-{width:.0%} (over {WIDE:.0%}); trace a run "
         f"of >= {needed} steps (run.total_steps={needed})"),
        (abs(own / measured - 1) > WIDE, f"the simulation misses this run's own samples/s by "
         f"{own / measured - 1:+.0%} ({own:.1f} vs {measured:.1f}, over {WIDE:.0%})")]
    return next((f"cannot tell: {why}" for holds, why in reasons if holds), None)


def decide(source: Source, predictions: dict) -> str:
    """The one-line answer: the smallest staleness, then the fewest generators, whose samples/s may be within
    WITHIN of the best's (the upper end of its ratio to the best >= 1 - WITHIN; less staleness is safer for
    learning), against the smallest staleness at its generator count and what the next larger one buys."""
    reason = cannot_tell(source, predictions)
    if reason:
        return reason
    best = max(predictions, key=lambda s: predictions[s].spread()[0])
    chosen = min(s for s, p in predictions.items() if ratio(p, predictions[best])[2] >= 1 - WITHIN)
    etas = sorted(eta for eta, g in predictions if g == chosen[1])
    answer = f"staleness.max={chosen[0]} generator.replicas={chosen[1]}"
    if etas[0] < chosen[0]:
        median, low, high = ratio(predictions[chosen], predictions[(etas[0], chosen[1])])
        answer += f": {median:.2f}x eta {etas[0]}'s samples/s (80% of runs {low:.2f}-{high:.2f}x)"
    larger = [eta for eta in etas if eta > chosen[0]]
    if larger:
        median, low, high = ratio(predictions[(larger[0], chosen[1])], predictions[chosen])
        answer += f"; eta {larger[0]} buys nothing ({median:.2f}x, {low:.2f}-{high:.2f}x)"
    return answer


def row(label: str, samples_per_s: float, lags: Counter, gated_frac: float, within: str = "") -> str:
    """One line of the table under HEADER: samples/s, its interval, staleness mean and max, gated_frac, lags."""
    total = sum(lags.values()) or 1
    mean = sum(lag * n for lag, n in lags.items()) / total
    shares = " ".join(f"{lag}:{100 * n / total:.0f}" for lag, n in sorted(lags.items()))
    return (f"{label:<26}{samples_per_s:>10.1f}{within:>13}{mean:>6.2f}{max(lags, default=0):>5}{gated_frac:>7.2f}"
            f"  {shares}")


def model_notes(source: Source) -> str:
    """What the predictions assume, in the words the table is printed with."""
    def slowed(role: str, other: str, value: Optional[float], simulated: float) -> str:
        return (f"{role} beside {other} ran at {value:.2f}x its speed alone" if value is not None else
                f"{role} never ran alone in this run, so it is taken to slow beside {other} as {other} slows beside "
                f"it") + f" (simulated as {simulated:.2f}x)"
    noise = "could not be measured" if source.noise is None else f"was +-{source.noise:.0%}"
    return (f"Model: {slowed('generation', 'the learner', source.slowdowns[0], source.interference[0])}; "
            f"{slowed('the learner', 'generation', source.slowdowns[1], source.interference[1])}. A weight swap added "
            f"{source.swap_work:.3f} s to each group in flight on its generator. The learner's step-to-step noise "
            f"{noise} (alone on a machine: under {NOISY:.0%}). A run's speed varies from run to run by "
            f"+-{RUN_TO_RUN:.1%} (sd), drawn for each simulated run. "
            f"Each setting: {REPEATS} simulated runs of {source.steps} steps, each on a bootstrap replicate of this "
            f"run's leases and steps; intervals hold {INTERVAL[1] - INTERVAL[0]}% of them. Every setting trains the "
            f"same samples per step: the same reward at a step only if staleness does not slow learning (compare "
            f"reward/mean vs step: `nanoverl-async plot`). Other generator counts share {source.cores:g} cores "
            f"(--cores) equally, each generator batching up to {source.max_groups} groups as here.")


def report(run_dir: str, staleness: str, generators: str | None = None, cores: float | None = None,
           seed: int = 0, progress: bool = False) -> str:
    """The one-line answer, then its evidence: the table and the model's assumptions; with `progress`, a line on
    stderr as each setting's simulation starts."""
    etas = parse_list(staleness, "--staleness", 0)
    counts = parse_list(generators, "--generators", 1) if generators is not None else []
    if cores is not None and not cores > 0:
        raise ConfigError(f"--cores {cores}: expected a number of cores > 0")
    source = read_source(run_dir, cores)
    settings = sorted({(s, g) for s in etas for g in counts or [source.generators]}
                      | {(source.staleness, source.generators)})  # the run's own: the model's self-check
    predictions = {}
    for number, (s, g) in enumerate(settings, start=1):  # seconds each on a large run: say what it is doing
        if progress:
            print(f"simulating staleness.max={s} generator.replicas={g} ({number} of {len(settings)})",
                  file=sys.stderr, flush=True)
        predictions[(s, g)] = predict(source, s, g, seed)
    lines = [decide(source, predictions), HEADER,
             row(f"measured eta={source.staleness} gen={source.generators}", **source.measured)]
    for (s, g), p in predictions.items():
        median, low, high = p.spread()
        lines.append(row(f"predicted eta={s} gen={g}", median, p.lags, p.gated_frac, f"{low:.1f}-{high:.1f}"))
    return "\n".join([*lines, textwrap.fill(model_notes(source), 110)])
