"""Checkpoint folders of the whole asynchronous state, and finding the one to resume from.

    output_dir/checkpoints/step_N/
        learner/        torch.distributed.checkpoint of policy + AdamW (+ critic + its AdamW with gae),
                        sharded, every learner rank writes its own part (learners/checkpoint.py)
        buffer.msgpack  the prompt frontier, live leases, complete groups' trajectories, counters
                        (BufferService.state_bytes)
        meta.json       step (= the weights' version), seed, the config, buffer counters,
                        and where each part was written (`written_on`: node addresses; on a cluster
                        the learner shards are on the learners' nodes, the rest on the head's)

Invariants: a folder named `step_N` is complete. The launcher writes into `.step_N.tmp`, the controller
writes meta.json last, and one `rename` publishes it, so a crash mid-save leaves only a `.tmp` folder,
which the next save removes and `run.resume=auto` never picks. After each save only the newest
`run.keep_checkpoints` folders are kept (0 = all). `final/` is published the same way (from `.final.tmp`),
so a run is done only when a complete final/ exists.

Only the run's own files: a run marks the folder it creates or claims with MARKER (a run id and the
top-level entries the run created, each listed by `claim` before it is first written; what is inside a
listed directory is the run's). `run.overwrite`, `run.resume=auto` in a folder whose run died before its
first checkpoint, and any fresh launch in a folder whose run finished no step (it died starting) delete only
listed entries, saying so in a line (refusing a checkpoints/ that holds what no save writes). A non-empty
folder without the marker (a user's, or a run's from a version before markers) is refused whatever the flags,
as is an entry the marker does not list or a symbolic link (a run writes none, so no write follows one out of
the folder); nothing is changed then. These refusals, and a folder that cannot be written, come before anything
starts (`inspect_output_dir`: the launch's plan, controller/preflight.py, runs it before it builds a model, the
CLI before Ray starts), and a failed write on a full or read-only disk ends the run naming the path (`writing`).

Not saved: the generators' partial episodes (docs/design.md "Checkpoints and resume"): a resumed
buffer re-issues every prompt that was in flight, and the generators sample it again from the restored
policy. That costs at most the work that was in flight, and keeps the generators stateless.
The generators' sampling RNG is re-seeded from run.seed rather than saved: which episode draws which
random number depends on timing anyway, so asynchronous runs are not bit-reproducible. Prompt order
needs no RNG state: a prompt is a pure function of (run.seed, index) (data.py, multiply_task.py).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Optional

from nanoverl_async.config import Config, ConfigError, RunConfig, to_dict

META = "meta.json"
REQUIRED_FILES = ("learner/.metadata", "buffer.msgpack")  # DCP's index of the shards; the buffer's state
STEP_DIR = re.compile(r"step_(\d+)")
STEP_TMP = re.compile(r"\.step_(\d+)\.tmp")
FINAL = "final"
FINAL_TMP = ".final.tmp"
FINAL_OLD = ".final.old"
# The run's mark on its folder: {"run_id": ..., "entries": [top-level names the run created]}; written whole
# (MARKER_TMP, then a rename), so it is never torn. A lost update (`plot` claiming beside a running run) can
# only leave an entry unlisted, which a later overwrite refuses: never a deletion.
MARKER = ".nanoverl-run.json"
MARKER_TMP = MARKER + ".tmp"
LOW_DISK_BYTES = 256 << 20  # a write that failed with less free space than this is blamed on the disk
# keys that make a run another run: resuming a checkpoint written with other values is refused
LINEAGE_KEYS = ("run.seed", "model.path", "data.task", "data.train_files", "agent.env")


def checkpoints_dir(output_dir: str) -> Path:
    return Path(output_dir).resolve() / "checkpoints"


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and STEP_DIR.fullmatch(path.name) is not None and (path / META).is_file()


def find_checkpoint(run: RunConfig) -> Optional[Path]:
    """The folder `run.resume` names: None for a fresh run ("" , or "auto" before any checkpoint); the
    newest complete step_N under output_dir/checkpoints for "auto"; else the path, which must be one."""
    if not run.resume:
        return None
    if run.resume == "auto":
        found = [p for p in checkpoints_dir(run.output_dir).glob("step_*") if is_checkpoint(p)]  # none: no folder
        return max(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)), default=None)
    path = Path(run.resume).resolve()
    if not is_checkpoint(path):
        raise ConfigError(f"config key 'run.resume': '{run.resume}' is not a checkpoint (a step_N folder with "
                          f"{META}); use \"\" for a fresh run or \"auto\" for the newest under run.output_dir")
    return path


def check_output_dir(output_dir: str) -> None:
    """One ConfigError line if run.output_dir is a file or cannot be written: a probe file is made, and
    removed at once, where the run will write (the folder, or the nearest existing parent it is made in)."""
    out = Path(output_dir).absolute()
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"config key 'run.output_dir': '{output_dir}' is a file, not a directory")
    existing = next(p for p in (out, *out.parents) if os.path.exists(p))
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise ConfigError(f"config key 'run.output_dir': '{output_dir}' cannot be written ({existing}: "
                          f"{error.strerror or error}); choose another run.output_dir") from None


class OutputDir(NamedTuple):
    """What a launch will do with run.output_dir (`inspect_output_dir`)."""
    resume_from: Optional[Path]  # the checkpoint to resume from; None: a fresh run
    meta: Optional[dict]  # resume_from's meta.json (`read_meta`); None: a fresh run
    marker: Optional[dict]  # the folder's MARKER; None: no run's folder yet (missing or empty)
    clearing: Optional[str]  # the line saying why the run found there is cleared for this one; None: not cleared


def inspect_output_dir(cfg: Config, resume_from: Optional[Path], meta: Optional[dict]) -> OutputDir:
    """What launching `cfg` will do with run.output_dir, resuming the checkpoint `resume_from` (None: a fresh run)
    whose meta.json is `meta` (controller/preflight.py resolves both), changing nothing; every refusal is a
    ConfigError here, so the CLI refuses before Ray starts and `launch` before it builds anything. Refused, losing
    no earlier run and no file of the user's: a folder without MARKER, or holding an entry it does not list; a
    run's folder for a fresh run, unless run.overwrite clears it, run.resume=auto finds a run that died before its
    first checkpoint, or the run there finished no step (`finished_a_step`: it died starting); a checkpoint of
    another lineage (LINEAGE_KEYS) or of a finished run."""
    out = Path(cfg.run.output_dir)
    check_output_dir(cfg.run.output_dir)
    if resume_from is not None:
        check_resumable(cfg, resume_from, meta)
    names = sorted(os.listdir(out)) if out.is_dir() else []
    marker = read_marker(out) if names else None  # a non-empty folder without one is refused here
    present = [name for name in names if name not in (MARKER, MARKER_TMP)]
    for name in present:
        refuse_foreign(out / name, marker["entries"])
    if resume_from is None and present:
        if cfg.run.overwrite:
            clearing = f"run.overwrite=true: clearing the run in {out}"
        elif cfg.run.resume == "auto" and not is_final(out / FINAL):
            clearing = f"run.resume=auto: no complete checkpoint in {out}; starting a fresh run"
        elif not finished_a_step(out):
            clearing = f"{out}: the run there finished no step (no metrics row, no checkpoint); starting afresh"
        else:
            hint = "" if cfg.run.resume else "run.resume=auto to continue it, "
            raise ConfigError(f"config key 'run.output_dir': '{out}' already holds a run and no checkpoint is "
                              f"resumed; set {hint}a new run.output_dir, or run.overwrite=true to clear it")
        refuse_foreign_saves(out, marker["entries"])
        return OutputDir(None, None, marker, clearing)
    return OutputDir(resume_from, meta, marker, None)


def finished_a_step(out: Path) -> bool:
    """Whether the run in `out` finished a step: a metrics.jsonl with anything in it (observe/metrics.py writes the
    file empty at the start and a row at the end of each step; a torn row counts), a checkpoint, or final/."""
    metrics = out / "metrics.jsonl"
    saves = checkpoints_dir(str(out))
    return ((metrics.is_file() and metrics.stat().st_size > 0) or is_final(out / FINAL)
            or (saves.is_dir() and any(is_checkpoint(p) for p in saves.iterdir())))


def open_output_dir(cfg: Config, found: OutputDir) -> None:
    """Make run.output_dir ready as `inspect_output_dir` `found` it, marked as this run's. A run cleared for this one
    loses only the entries it listed, in one line."""
    out = Path(cfg.run.output_dir)
    if found.clearing is not None:
        clear_run(out, found.marker["entries"])
        print(found.clearing, file=sys.stderr)
    if found.resume_from is None or found.marker is None:  # a new run: its mark comes before any file of it
        out.mkdir(parents=True, exist_ok=True)
        write_marker(out, {"run_id": uuid.uuid4().hex, "entries": []})


def read_marker(out: Path) -> dict:
    """The run's MARKER in `out`; a ConfigError if there is none (the folder is no run's) or it is not one."""
    path = out / MARKER
    if not path.exists() and not path.is_symlink():
        raise ConfigError(f"config key 'run.output_dir': '{out}' is not empty and has no {MARKER}, so it is no "
                          f"run's folder (or a run's from a version without run markers); nothing was changed: "
                          f"choose another run.output_dir or move its files away (an older run's checkpoint "
                          f"resumes into a new run.output_dir with run.resume=<its step_N folder>)")
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as file:
            marker = json.load(file)
        if not (isinstance(marker, dict) and isinstance(marker.get("entries"), list)
                and all(isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
                        for name in marker["entries"])):
            raise ValueError("no list of entries")
    except (OSError, ValueError) as error:
        raise ConfigError(f"config key 'run.output_dir': {path} is not a run marker ({error}); nothing was "
                          f"changed: choose another run.output_dir or move the folder's files away") from None
    return marker


def write_marker(out: Path, marker: dict) -> None:
    tmp = out / MARKER_TMP
    tmp.unlink(missing_ok=True)  # a crashed write's; O_EXCL below then never follows a link planted there
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as file:
        json.dump(marker, file)
    tmp.replace(out / MARKER)


def claim(output_dir: str | Path, name: str) -> Path:
    """`output_dir/name`, a top-level entry the run is about to write (or rewrite), after `refuse_foreign`;
    in a run's folder it is listed in MARKER first. Every writer of the run's files goes through here."""
    out = Path(output_dir)
    marker = read_marker(out) if os.path.lexists(out / MARKER) else None  # none: a folder no launch opened
    refuse_foreign(out / name, marker["entries"] if marker else None)
    if marker and name not in marker["entries"]:
        write_marker(out, {**marker, "entries": sorted({*marker["entries"], name})})
    return out / name


def refuse_foreign(path: Path, listed: Optional[list]) -> None:
    """A ConfigError naming `path` if a run may not write it: a symbolic link (a run makes none, so writing
    there would write elsewhere), or in a run's folder (`listed`: its MARKER's entries) one it did not create."""
    if path.is_symlink():
        why = "is a symbolic link, which no run writes"
    elif listed is not None and path.name not in listed and path.exists():
        why = f"was not written by the run there ({MARKER} does not list it)"
    else:
        return
    raise ConfigError(f"config key 'run.output_dir': {path} {why}; nothing was changed: move it away or choose "
                      f"another run.output_dir")


def refuse_foreign_saves(out: Path, listed: list) -> None:
    """A ConfigError if the run's checkpoints/ in `out` holds anything a save does not write."""
    saves = out / "checkpoints"
    if "checkpoints" in listed and saves.is_dir():
        foreign = [p for p in sorted(saves.iterdir())
                   if not (p.is_dir() and (STEP_DIR.fullmatch(p.name) or STEP_TMP.fullmatch(p.name)))]
        if foreign:
            raise ConfigError(f"config key 'run.output_dir': '{out}' holds {foreign[0]}, which no run writes; "
                              f"nothing was deleted: choose another run.output_dir or move it away")


def clear_run(out: Path, listed: list) -> None:
    """Delete the entries the run listed in `out`, after `refuse_foreign_saves` (again: the folder may have changed
    since it was inspected)."""
    refuse_foreign_saves(out, listed)
    for entry in (out / name for name in listed):
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink(missing_ok=True)


def check_resumable(cfg: Config, resume_from: Path, meta: dict) -> None:
    """The checkpoint (its meta.json: `meta`) is whole, is this run's (same lineage) and leaves work to do: steps,
    or at least final/."""
    for part in REQUIRED_FILES:
        if not (resume_from / part).is_file():
            raise ConfigError(f"config key 'run.resume': checkpoint file {resume_from / part} is missing; "
                              f"resume from another checkpoint (run.resume=<its step_N folder>)")
    old = {**meta["config"], "run": {"seed": meta["seed"]}}
    new = {**trained_config(cfg), "run": {"seed": cfg.run.seed}}
    other = [key for key in changed_keys(old, new) if key in LINEAGE_KEYS]
    if other:
        raise ConfigError(f"config key 'run.resume': checkpoint {resume_from} belongs to another run (other "
                          f"{', '.join(other)}); resume with the same values or start a new run.output_dir")
    done = meta["step"] > cfg.run.total_steps or (meta["step"] == cfg.run.total_steps
                                                    and is_final(Path(cfg.run.output_dir) / FINAL))
    if done:
        raise ConfigError(f"config key 'run.total_steps': {cfg.run.total_steps} steps are already done by the "
                          f"checkpoint {resume_from} (step {meta['step']}); raise run.total_steps")


def is_final(path: Path) -> bool:
    """A complete final/: published by `publish_final`, with the model's config and weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def publish_final(output_dir: str | Path, write) -> Path:
    """`write(folder)` the final model into `.final.tmp`, then rename it into place as final/ (the rename
    is the commit: an earlier run's final/ is replaced only once the new one is whole)."""
    out = Path(output_dir)
    tmp = claim(out, FINAL_TMP)
    final = claim(out, FINAL)
    old = out / FINAL_OLD
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(claim(out, leftover.name))
    write(tmp)
    if final.exists():
        final.rename(claim(out, FINAL_OLD))
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)
    return final


class WriteFailed(RuntimeError):
    """The disk refused a write of the run's (full, read-only, or no permission); the message names it."""


@contextmanager
def writing(what: str, path: Path):
    """A write that fails on a full disk or without permission ends the run in one line naming `what` and
    where, not in a storage library's internals (DCP's 'unexpected pos'): WriteFailed."""
    try:
        yield
    except (WriteFailed, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        reason = disk_problem(error, path)
        if reason is None:
            raise
        where = getattr(error, "filename", None) or path
        raise WriteFailed(f"could not write {what} to {where}: {reason}") from error


def disk_problem(error: BaseException, path: Path) -> Optional[str]:
    """Why the disk at `path` refused a write, from the error (or its causes) or the disk itself; None if
    the disk looks fine. A role's error reaches the controller as text, without its errno: hence the text
    and the free space are read too."""
    free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
    room = f"{free / 2**20:.0f} MiB free on its disk"
    while error is not None:
        code, text = getattr(error, "errno", None), str(error)
        if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text:
            code = errno.ENOSPC
        if code in (errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS):
            return f"{os.strerror(code)} ({room})"
        if "Permission denied" in text or "Read-only file system" in text:
            return text.strip().splitlines()[-1]
        error = error.__cause__ or error.__context__
    if free < LOW_DISK_BYTES:
        return f"the disk is (nearly) full ({room})"
    return None


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json; a ConfigError naming the file if it is not what `commit` wrote."""
    try:
        meta = json.loads((path / META).read_text())
        if not isinstance(meta, dict) or not {"step", "seed", "config"} <= set(meta):
            raise ValueError("step, seed or config missing")
    except (ValueError, OSError) as error:
        raise ConfigError(f"config key 'run.resume': checkpoint file {path / META} is unreadable ({error}); "
                          f"resume from another checkpoint (run.resume=<its step_N folder>)") from None
    return meta


def begin(output_dir: str, step: int) -> Path:
    """A fresh, empty `.step_N.tmp` folder (a crashed save's leftovers are removed first)."""
    tmp = claim(output_dir, "checkpoints").resolve() / f".step_{step}.tmp"
    for stale in tmp.parent.glob(".step_*.tmp") if tmp.parent.is_dir() else []:
        shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, meta: dict, keep: int) -> Path:
    """Write meta.json last, publish the folder as step_N with one rename, prune old checkpoints."""
    (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
    final = tmp.parent / f"step_{meta['step']}"
    if final.exists():  # resumed from an earlier step than this one: the older run's copy is replaced
        shutil.rmtree(final)
    tmp.rename(final)
    if keep:
        steps = sorted((p for p in tmp.parent.iterdir() if is_checkpoint(p)),
                       key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))
        for old in steps[:-keep]:
            shutil.rmtree(old)
    return final


def make_meta(cfg: Config, step: int, buffer_counters: dict, written_on: Optional[dict] = None) -> dict:
    return {"step": step, "version": step, "seed": cfg.run.seed, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config": trained_config(cfg), "buffer": buffer_counters, "written_on": written_on or {}}


def trained_config(cfg: Config) -> dict:
    """The config without the keys a resumed run may change freely (run.*: steps, output, resume, ...); every
    other key is compared on resume. A key set through an interpolation is its text (an environment variable's
    value is never written), but the LINEAGE_KEYS are values: paths, which a resume must match."""
    return {section: keys for section, keys in to_dict(cfg, LINEAGE_KEYS).items() if section != "run"}


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts (to warn on resume)."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys
