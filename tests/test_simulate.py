"""`nanoverl-async simulate`: the gate's rules in the simulation, the throughput of its limiting cases and its
reproducibility on hand-made traces (fast); bad input (one line, status 2); and the prediction of a short real
run's own setting (slow). Run alone: `python -m pytest tests/test_simulate.py -q`.
"""

import importlib.util
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from nanoverl_async.cli import main
from nanoverl_async.config import load_config, to_yaml
from nanoverl_async.observe.plot import read_rows
from nanoverl_async.simulator.run_costs import (MIN_CALLS, fit_interference, load_trace, measured, read_source,
                                                speeds, swap_cost, swaps_inside)
from nanoverl_async.simulator.simulate import (CROWDED, NOISY, RUN_TO_RUN, WIDE, WITHIN, Prediction, cannot_tell,
                                               decide, model_notes, parse_list, predict, ratio, report, resample)

PREPARE_S, PUBLISH_S, HANDOVER_S, WEIGHTS_S = 0.001, 0.01, 0.001, 0.002


def span(name, pid, tid, start, end, **args):
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": round(start * 1e6),
            "dur": round((end - start) * 1e6), "args": args}


def trace_events(steps, lease_s, update_s, batch, group):
    """A synchronous run as the launcher traces it: per step the learner waits while B groups of generator 0
    take lease_s, then trains and publishes, while the gate refuses the generator until the new weights
    arrive. The simulation only draws costs from it, so it serves every staleness limit."""
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
              for pid, name in ((1, "learners"), (2, "buffer"), (3, "generator 0"))]
    t, group_id = 0.0, 0
    for version in range(steps):  # step version + 1 trains groups of `version`, publishes version + 1
        step = version + 1
        if version:
            events.append(span("gate closed", 2, 9, previous, t, generator_id=0, version=version - 1))
        for lane in range(batch):
            events.append(span("lease", 2, 10 + lane, t, t + lease_s, group_id=group_id, prompt_index=group_id,
                               generator_id=0, version=version, outcome="completed"))
            for sample in range(group):
                tid = 100 + lane * group + sample
                events.append(span("episode", 3, tid, t, t + lease_s, group_id=group_id, sample_index=sample,
                                   generated_tokens=4, turns=1, trained_step=step))
                events.append(span("generate", 3, tid, t, t + lease_s))
            group_id += 1
        marks = [t, t + lease_s + HANDOVER_S]
        for seconds in (PREPARE_S, update_s[version] if isinstance(update_s, list) else update_s, PUBLISH_S):
            marks.append(marks[-1] + seconds)
        for name, a, b in zip(("wait batch", "prepare", "update", "publish"), marks, marks[1:]):
            events.append(span(name, 1, 1, a, b, step=step, **({"version": step} if name == "publish" else {})))
        events.append(span(f"weights v{step}", 3, 2, marks[-1], marks[-1] + WEIGHTS_S, version=step))
        previous, t = t + lease_s, marks[-1] + WEIGHTS_S
    return events


def write_run(path, *, steps=12, lease_s=0.2, update_s=0.5, staleness=1, batch=2, group=2, events=None,
              overrides=()):
    """A run directory as a traced launch leaves it: config.yaml, metrics.jsonl, trace.json."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"staleness.max={staleness}", f"data.prompts_per_step={batch}",
                             f"data.samples_per_prompt={group}", f"generator.max_groups_in_flight={batch}",
                             f"run.total_steps={steps}", *overrides])
    (path / "config.yaml").write_text(to_yaml(cfg))
    step_s = lease_s + HANDOVER_S + PREPARE_S + update_s + PUBLISH_S  # the wait began as the weights arrived
    rows = [{"step": s, "time/step_s": step_s, "staleness/histogram": {"0": batch * group},
             "generators/gated_frac": 0.5, "episodes/length_mean": 10.0} for s in range(1, steps + 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    events = trace_events(steps, lease_s, update_s, batch, group) if events is None else events
    (path / "trace.json").write_text(json.dumps(events))
    return path


def source(tmp_path, **run):
    return read_source(str(write_run(tmp_path / "run", **run)), cores=8)  # cores to spare: no sharing


def test_eta0_trains_only_fresh_groups_and_staleness_never_exceeds_eta(tmp_path):
    fast = source(tmp_path, lease_s=0.05, update_s=0.5)  # generation far ahead of the learner
    assert set(predict(fast, 0, 1).lags) == {0}
    for eta in (1, 2, 4):
        assert max(predict(fast, eta, 2).lags) == eta  # reached (generation runs ahead) and never passed


def test_drain_mode_keeps_the_bound(tmp_path):
    drained = source(tmp_path, lease_s=0.05, update_s=0.5, overrides=("weight_sync.mode=drain",))
    assert drained.drain and max(predict(drained, 2, 2).lags) <= 2


def test_gated_frac_rises_as_the_staleness_limit_falls(tmp_path):
    fast = source(tmp_path, lease_s=0.3, update_s=0.5)
    gated = [predict(fast, eta, 1).gated_frac for eta in (0, 1, 4)]
    assert gated[0] > gated[1] + 0.1 and gated[1] >= gated[2] - 0.02, gated


def test_learner_bound_throughput_is_a_batch_per_learner_step(tmp_path):
    fast = source(tmp_path, lease_s=0.01, update_s=1.0, staleness=4)
    step_s = HANDOVER_S + PREPARE_S + 1.0 + PUBLISH_S
    assert predict(fast, 4, 1).samples_per_s == pytest.approx(2 * 2 / step_s, rel=0.03)


def test_generation_bound_throughput_is_the_generation_rate(tmp_path):
    slow = source(tmp_path, lease_s=1.0, update_s=0.01, staleness=4)
    # one generator runs max_groups_in_flight = B = 2 groups of 1 s side by side: 2 groups of G = 2 a second
    assert predict(slow, 4, 1).samples_per_s == pytest.approx(2 * 2 / 1.0, rel=0.05)


def test_synchronous_steps_add_generation_and_training(tmp_path):
    sync = source(tmp_path, lease_s=0.3, update_s=0.5, staleness=0)
    step_s = WEIGHTS_S + 0.3 + HANDOVER_S + PREPARE_S + 0.5 + PUBLISH_S
    assert predict(sync, 0, 1).samples_per_s == pytest.approx(2 * 2 / step_s, rel=0.03)


def test_a_generator_that_leased_late_delays_the_first_steps_as_in_the_run(tmp_path):
    """The learner began waiting 0.25 s before the generator's first lease (a generator still loading its
    model): the source says so, and the simulated run, which starts the generator as late, takes 0.25 s longer."""
    events = trace_events(12, 0.3, 0.5, 2, 2)
    first_wait = next(e for e in events if e["name"] == "wait batch" and e["args"]["step"] == 1)
    first_wait["ts"], first_wait["dur"] = first_wait["ts"] - 250_000, first_wait["dur"] + 250_000
    late = read_source(str(write_run(tmp_path / "late", lease_s=0.3, update_s=0.5, staleness=0, events=events)),
                       cores=8)
    on_time = source(tmp_path, lease_s=0.3, update_s=0.5, staleness=0)
    assert late.starts.tolist() == pytest.approx([0.25]) and on_time.starts.tolist() == [0.0]
    samples = 12 * 2 * 2
    seconds = samples / predict(on_time, 0, 1).samples_per_s
    assert predict(late, 0, 1).samples_per_s == pytest.approx(samples / (seconds + 0.25), rel=1e-6)


def test_the_same_seed_gives_the_same_report(tmp_path):
    run = str(write_run(tmp_path / "run"))
    assert report(run, "0,2", "1,2", seed=3) == report(run, "0,2", "1,2", seed=3)
    lines = report(run, "0,2", seed=3).splitlines()
    assert lines[2].startswith("measured eta=1 gen=1") and [line.split()[1] for line in lines[3:6]] == [
        "eta=0", "eta=1", "eta=2"]  # the run's own setting joins the ones asked for: the model's self-check


def test_speeds_share_the_cores_and_reproduce_the_measured_slowdowns():
    interference = fit_interference((0.8, 0.6), generators=1, cores=2)
    assert interference == pytest.approx((0.8, 0.6))
    generator, learner = speeds(1, 1, 2, interference)  # side by side on 2 cores: only the interference
    assert (generator, learner) == pytest.approx((0.8, 0.6))
    generator, learner = speeds(3, 1, 2, interference)  # 4 processes on 2 cores: half a core each, and slowed
    assert (generator, learner) == pytest.approx((0.4, 0.3))
    assert speeds(1, 0, 2, interference) == pytest.approx((1.0, 1.0))  # alone: full speed
    assert fit_interference((None, 0.6), generators=1, cores=2) == pytest.approx((0.6, 0.6))  # the other's
    assert fit_interference((None, None), generators=1, cores=2) == (1.0, 1.0)


def quiet(tmp_path, staleness, measured, **fields):
    """The synthetic run as a quiet machine's: steady steps, both roles' speeds measured, barely slowed."""
    settled = {"noise": 0.0, "slowdowns": (0.9, 0.9), "interference": (0.9, 0.9), **fields}
    return replace(source(tmp_path), staleness=staleness, generators=1, measured={"samples_per_s": measured},
                   **settled)


def spread_of(median, half_width):
    """A prediction whose simulated runs' 10th, 50th and 90th percentiles are median -+ half_width."""
    return Prediction(np.linspace(median - 1.25 * half_width, median + 1.25 * half_width, 41), Counter(), 0.0)


def test_the_answer_is_the_smallest_staleness_that_may_be_within_5_percent_of_the_best(tmp_path):
    """Paired runs: eta 2's 90th-percentile ratio to the best (eta 8, 104) is (x + 1) / 105, >= 1 - WITHIN from
    x = 98.75 on."""
    def answer(eta2):
        rates = {(0, 1): 60.0, (2, 1): eta2, (4, 1): 102.0, (8, 1): 104.0}
        return decide(quiet(tmp_path, 2, eta2), {k: spread_of(v, 1.0) for k, v in rates.items()})
    assert (1 - WITHIN) * 105 - 1 == pytest.approx(98.75)
    chosen = answer(98.76)
    assert chosen.startswith("staleness.max=2 generator.replicas=1: 1.65x eta 0's samples/s (80% of runs"), chosen
    assert chosen.endswith("eta 4 buys nothing (1.03x, 1.03-1.03x)"), chosen
    assert answer(98.74).startswith("staleness.max=4 generator.replicas=1: ")


@pytest.mark.parametrize("noise, cannot", [(NOISY, False), (NOISY + 0.001, True)])
def test_another_job_on_the_machine_makes_it_say_it_cannot_tell(tmp_path, noise, cannot):
    answer = decide(quiet(tmp_path, 0, 50.0, noise=noise), {(0, 1): spread_of(50.0, 1.0), (2, 1): spread_of(80.0, 1.0)})
    assert answer.startswith("cannot tell: the learner's same work") == cannot, answer


@pytest.mark.parametrize("slowdowns, interference, says", [
    ((0.9, None), (CROWDED, CROWDED), None),
    ((None, None), (1.0, 1.0), "the run never had generation or the learner computing alone"),
    ((0.69, None), (CROWDED - 0.001, CROWDED - 0.001), "the roles slowed each other to 0.70x (under 0.7x)")])
def test_roles_never_seen_alone_or_crowded_by_another_job_cannot_tell(tmp_path, slowdowns, interference, says):
    run = quiet(tmp_path, 0, 50.0, slowdowns=slowdowns, interference=interference)
    answer = decide(run, {(0, 1): spread_of(50.0, 1.0), (2, 1): spread_of(80.0, 1.0)})
    assert answer.startswith(f"cannot tell: {says}" if says else "staleness.max=2 "), answer


@pytest.mark.parametrize("half_width, cannot", [(WIDE * 50.0 - 0.01, False), (WIDE * 50.0 + 0.01, True)])
def test_a_wide_interval_says_how_many_steps_would_narrow_it(tmp_path, half_width, cannot):
    answer = decide(quiet(tmp_path, 0, 50.0), {(0, 1): spread_of(50.0, half_width), (2, 1): spread_of(80.0, 1.0)})
    assert answer.startswith("cannot tell: 12 steps leave an 80% interval of +-15%") == cannot, answer
    if cannot:
        assert "run.total_steps=13" in answer  # 12 x (15.02% / 15%)^2, rounded up


@pytest.mark.parametrize("own, cannot", [(50.0 * (1 + WIDE) - 0.01, False), (50.0 * (1 + WIDE) + 0.01, True)])
def test_missing_the_runs_own_samples_per_s_says_it_cannot_tell(tmp_path, own, cannot):
    answer = decide(quiet(tmp_path, 0, 50.0), {(0, 1): spread_of(own, 1.0), (2, 1): spread_of(80.0, 1.0)})
    assert answer.startswith("cannot tell: the simulation misses this run's own samples/s") == cannot, answer


def test_a_bootstrap_replicate_keeps_step_0_and_draws_each_step_among_its_nearest(tmp_path):
    run = source(tmp_path, steps=12)
    run = replace(run, step_costs=np.arange(12.0)[:, None].repeat(5, 1), lease_work=np.arange(len(run.lease_work)))
    replicate = resample(run, np.random.default_rng(0))
    drawn = replicate.step_costs[:, 0]
    # the 5 nearest of steps 1..11: 2 either side inside, up to 4 on one side at the ends
    reach = [4, 3, 2, 2, 2, 2, 2, 2, 2, 3, 4]
    assert drawn[0] == 0 and all(abs(d - s) <= r for s, d, r in zip(range(1, 12), drawn[1:], reach)), drawn
    assert set(replicate.lease_work) < set(run.lease_work) and len(replicate.lease_work) == len(run.lease_work)
    assert (resample(run, np.random.default_rng(0)).step_costs == replicate.step_costs).all()  # seeded


def test_the_learner_noise_is_the_spread_of_its_seconds_per_token(tmp_path):
    events = trace_events(12, 0.2, [0.5, *[0.5, 0.75] * 5, 0.5], 2, 2)  # 5 of the 11 steps after the first longer
    steady = read_source(str(write_run(tmp_path / "steady")), cores=8)
    jittered = read_source(str(write_run(tmp_path / "jitter", events=events)), cores=8)
    assert steady.noise == pytest.approx(0.0, abs=0.01)
    compute = PREPARE_S + 0.5 + PUBLISH_S  # the 75th percentile is a longer step, the 25th a usual one
    assert jittered.noise == pytest.approx(np.log((compute + 0.25) / compute) / 1.349, rel=0.01)
    assert jittered.slowdowns[1] is None  # the generator never computed beside it: no slowdown to fit


def test_a_run_written_before_steps_counted_from_1_reads_as_the_same_run(tmp_path):
    """Before 2026-11-29 metrics.jsonl and trace.json counted steps from 0, and a publish span named no version
    (metrics.current_rows, run_costs.read_events): the same run in either numbering is the same source."""
    events = trace_events(12, 0.2, [0.5, *[0.5, 0.75] * 5, 0.5], 2, 2)

    def as_before(event: dict) -> dict:
        args = dict(event.get("args", {}))
        if event["name"] in ("wait batch", "prepare", "update", "publish"):
            args["step"] -= 1
            args.pop("version", None)
        if event["name"] == "episode":
            args["trained_step"] -= 1
        return {**event, "args": args} if event.get("ph") == "X" else event

    runs = {"now": write_run(tmp_path / "now", events=events),
            "older": write_run(tmp_path / "older", events=[as_before(e) for e in events])}
    for name, shift in (("now", 0), ("older", 1)):  # episode lengths that differ by step: the rows must line up
        rows = [json.loads(line) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        (runs[name] / "metrics.jsonl").write_text("".join(
            json.dumps({**row, "step": row["step"] - shift, "episodes/length_mean": 10.0 + row["step"] % 3}) + "\n"
            for row in rows))
    now, older = (read_source(str(runs[name]), cores=8) for name in ("now", "older"))
    assert now.step_costs.tolist() == older.step_costs.tolist() and now.weight_delays == older.weight_delays
    assert now.noise == older.noise and now.slowdowns == older.slowdowns and now.noise > 0.01


def calls_with_swaps(clean: int, hit: int, extra_s: float) -> tuple[np.ndarray, dict]:
    """One-call episodes of one generator (pid 7), 10 tokens at 0.01 s each; the last `hit` of them each had one
    weight swap land inside, which cost it `extra_s` more."""
    rows, swaps = [], []
    for i in range(clean + hit):
        seconds = 0.1 + (extra_s if i >= clean else 0.0)
        rows.append((10.0 * i, 10.0 * i + seconds, 10, 7))
        if i >= clean:
            swaps.append(10.0 * i + seconds / 2)
    return np.array(rows), {7: np.array(swaps)}


@pytest.mark.parametrize("hit", [MIN_CALLS - 1, MIN_CALLS])
def test_a_swap_costs_what_the_calls_it_landed_in_took_beyond_their_tokens(hit):
    calls, swaps = calls_with_swaps(clean=MIN_CALLS, hit=hit, extra_s=0.05)
    assert swap_cost(calls, swaps_inside(calls, swaps)) == (pytest.approx(0.05) if hit >= MIN_CALLS else 0.0)
    calls, swaps = calls_with_swaps(clean=MIN_CALLS, hit=MIN_CALLS, extra_s=-0.01)
    assert swap_cost(calls, swaps_inside(calls, swaps)) == 0.0  # none slower


def test_a_swap_delays_the_groups_in_flight_so_async_loses_what_sync_does_not(tmp_path):
    """At eta 0 weights land while no group is in flight: a swap's cost cannot matter; at eta 2, where generation
    bounds the run and a group is always in flight, it does."""
    run = source(tmp_path, lease_s=0.5, update_s=0.1)
    costly = replace(run, swap_work=0.3)
    assert predict(costly, 0, 1).samples_per_s == pytest.approx(predict(run, 0, 1).samples_per_s)
    assert predict(costly, 2, 1).samples_per_s.mean() < 0.95 * predict(run, 2, 1).samples_per_s.mean()


def test_a_compact_copy_reads_as_the_run(tmp_path):
    """bench/simulator_check.py --keep records tests/data/recorded_runs/ as these copies."""
    spec = importlib.util.spec_from_file_location("simulator_check", Path(__file__).parents[1] / "bench" / "simulator_check.py")
    simulator_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(simulator_check)
    run = write_run(tmp_path / "run")
    kept = simulator_check.compact(str(run), str(tmp_path / "kept"))
    assert sorted(p.name for p in kept.iterdir()) == ["config.yaml", "metrics.jsonl", "trace.json.gz"]
    assert report(str(kept), "0,2", seed=1) == report(str(run), "0,2", seed=1)


def test_a_crashed_runs_trace_without_its_closing_bracket_reads(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text('[\n{"name":"x","ph":"X","pid":1,"tid":1,"ts":0,"dur":1,"args":{}},\n')
    assert load_trace(path)[0]["name"] == "x"


@pytest.mark.parametrize("case, flags, message", [
    ("no trace", [], "trace.json: no such file"),
    ("no episodes", [], "no episode events"),
    ("fine", ["--staleness", "0,x"], "--staleness '0,x': expected comma-separated integers >= 0"),
    ("fine", ["--staleness", "-1"], "--staleness '-1'"),
    ("fine", ["--generators", "0"], "--generators '0': expected comma-separated integers >= 1"),
    ("fine", ["--cores", "0"], "--cores 0.0: expected a number of cores > 0"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, case, flags, message):
    run = write_run(tmp_path / "run")
    if case == "no trace":
        (run / "trace.json").unlink()
    elif case == "no episodes":
        events = [e for e in trace_events(3, 0.2, 0.5, 2, 2) if e["name"] not in ("episode", "generate")]
        write_run(run, events=events)
    assert main(["simulate", str(run), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_missing_run_directory_is_one_line(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "nowhere")]) == 2
    assert "config.yaml" in capsys.readouterr().err


def test_lists_parse_sorted_and_unique():
    assert parse_list("4,0,2,2", "--staleness", 0) == [0, 2, 4]


RECORDED = Path(__file__).parent / "data" / "recorded_runs"  # bench/simulator_check.py --keep writes each set
BAR = {"quiet": 0.15, "loaded": 0.25}  # issue 34: how close to the measured runs each machine's set must land


@pytest.mark.parametrize("recorded", sorted(p for p in RECORDED.iterdir() if p.is_dir()), ids=lambda p: p.name)
def test_recorded_runs_predict_the_other_etas_or_say_they_cannot_tell(recorded):
    """A set: the default job at eta 0, 2 and 4 on one machine, the traced eta 2 run predicting the others. A quiet
    machine's set must land within 15% of each measured run; a loaded machine's within 25%, or say it cannot tell."""
    machine = json.loads((recorded / "machine.json").read_text())
    traced, others = recorded / machine["traced"], sorted(p for p in recorded.iterdir() if p.is_dir())
    truth = {}
    for run in others:
        cfg = load_config(str(run / "config.yaml"))
        rows = read_rows(run / "metrics.jsonl")
        truth[cfg.staleness.max] = measured(rows, cfg.data.episodes_per_step)
    lines = report(str(traced), ",".join(map(str, truth))).splitlines()
    if machine["machine"] == "loaded" and lines[0].startswith("cannot tell: "):
        return
    assert not lines[0].startswith("cannot tell"), lines[0]
    for eta, run in truth.items():
        predicted = float(next(line for line in lines if line.startswith(f"predicted eta={eta} ")).split()[3])
        assert predicted == pytest.approx(run["samples_per_s"], rel=BAR[machine["machine"]]), (eta, lines)


def test_it_says_what_it_simulates_and_its_assumptions_in_plain_sentences(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    text = report(str(run), "0,2", progress=True)
    assert capsys.readouterr().err == ("simulating staleness.max=0 generator.replicas=1 (1 of 3)\n"
                                       "simulating staleness.max=1 generator.replicas=1 (2 of 3)\n"
                                       "simulating staleness.max=2 generator.replicas=1 (3 of 3)\n")
    notes = " ".join(text.split())
    assert "not measured" not in notes and f"A run's speed varies from run to run by +-{RUN_TO_RUN:.1%} (sd)" in notes
    unseen = model_notes(replace(source(tmp_path), slowdowns=(None, 0.9)))
    assert unseen.startswith("Model: generation never ran alone in this run, so it is taken to slow beside the "
                             "learner as the learner slows beside it (simulated as ")


RECORDED_ABBA = Path(__file__).parent / "data" / "recorded_abba"  # bench/simulator_check.py --abba --keep


def abba_cases() -> list[tuple[Path, str]]:
    """(a compared eta's folder of A1 B1 B2 A2, the traced A that predicts) of every recorded A B B A set."""
    return [(folder, name) for folder in sorted(RECORDED_ABBA.glob("*/eta*")) for name in ("A1", "A2")]


def test_the_80_percent_interval_holds_a_b_b_a_reruns_in_4_of_5_cases_or_cannot_tell():
    """Each traced A run (eta 2) predicts eta X's samples/s over its own; the A B B A reruns measure that ratio
    ((B1 + B2) / (A1 + A2)). The interval holds a machine's run-to-run spread (RUN_TO_RUN), not only the run's
    own costs resampled: at least 80% of the cases fall inside, or the prediction says it cannot tell."""
    cases = abba_cases()
    assert len(cases) >= 5, "bench/simulator_check.py --abba --keep records them"
    held = []
    for folder, name in cases:
        rates = {}
        for run in ("A1", "B1", "B2", "A2"):
            cfg = load_config(str(folder / run / "config.yaml"))
            rates[run] = measured(read_rows(folder / run / "metrics.jsonl"),
                                  cfg.data.episodes_per_step)["samples_per_s"]
        truth = (rates["B1"] + rates["B2"]) / (rates["A1"] + rates["A2"])
        source, eta = read_source(str(folder / name)), load_config(str(folder / "B1" / "config.yaml")).staleness.max
        predictions = {(e, 1): predict(source, e, 1) for e in (source.staleness, eta)}
        _, low, high = ratio(predictions[(eta, 1)], predictions[(source.staleness, 1)])
        held.append(cannot_tell(source, predictions) is not None or low <= truth <= high)
    assert sum(held) >= 0.8 * len(held), held


@pytest.mark.slow
def test_a_real_run_predicts_its_own_setting(observed_run, capsys):
    """The self-prediction sanity check: the run's own setting (4 steps, 2 generators, staleness 1; conftest.py)
    predicted within 35% of the samples/s it measured, and its own staleness histogram's largest lag."""
    assert main(["simulate", str(observed_run), "--staleness", "0,1", "--generators", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    measured = next(line for line in lines if line.startswith("measured eta=1 gen=2")).split()
    predicted = next(line for line in lines if line.startswith("predicted eta=1 gen=2")).split()
    assert float(predicted[3]) == pytest.approx(float(measured[3]), rel=0.35), lines
    assert predicted[6] == measured[5]  # the largest lag: the staleness limit, reached
    assert lines[0].startswith(("staleness.max=", "cannot tell: ")), lines  # the answer comes first
