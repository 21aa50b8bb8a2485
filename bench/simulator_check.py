"""Does `nanoverl-async simulate` predict other staleness limits? Records the default job at eta 0, 2 and 4 (traced,
one after the other), predicts every eta from the eta 2 run and prints predicted vs measured samples/s.

    python bench/simulator_check.py                                   # 20 steps each, alone on the machine
    python bench/simulator_check.py --keep tests/data/recorded_runs/quiet --machine quiet
    python bench/simulator_check.py --runs /tmp/sim/loaded-r1 --keep tests/data/recorded_runs/loaded-1 --machine loaded
    python bench/simulator_check.py --abba 0,1,4 --keep tests/data/recorded_abba/quiet-1 --machine quiet

--abba X,Y: for each eta X, A B B A reruns (A: eta 2, B: eta X, all traced); each A predicts the ratio of eta X's
samples/s to eta 2's, its 80% interval against the ratio the four runs measured, and the same-setting pairs (A
against A, B against B) give the machine's run-to-run spread (simulate.RUN_TO_RUN is calibrated on it).

The issue's bar (issue 34): on a machine of its own the prediction lands within 15% of each measured run; on a
machine loaded by another job within 25%, or the answer says it cannot tell. --keep writes each run's compact
copy (`compact`: what simulate reads, ~100 kB) and machine.json (date, load average before and
after, cores, --machine) into the directory tests/test_simulate.py checks every recorded set of; --runs
reads runs already recorded (RUNS/eta<E>) instead of launching. Extra key=value arguments apply to every run.
Run it with the machine to itself: another job's load makes its measured runs disagree with each other.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import time
from pathlib import Path

from nanoverl_async.config import load_config
from nanoverl_async.launcher import launch
from nanoverl_async.observe.plot import read_rows
from nanoverl_async.simulator.run_costs import TRACE, load_trace, measured, trace_path
from nanoverl_async.simulator.run_costs import read_source
from nanoverl_async.simulator.simulate import cannot_tell, predict, ratio, report

# what `compact` keeps: the metrics keys run_costs.py and this script read, the trace args run_costs.read_events reads
READ_KEYS = {"step", "time/step_s", "staleness/histogram", "generators/gated_frac", "episodes/length_mean",
             "reward/mean"}
TRACE_ARGS = {"name", "step", "group_id", "generator_id", "version", "outcome", "generated_tokens", "trained_step"}
CONFIG = "configs/agent_grpo.yaml"
TRACED, ETAS = 2, (2, 0, 4)  # the run simulate reads; the order the runs are launched in


def record(out: Path, steps: int, overrides: list[str]) -> None:
    for eta in ETAS:
        launch(load_config(CONFIG, [*overrides, f"staleness.max={eta}", f"run.total_steps={steps}", "run.trace=true",
                                    f"run.output_dir={out / f'eta{eta}'}", "run.overwrite=true", "run.progress=false"]))


ABBA = ("A1", "B1", "B2", "A2")  # the order of an A B B A set's runs: A at eta TRACED, B at the eta compared


def record_abba(out: Path, etas: list[int], steps: int, overrides: list[str]) -> None:
    for eta in etas:
        for name in ABBA:
            launch(load_config(CONFIG, [*overrides, f"staleness.max={TRACED if name[0] == 'A' else eta}",
                                        f"run.total_steps={steps}", "run.trace=true", "run.overwrite=true",
                                        f"run.output_dir={out / f'eta{eta}' / name}", "run.progress=false"]))


def compare_abba(runs: Path) -> list[str]:
    """Per compared eta and traced A: the predicted ratio of eta X's samples/s to eta 2's (median, 80% interval,
    or why it cannot tell) against the A B B A ratio measured; then the run-to-run spread of same-setting pairs."""
    out, pairs = [f"{'eta':>4}{'from':>6}{'predicted':>11}{'80% of runs':>13}{'measured':>10}  inside"], []
    for folder in sorted(runs.glob("eta*"), key=lambda p: int(p.name[3:])):
        eta, rates = int(folder.name[3:]), {name: samples_per_s(folder / name) for name in ABBA}
        truth = (rates["B1"] + rates["B2"]) / (rates["A1"] + rates["A2"])
        pairs += [math.log(rates["A2"] / rates["A1"]), math.log(rates["B2"] / rates["B1"])]
        for name in ("A1", "A2"):
            source = read_source(str(folder / name))
            predictions = {(e, 1): predict(source, e, 1) for e in (TRACED, eta)}
            median, low, high = ratio(predictions[(eta, 1)], predictions[(TRACED, 1)])
            why = cannot_tell(source, predictions)
            out.append(f"{eta:>4}{name:>6}{median:>11.2f}{f'{low:.2f}-{high:.2f}':>13}{truth:>10.2f}  "
                       + (why if why else "yes" if low <= truth <= high else "no"))
    spread = math.sqrt(sum(p * p for p in pairs) / len(pairs) / 2)  # per run: a pair's log ratio holds two runs
    return [*out, f"run to run: sd of log samples/s {spread:.3f} from {len(pairs)} same-setting pairs "
                  f"(simulate.RUN_TO_RUN)"]


def samples_per_s(run: Path) -> float:
    cfg = load_config(str(run / "config.yaml"))
    return measured(read_rows(run / "metrics.jsonl"), cfg.data.episodes_per_step)[
        "samples_per_s"]


def compare(runs: Path) -> list[str]:
    """simulate's answer and table for the traced run, then predicted vs measured per eta."""
    lines = report(str(runs / f"eta{TRACED}"), ",".join(map(str, sorted(ETAS)))).splitlines()
    out = [*lines, "", f"{'eta':>4}{'measured':>10}{'predicted':>11}{'80% of runs':>13}{'error':>8}"]
    for eta in sorted(ETAS):
        predicted = next(line.split() for line in lines if line.startswith(f"predicted eta={eta} "))
        truth = samples_per_s(runs / f"eta{eta}")
        out.append(f"{eta:>4}{truth:>10.1f}{float(predicted[3]):>11.1f}{predicted[4]:>13}"
                   f"{float(predicted[3]) / truth - 1:>+8.0%}")
    return out


def compact(run_dir: str, into: str) -> Path:
    """Copy of RUN_DIR that run_costs.read_source reads as it reads RUN_DIR, a tenth of its size or less: config.yaml,
    metrics.jsonl's READ_KEYS, and trace.json.gz holding only the events and args `read_events` reads."""
    source, target = Path(run_dir), Path(into)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.yaml").write_text((source / "config.yaml").read_text())
    rows = [{k: v for k, v in row.items() if k in READ_KEYS} for row in read_rows(source / "metrics.jsonl")]
    (target / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if trace_path(source).is_file():
        kept = [{**e, "args": {k: v for k, v in e.get("args", {}).items() if k in TRACE_ARGS}}
                for e in load_trace(trace_path(source)) if e.get("name") == "process_name"
                or e.get("ph") == "X" and e["name"] != "tool"]
        (target / f"{TRACE}.gz").write_bytes(gzip.compress(json.dumps(kept, separators=(",", ":")).encode(), mtime=0))
    return target


def keep(runs: Path, into: Path, machine: str, load: tuple, abba: bool) -> None:
    """Compact copies of the runs and machine.json; load: /proc/loadavg before and after (None with --runs)."""
    kept = sorted(runs.glob("eta*/[AB]?")) if abba else [runs / f"eta{eta}" for eta in ETAS]
    for run in kept:
        compact(str(run), str(into / run.relative_to(runs)))
    (into / "machine.json").write_text(json.dumps(
        {"machine": machine, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
         "loadavg_before": load[0], "loadavg_after": load[1], "traced": f"eta{TRACED}"}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="run.total_steps of every run")
    parser.add_argument("--out", default="outputs/bench/simulator_check", help="where the runs are written")
    parser.add_argument("--runs", help="runs already recorded (RUNS/eta0, eta2, eta4): launch nothing")
    parser.add_argument("--keep", help="write the runs' compact copies and machine.json here")
    parser.add_argument("--machine", choices=("quiet", "loaded"), help="with --keep: the machine the runs had")
    parser.add_argument("--abba", help="A B B A reruns of eta 2 (A) against each of these etas (B), e.g. 0,4")
    args, overrides = parser.parse_known_args()
    if args.keep and not args.machine:
        parser.error("--keep needs --machine quiet|loaded")
    load = [Path("/proc/loadavg").read_text().strip()]
    runs = Path(args.runs or args.out)
    etas = [int(e) for e in args.abba.split(",")] if args.abba else []
    if not args.runs:
        record_abba(runs, etas, args.steps, overrides) if etas else record(runs, args.steps, overrides)
    load.append(Path("/proc/loadavg").read_text().strip())
    print("\n".join(compare_abba(runs) if etas else compare(runs)))
    if args.keep:
        keep(runs, Path(args.keep), args.machine, (None, None) if args.runs else load, bool(etas))


if __name__ == "__main__":
    main()
