"""Per-step metrics: `<output_dir>/metrics.jsonl`, a live console line, optionally wandb, and
(run.log_samples) some episodes per step in `<output_dir>/samples.jsonl`; at the end a summary of the run
from metrics.jsonl's rows (`run_summary`).

One JSON object per training step (one batch), flat keys `group/name` (e.g. `reward/mean`, `staleness/max`).
`step_metrics` turns what one step produced (the batch's stats, the learner's metrics, timings) into
that flat dict; it is pure so the keys can be tested without running anything. Steps count from 1, as on the
console and in checkpoint names: step N updates weights version N - 1 into version N (step_N holds them).
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nanoverl_async import checkpoint
from nanoverl_async.agents.rewards import MISSING_GROUND_TRUTH


# Stats the buffer computes once per batch at hand-out (buffer/service.py: batch_stats and its counters),
# logged under these names; every other numeric stat is logged as `buffer/<name>`.
BUFFER_STAT_KEYS = {
    "reward_mean": "reward/mean",
    "staleness_max": "staleness/max",  # lag = step - version, over trajectories that sampled a token
    "staleness_mean": "staleness/mean",
    "staleness_hist": "staleness/histogram",  # {lag: trajectories}
    "staleness_token_mean": "staleness/token_mean",  # the same, weighted by generated tokens
    "staleness_token_hist": "staleness/token_histogram",  # {lag: generated tokens}
    "dropped_stale": "staleness/dropped",  # groups dropped by the consumption check so far
    "turns_mean": "episodes/turns_mean",
    "tool_calls_mean": "episodes/tool_calls_mean",
    "tool_errors_mean": "episodes/tool_errors_mean",
    "generators_gated_frac": "generators/gated_frac",  # share of generator time the gate refused new groups
    "generators_busy_frac": "generators/busy_frac",  # share of generator time the engine computed
    "generators_tool_wait_frac": "generators/tool_wait_frac",  # ... episodes in flight, all waiting on tools
    "tokens_per_s": "tokens/generated_per_s",  # received over the latest windows between batches (TokenRate)
}


def engine_total(trajectories: list, key: str) -> int:
    """A generation counter the engine reported per request (engine.Completion), summed over the batch."""
    return sum(t.info.get("engine", {}).get(key, 0) for t in trajectories)


def step_metrics(step: int, staleness_limit: int, batch: Any, learner: dict, step_seconds: float,
                 samples_trained: int) -> dict:
    """Everything logged for step `step` (from 1: it updates weights version step - 1); `batch` is the buffer's
    Batch, `learner` the pool's metrics."""
    trajectories, stats = batch.trajectories, batch.stats
    generator_versions = stats.get("generator_versions", {})
    metrics = {"step": step}
    for key, name in BUFFER_STAT_KEYS.items():
        value = stats[key]
        metrics[name] = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
    tool_calls, tool_errors = sum(t.tool_calls for t in trajectories), sum(t.tool_errors for t in trajectories)
    metrics.update({
        "reward/std": float(np.std([t.reward for t in trajectories])),
        "staleness/limit": staleness_limit,
        "samples/trained": samples_trained,
        "time/step_s": step_seconds,  # wall time from the end of the previous step: wait + train + publish
        "samples/per_s": len(trajectories) / max(step_seconds, 1e-9),
        # behind the weights the step updates (version step - 1), as the staleness lags are
        "weights/version_lag_max": (step - 1 - min(generator_versions.values())) if generator_versions else 0,
        "episodes/tool_use_frac": float(np.mean([t.tool_calls > 0 for t in trajectories])),
        # errors / calls over the batch (malformed, unknown tool, bad arguments, raised, timed out)
        "episodes/tool_error_rate": tool_errors / max(1, tool_calls),
        "episodes/tool_calls": tool_calls, "episodes/tool_errors": tool_errors,  # the batch's, for the console
        # episodes scored against no ground truth (their sample lacked it: rewards.score_sample)
        "episodes/ground_truth_missing": sum(MISSING_GROUND_TRUTH in t.info.get("reward_info", {})
                                             for t in trajectories),
        "episodes/tool_latency_s": sum(t.timings.get("tool", 0.0) for t in trajectories)
        / max(1, tool_calls),  # mean seconds per tool call
        "episodes/length_mean": float(np.mean([len(t.token_ids) for t in trajectories])),
        # the engine's prefix cache: the share of the batch's prefilled context tokens served from cached
        # blocks (a group's shared prompt, an episode's earlier turns), and rows preempted for KV memory
        "generators/prefix_cache_hit_frac": engine_total(trajectories, "cached_tokens")
        / max(1, engine_total(trajectories, "prefill_tokens")),
        "generators/preemptions": engine_total(trajectories, "preemptions"),
        "episodes/generated_tokens_mean": float(np.mean([t.num_generated for t in trajectories])),
        "batch/tied_groups_frac": tied_groups_fraction(trajectories),
        # which prompts this step trained on: a resumed run never trains on one twice (tests/test_cli_run.py)
        "batch/prompt_indices": sorted({t.prompt_index for t in trajectories}),
    })
    metrics.update({f"buffer/{key}": value for key, value in stats.items()
                    if key not in BUFFER_STAT_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool)})
    metrics.update({key if "/" in key else f"learner/{key}": value for key, value in learner.items()})
    metrics.update(reward_info_means(trajectories))
    return metrics


def reward_info_means(trajectories: list) -> dict:
    """`reward/<key>`: the mean of each extra number a verl compute_score returned in its dict (rewards.py
    keeps them in info["reward_info"]), over the episodes that have it."""
    values: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in t.info.get("reward_info", {}).items():
            if key != MISSING_GROUND_TRUTH:  # counted as episodes/ground_truth_missing instead
                values.setdefault(key, []).append(value)
    return {f"reward/{key}": float(np.mean(v)) for key, v in sorted(values.items())}


def sample_record(step: int, t) -> dict:
    """One episode as samples.jsonl holds it: the chat (tool calls with arguments, results, errors),
    the final answer, the reward and what it was made of, and the weight versions that sampled it."""
    return {"step": step, "prompt_index": t.prompt_index, "sample_index": t.sample_index, "reward": t.reward,
            "reward_info": t.info.get("reward_info", {}), "finish_reason": t.finish_reason, "turns": t.num_turns,
            "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
            "versions": sorted({int(v) for v in t.versions if v >= 0}), "generator_id": t.generator_id,
            "messages": t.info.get("messages", []), "final_answer": t.info.get("final_answer", "")}


def sample_line(record: dict, width: int = 400) -> str:
    """A sample on one console line: role: content, tool calls as name(arguments)."""
    parts = []
    for message in record["messages"]:
        calls = [f"{c['function']['name']}({json.dumps(c['function']['arguments'])})"
                 for c in message.get("tool_calls", [])]
        parts.append(f"{message['role']}: {' '.join([message.get('content') or '', *calls]).strip()}")
    text = " | ".join(parts).replace("\n", " ")
    text = text if len(text) <= width else text[:width - 3] + "..."
    return f"sample (step {record['step']}, reward {record['reward']:g}, versions {record['versions']}): {text}"


def tied_groups_fraction(trajectories: list) -> float:
    """Share of the batch's groups whose rewards all tie: their group-relative advantages are all 0."""
    rewards: dict[int, set] = {}
    for t in trajectories:
        rewards.setdefault(t.group_id, set()).add(t.reward)
    return sum(len(values) == 1 for values in rewards.values()) / max(1, len(rewards))


SUMMARY_WINDOW = 5  # steps averaged at each end for the summary's reward first -> last (fewer in a short run)
EVAL_KEY = "eval/reward_mean"  # the held-out score (generators/worker.py evaluate), shown where a step has it


def run_summary(rows: list[dict], output_dir: Path, final: Path, log_samples: int,
                predicted: Optional[dict[str, float]] = None, start_step: int = 0) -> str:
    """The lines a run ends with, from its metrics.jsonl rows (every step once, a resumed run's earlier ones
    included): the steps this launch trained (after `start_step`, its checkpoint's) and the run's, samples trained
    per second of step time (time/step_s: waiting for the batch, training, publishing), reward/mean averaged over
    the first and the last few steps, the held-out score (`eval_line`), the learner's peak memory beside its
    start-up prediction (`predicted`: GB by memory/* key), where the model, samples and plot are."""
    window = max(1, min(SUMMARY_WINDOW, len(rows) // 3))
    first, last = (float(np.mean([r["reward/mean"] for r in part])) for part in (rows[:window], rows[-window:]))
    samples = (f"{output_dir / 'samples.jsonl'} ({log_samples} episodes a step)" if log_samples
               else "not kept (run.log_samples=N keeps N episodes a step)")
    return "\n".join([
        f"done: {steps_done(rows, start_step)}; reward {first:.3f} -> {last:.3f} (mean of the first and the last "
        f"{window} step(s))", *eval_line(rows), *memory_line(rows, predicted or {}), f"  final model: {final}",
        f"  samples:     {samples}",
        f"  metrics:     {output_dir / 'metrics.jsonl'}; plot them: nanoverl-async plot {output_dir}"])


def steps_done(rows: list[dict], start_step: int) -> str:
    """The steps trained, in time/step_s, and the run's samples/s; for a resumed run (`start_step` > 0) the steps of
    this launch apart from the run's."""
    seconds = sum(r["time/step_s"] for r in rows)
    run = f"{seconds:.0f} s, {rows[-1]['samples/trained'] / max(seconds, 1e-9):.1f} samples/s"
    if not start_step:
        return f"{len(rows)} steps in {run}"
    launched = [r for r in rows if r["step"] > start_step]
    this = (f"steps {start_step + 1}-{rows[-1]['step']} in this launch ({len(launched)} steps, "
            f"{sum(r['time/step_s'] for r in launched):.0f} s)" if launched else "no step in this launch")
    return f"{this}; all {len(rows)} steps of metrics.jsonl in {run}"


def eval_line(rows: list[dict]) -> list[str]:
    """One line, the held-out score (run.eval_every) at the first and the last evaluation and at its best; none
    without evaluations."""
    evals = [row for row in rows if EVAL_KEY in row]
    if not evals:
        return []
    first = evals[0]
    last = evals[-1]
    best = max(evals, key=lambda row: row[EVAL_KEY])
    return [f"  eval:        {EVAL_KEY} {first[EVAL_KEY]:.3f} (step {first['step']}) -> {last[EVAL_KEY]:.3f} (step "
            f"{last['step']}), best {best[EVAL_KEY]:.3f} (step {best['step']}); {len(evals)} evaluations on "
            f"data.val_files"]


def memory_line(rows: list[dict], predicted: dict[str, float]) -> list[str]:
    """One line, the learner's measured peak (the largest over steps; on a GPU the device's, which the start-up
    prediction's tensors are compared with) beside the prediction for it; none without memory/* in the rows."""
    key = next((key for key in ("memory/learner_peak_device_gb", "memory/learner_peak_host_gb") if key in rows[-1]),
               None)
    if key is None:
        return []
    guess = f"predicted {predicted[key]:.1f} GB, " if key in predicted else ""
    return [f"  learner memory: {guess}measured peak {max(row.get(key, 0.0) for row in rows):.1f} GB ({key}, max "
            f"over steps)"]


TIED_STEPS_WARNING = 3  # consecutive steps where every group ties before the logger warns (once)


class MetricsLogger:
    """Appends metrics to metrics.jsonl, shows a progress line, mirrors to wandb when enabled. A run
    resumed at `start_step` appends to the file, after dropping the rows of steps after start_step that the
    earlier run logged after its checkpoint, so every step appears once."""

    def __init__(self, output_dir: Path, total_steps: int, progress: bool = True,
                 wandb_config: Optional[dict] = None, start_step: int = 0, log_samples: int = 0,
                 print_sample_every: int = 0):
        # the folder exists (launch wrote config.yaml there first); claimed before a resumed run reads it
        self.path = checkpoint.claim(output_dir, "metrics.jsonl")
        self.closing = ExitStack()  # what close() ends: the files, the bar, the wandb run
        # a resumed run's earlier rows are counted as now, its samples as its metrics (current_rows)
        shift = counted_from_zero(_logged_rows(self.path)) if start_step and self.path.is_file() else 0
        self.file = self.closing.enter_context(_open_rows(self.path, start_step, shift))
        self.log_samples, self.print_sample_every = log_samples, print_sample_every
        samples = Path(output_dir) / "samples.jsonl"
        self.samples = self.closing.enter_context(_open_rows(samples, start_step, shift)) if log_samples else None
        self.total_steps = total_steps
        self.start_step = start_step
        self.progress = progress
        self.started = time.monotonic()
        self.tied_steps, self.warned = 0, set()  # the warnings given: each at most once a run
        self.bar = self.wandb_run = None
        if progress and sys.stdout.isatty():  # a live bar in a terminal; plain lines when piped to a file
            self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=20),
                                TextColumn("{task.fields[info]}"), TimeElapsedColumn())
            self.bar_task = self.bar.add_task("train", total=total_steps, completed=start_step, info="starting")
            self.closing.enter_context(self.bar)  # started now, stopped by close()
        if wandb_config is not None:
            import wandb  # optional tracker, imported only when asked for

            checkpoint.claim(output_dir, "wandb")  # wandb.init writes its files into output_dir/wandb
            self.wandb_run = wandb.init(project="nanoverl-async", config=wandb_config, dir=str(output_dir))
            self.closing.callback(self.wandb_run.finish)

    def log(self, metrics: dict, trajectories: list = ()) -> None:
        """One step's metrics, and (run.log_samples) some of its episodes, spread over its groups."""
        self.file.write(json.dumps(metrics) + "\n")
        if self.samples is not None and trajectories:
            chosen = trajectories[:: max(1, len(trajectories) // self.log_samples)][: self.log_samples]
            records = [sample_record(metrics["step"], t) for t in chosen]
            self.samples.write("".join(json.dumps(r) + "\n" for r in records))
            if self.print_sample_every and metrics["step"] % self.print_sample_every == 0:
                print(sample_line(records[0]), flush=True)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if not isinstance(v, (dict, list))},
                               step=metrics["step"])
        if self.progress:
            self._print_line(metrics)
        self._warn_if_wrong(metrics, trajectories)

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def _warn_if_wrong(self, m: dict, trajectories: list) -> None:
        """Once a run each: every group tied for TIED_STEPS_WARNING steps in a row; most of a step's tool calls
        failed; every reward is 0 and samples lacked the ground truth the reward function was given."""
        self.tied_steps = self.tied_steps + 1 if m["batch/tied_groups_frac"] == 1.0 else 0
        if self.tied_steps == TIED_STEPS_WARNING:
            self._warn("tied", f"steps {m['step'] - TIED_STEPS_WARNING + 1}-{m['step']}: within every group all "
                       f"rewards are equal (batch mean {m['reward/mean']:.3g}), so group-relative advantages are 0 "
                       f"and nothing is learned (learner/grad_norm 0). Likely the reward function never (or always) "
                       f"gives credit: check a few episodes' answers against it (reward.path, agent.env), or make "
                       f"the task easier for this model")
        calls = m["episodes/tool_calls"]
        errors = m["episodes/tool_errors"]
        missing = m["episodes/ground_truth_missing"]
        if 2 * errors > calls:  # more than half
            first = next((t.info["first_tool_error"] for t in trajectories if t.info.get("first_tool_error")), "")
            self._warn("tools", f"step {m['step']}: {errors} of {calls} tool calls failed"
                       + (f" (first: {first})" if first else "") + "; the model reads each error as the tool's "
                       "result. Check the tools of agent.env and the call format the model writes (tool_format)")
        if missing and m["reward/mean"] == 0 and m["reward/std"] == 0:
            self._warn("ground_truth", f"step {m['step']}: every reward is 0, and {missing} of {len(trajectories)} "
                       f"episodes were scored against no ground truth: their samples have no "
                       f"reward_model.ground_truth (nor answer). Add it to the rows of data.train_files (or to "
                       f"what data.task returns)")

    def _print_line(self, m: dict) -> None:
        info = (f"reward {m['reward/mean']:.3f}  tools {m['episodes/tool_use_frac']:.2f}  "
                f"tool_err {m['episodes/tool_errors']}/{m['episodes/tool_calls']}  "
                f"staleness {m['staleness/mean']:.2f}/{m['staleness/max']}<={m['staleness/limit']}  "
                f"{m['samples/per_s']:.0f} samples/s  {m['tokens/generated_per_s']:.0f} tok/s"
                + (f"  {EVAL_KEY} {m[EVAL_KEY]:.3f}" if EVAL_KEY in m else ""))  # run.eval_every's steps
        if self.bar is not None:
            self.bar.update(self.bar_task, completed=m["step"], info=info)
        else:
            elapsed = time.monotonic() - self.started
            print(f"step {m['step']:>4}/{self.total_steps}  {info}  {elapsed:.0f}s", flush=True)

    def summary(self, final: Path, predicted: Optional[dict[str, float]] = None) -> str:
        """`run_summary` of the rows logged so far, with `final` the final model's folder."""
        rows = [json.loads(line) for line in self.path.read_text().splitlines()]
        return run_summary(rows, self.path.parent.resolve(), final.resolve(), self.log_samples, predicted,
                           self.start_step)

    def close(self) -> None:
        self.closing.close()


# metrics.jsonl as versions before 2026-11-29 wrote it: a row's step counted from 0 (the weights version it
# updated; learner/version was step + 1), and these keys had a singular prefix (one prefix per role since).
RENAMED = {"generator/prefix_cache_hit_frac": "generators/prefix_cache_hit_frac",
           "generator/preemptions": "generators/preemptions"}


def current_rows(rows: list[dict], shift: Optional[int] = None) -> list[dict]:
    """A run's rows as this version writes them, whichever version wrote them: every reader of a run's rows goes
    through here (plot, simulate; a resumed run rewrites its files so). `shift`: the steps' renumbering, by
    default `counted_from_zero(rows)` (samples.jsonl is told by its run's metrics.jsonl)."""
    shift = counted_from_zero(rows) if shift is None else shift
    return [{**{RENAMED.get(key, key): value for key, value in row.items()}, "step": row["step"] + shift}
            for row in rows]


def counted_from_zero(rows: list[dict]) -> int:
    """1 if metrics rows count steps from 0 (written before 2026-11-29), else 0: there a row's learner/version
    is step + 1, now step; rows without it (a copy cut to some keys) tell by a first step 0, never written now."""
    if not rows:
        return 0
    first = rows[0]
    return int(first["learner/version"] == first["step"] + 1 if "learner/version" in first else first["step"] == 0)


def _open_rows(path: Path, start_step: int, shift: int = 0):
    """A .jsonl of per-step rows, opened for appending, line-buffered (each row is on disk once written: a
    crashed run keeps its steps). A run resumed at `start_step` (the steps its checkpoint holds) first keeps
    only the rows of steps up to it, renumbered by `shift` (`current_rows`): the earlier run may have logged
    steps after its checkpoint, and each step appears once."""
    checkpoint.claim(path.parent, path.name)  # never a link's target; listed in the run's marker
    if start_step and path.is_file():
        rows = [row for row in current_rows(_logged_rows(path), shift) if row["step"] <= start_step]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path.open("a" if start_step else "w", buffering=1)


def _logged_rows(path: Path) -> list[dict]:
    """The rows of a .jsonl of per-step rows, as written; a blank or torn line (a crash mid-write) is left out."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows
