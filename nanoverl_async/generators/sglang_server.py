"""One SGLang server process and its control endpoints (the project notes SGLANG_PROTOCOL.md, sections 3 to 5).

    server = SGLangServer(model_path, port=30000, cfg=SGLangConfig())
    server.start()                    # python -m sglang.launch_server ..., waits for GET /health == 200
    server.pause("abort"); server.update_from_disk("/ckpt/v3", 3); server.resume()

Invariants:
  - every HTTP call has a timeout (`cfg.control_timeout_s`; `cfg.launch_timeout_s` for start-up) and
    fails loudly: `SGLangError` names the server, the endpoint, the status and the body;
  - the protocol variant is chosen from the server's own version (`GET /server_info` -> `version`):
    0.5.23+ wraps distributed/tensor updates in `/begin_weight_update` .. `/end_weight_update`, and
    0.5.2 takes no pause body (always abort); `legacy_protocol` overrides the choice;
  - the process inherits this process's environment, so it runs on the GPUs Ray assigned to the
    generator (CUDA_VISIBLE_DEVICES); `restart` relaunches it with the newest weights on disk and the
    current weight version, so a restarted server never tags tokens with a version it does not hold;
  - the server leads its own process group (a new session): `stop`/`restart`/`close` SIGTERM the whole
    group, SIGKILL it after `timeout_s`, and SIGKILL whatever of it outlived the server, so nothing it
    spawned keeps the GPU or the port;
  - the server never outlives the process that launched it, however that process dies (`ray.kill`,
    SIGKILL, OOM): a watchdog (generators/watchdog.py) SIGTERMs the group, then SIGKILLs it
    after a grace period, when the launcher is gone; which thread launched the server does not matter.
    Linux/POSIX only (fork, setsid, killpg).

`command` is the launcher prefix (default `python -m sglang.launch_server`); the contract tests point it at
tests/fake_sglang_server.py, which takes the same flags. Run alone: tests/test_sglang_contract.py.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

import httpx

from nanoverl_async.config import SGLangConfig
from nanoverl_async.generators.watchdog import signal_group, spawn_watched

log = logging.getLogger(__name__)

HEALTH_POLL_S = 0.2
class SGLangError(RuntimeError):
    """An SGLang server refused a call, timed out, or died; the message names which and why."""


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.5.10.post1' -> (0, 5, 10); anything unparsable sorts as the newest protocol."""
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            return (99,)
        parts.append(int(digits))
    return tuple(parts)


def sglang_version() -> str:
    """The installed sglang version (a lazy import: sglang is an optional extra)."""
    try:
        import sglang
    except ImportError as error:
        raise SGLangError("generator.engine=sglang needs `pip install -e '.[sglang]'` on a GPU machine") from error
    return getattr(sglang, "__version__", "0")


class SGLangServer:
    def __init__(self, model_path: str, port: int, cfg: SGLangConfig, *, initial_version: int = 0,
                 command: Optional[list[str]] = None, url: str = "", legacy_protocol: Optional[bool] = None,
                 seed: int = 0, dtype: str = "auto"):
        self.model_path, self.port, self.cfg = model_path, port, cfg
        self.url = url or f"http://{cfg.host}:{port}"
        default = [] if url else [sys.executable, "-m", "sglang.launch_server"]  # a given url: not ours to launch
        self.command = command if command is not None else default
        self.version = initial_version  # the weights version this server holds
        self.seed, self.dtype = seed, dtype
        self.legacy_protocol = legacy_protocol  # None = decide from the server's version
        self.server_version = ""
        self.process: Optional[subprocess.Popen] = None
        self._lifeline: Optional[int] = None  # the write end of the watchdog's pipe; held while we live
        self.restarts = 0
        self._client = httpx.Client(timeout=cfg.control_timeout_s)

    # --- process ---------------------------------------------------------------------------------
    def launch_args(self) -> list[str]:
        cfg = self.cfg
        return [*self.command, "--model-path", self.model_path, "--host", cfg.host, "--port", str(self.port),
                "--tp-size", str(cfg.tp_size), "--mem-fraction-static", str(cfg.mem_fraction_static),
                "--weight-version", str(self.version), "--random-seed", str(self.seed), "--dtype", self.dtype,
                "--skip-server-warmup",
                *cfg.server_args]

    def start(self) -> None:
        """Launch the process (unless this wraps an external `url`) and wait until it is healthy."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the server process (if ours to start) under a watchdog (generators/watchdog.py)."""
        if self.process is None and self.command:
            args = self.launch_args()
            if shutil.which(args[0]) is None:  # the trampoline would only report it as exit code 127
                raise FileNotFoundError(errno.ENOENT, "SGLang server command not found", args[0])
            log.info("starting SGLang server: %s", " ".join(args))
            self.process, self._lifeline = spawn_watched(args)

    def wait_ready(self) -> None:
        """Wait for GET /health == 200, then read the server's version to pick the protocol variant."""
        self.wait_healthy(self.cfg.launch_timeout_s)
        info = self.get("/server_info")
        self.server_version = str(info.get("version", ""))
        if self.legacy_protocol is None:
            self.legacy_protocol = version_tuple(self.server_version) < (0, 5, 23)

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise SGLangError(f"SGLang server {self.url} exited with code {self.process.returncode} "
                                  "while starting (see its log above)")
            try:
                if self._client.get(self.url + "/health", timeout=min(30.0, timeout_s)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SGLangError(f"SGLang server {self.url} not healthy within {timeout_s:.0f} s")
            time.sleep(HEALTH_POLL_S)

    def restart(self, model_path: str) -> None:
        """Kill (if needed) and relaunch with `model_path` (the newest weights) at version `self.version`."""
        self.stop()
        self.model_path = model_path
        self.restarts += 1
        log.warning("restarting SGLang server %s (restart %d) with %s, version %d",
                    self.url, self.restarts, model_path, self.version)
        self.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `timeout_s`, then SIGKILL what is left of
        it (children that outlived the server); closing the lifeline then lets the watchdog exit."""
        process = self.process
        if process is not None:
            if process.poll() is None:
                signal_group(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    signal_group(process.pid, signal.SIGKILL)
                    process.wait(timeout_s)
            signal_group(process.pid, signal.SIGKILL)
            self.process = None
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def close(self) -> None:
        self.stop()
        self._client.close()

    # --- HTTP --------------------------------------------------------------------------------------
    def post(self, path: str, body: Optional[dict] = None, check_success: bool = True):
        """POST JSON; the parsed reply. A non-200 status or `success: false` raises SGLangError."""
        try:
            reply = self._client.post(self.url + path, json=body)
        except httpx.TimeoutException as error:
            raise SGLangError(f"{self.url}{path}: no reply within {self.cfg.control_timeout_s:.0f} s") from error
        except httpx.TransportError as error:
            raise SGLangError(f"{self.url}{path}: {type(error).__name__}: {error}") from error
        parsed = _parse(reply)
        if reply.status_code != 200 or (check_success and isinstance(parsed, dict) and parsed.get("success") is False):
            raise SGLangError(f"{self.url}{path} answered {reply.status_code}: {reply.text[:500]}")
        return parsed

    def get(self, path: str):
        try:
            reply = self._client.get(self.url + path)
        except httpx.HTTPError as error:
            raise SGLangError(f"{self.url}{path}: {type(error).__name__}: {error}") from error
        if reply.status_code != 200:
            raise SGLangError(f"{self.url}{path} answered {reply.status_code}: {reply.text[:500]}")
        return _parse(reply)

    # --- control -----------------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        """Stop generation: `abort` returns in-flight requests with their partial tokens (once drained);
        `retract` keeps their HTTP calls open and finishes them after `resume`."""
        if version_tuple(self.server_version) < (0, 5, 10) and self.server_version:
            if mode != "abort":
                raise SGLangError(f"{self.url}: SGLang {self.server_version} pauses only in abort mode")
            self.post("/pause_generation")
        else:
            self.post("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self.post("/continue_generation", {})

    def update_from_disk(self, model_path: str, version: int) -> None:
        """Load a Hugging Face directory as weights `version` (the old weights stay on failure)."""
        self.post("/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version),
                                                "abort_all_requests": False, "flush_cache": True})
        self.model_path, self.version = model_path, version

    def weight_version(self) -> str:
        """The server's weight version, read the way its version offers (0.5.2: /get_weight_version)."""
        if version_tuple(self.server_version) < (0, 5, 10) and self.server_version:
            return str(self.get("/get_weight_version")["weight_version"])
        return str(self.get("/model_info")["weight_version"])

    def begin_update(self) -> None:
        if not self.legacy_protocol:
            self.post("/begin_weight_update", {"selector": "all"})

    def end_update(self) -> None:
        if not self.legacy_protocol:
            self.post("/end_weight_update", {})


def _parse(reply: httpx.Response):
    if "json" in reply.headers.get("content-type", ""):
        return reply.json()
    return reply.text
