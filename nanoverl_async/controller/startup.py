"""Start-up of a run: Ray started once, while the controller's heavy imports load, and a console line per
phase with the seconds since launch (a first run that builds its model for minutes says so).

    started_ray, launcher = start_ray_while_importing(cfg.ray, "nanoverl_async.launcher")   # the CLI

Why overlap: on a small machine start-up is CPU-bound, and the controller's imports (torch, transformers:
seconds) use one core, while Ray's processes start on the others. This module imports only Ray, so the
thread that imports the launcher holds torch's import alone.

Why `collecting_later`: importing torch and transformers and building a model allocate millions of objects
that live as long as the process, and every cyclic collection meanwhile rescans them: ~15% of that CPU. The
controller's start-up (cli.py) and each generator's and learner rank's constructor (role_actors.py) run
without it.

Run alone: tests/test_cli_run.py runs the CLI and checks the phase lines and time/startup_s.
"""

from __future__ import annotations

import gc
import importlib
import os
import secrets
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import ray
from ray._private import ray_constants
from ray._private.authentication.authentication_token_setup import _enable_token_auth

from nanoverl_async.config import RayConfig


def phase(started: float, what: str) -> None:
    """A console line for a start-up phase, with the seconds since `started` (time.time() at launch)."""
    print(f"[{time.time() - started:5.1f} s] {what}", file=sys.stderr, flush=True)


@contextmanager
def collecting_later():
    """Python's cyclic garbage collector paused for the block (a start-up: see the module docstring); what
    became garbage meanwhile waits for the next automatic collection (its cost: docs/benchmarks.md
    "Costs behind choices in the code")."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def start_ray_while_importing(cfg: RayConfig, module: str) -> tuple[bool, ModuleType]:
    """`start_ray(cfg)` here (Ray sets its signal handlers on the main thread) while a thread imports `module`;
    (whether Ray was started here, the module)."""
    with ThreadPoolExecutor(1, thread_name_prefix="imports") as pool:
        loading = pool.submit(importlib.import_module, module)
        started_ray = start_ray(cfg)
        return started_ray, loading.result()


def start_ray(cfg: RayConfig) -> bool:
    """Local Ray by default, a cluster when `ray.address` is set; returns whether we started it. Every
    role runs this very checkout's code: on a cluster the package is shipped to the nodes (py_modules);
    on this machine the workers import it from where the driver did, whatever else is installed."""
    if ray.is_initialized():
        return False
    quiet = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    os.environ.update(quiet)
    package = Path(__file__).resolve().parents[1]  # nanoverl_async/, this file being in nanoverl_async/controller/
    runtime_env = {"env_vars": quiet, "py_modules": [str(package)]} if cfg.address else None
    # Whoever reaches Ray's control server runs code as this run's user (it stores the pickled classes that
    # workers load), so Ray's token authentication is always on: set for Ray's processes and, as Ray reads its
    # settings once at import, refreshed in this one. On a cluster every node shares a token (docs/gpus.md).
    _enable_token_auth()
    # A local run is this machine's alone. Ray binds every port on loopback when the node's address is
    # loopback (its single-node mode, otherwise macOS's); the token is the run's, in no file (one per process:
    # Ray caches the first it reads); the session directory (sockets, logs) sits in a private directory, as
    # Ray makes the ones it creates world-writable.
    ray_constants.ENABLE_RAY_CLUSTER = bool(cfg.address)
    temp_dir = None
    if not cfg.address:
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        temp_dir = os.path.join(tempfile.mkdtemp(prefix="ray-"), "ray")
        # workers inherit this environment; a runtime_env would bar them from Ray's prestarted ones (~1.3 s)
        paths = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(package.parent), *paths]))
    ray.init(address=cfg.address or None, num_cpus=cfg.num_cpus or None, include_dashboard=False,
             logging_level="WARNING", runtime_env=runtime_env, _temp_dir=temp_dir)
    return True
