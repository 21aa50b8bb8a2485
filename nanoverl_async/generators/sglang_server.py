"""One SGLang server process: launch, health, restart, stop (docs/sglang.md "Launching and health").

    server = SGLangServer(model_path, port=30000, cfg=SGLangConfig())
    server.launch(); server.wait_ready()   # python -m sglang.launch_server ..., then GET /health == 200
    server.pause("abort"); server.update_from_disk("/ckpt/v3", 3); server.resume()

Invariants:
  - the control calls (pause/continue, weight version, begin/end update, the protocol variant from the
    server's own version) are `SGLangClient`'s (nanoverl_async/wire/sglang_http.py), which learner rank 0
    uses too; start-up waits at most `cfg.launch_timeout_s`, every other call `cfg.control_timeout_s`;
  - the process inherits this process's environment, so it runs on the GPUs Ray assigned to the
    generator (CUDA_VISIBLE_DEVICES); `restart` relaunches it with the newest weights on disk and the
    current weight version, so a restarted server never tags tokens with a version it does not hold;
  - the server leads its own process group (a new session): `stop`/`restart`/`close` SIGTERM the whole
    group, SIGKILL it after `timeout_s`, and SIGKILL whatever of it outlived the server, so nothing it
    spawned keeps the GPU or the port;
  - the server never outlives the process that launched it, however that process dies (`ray.kill`,
    SIGKILL, OOM): a watcher (reaper.py, started right after the server) SIGTERMs the group, then
    SIGKILLs it after a grace period, when the launcher is gone; which thread launched the server does not
    matter. Linux/POSIX only (setsid, killpg).

`command` is the launcher prefix (default generator.sglang.server_command, else `python -m sglang.launch_server`);
the contract tests point it at tests/fake_sglang_server.py, which takes the same flags.
Run alone: tests/test_sglang_contract.py.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from contextlib import suppress
from typing import Optional

import httpx

from nanoverl_async.config import LoRAConfig, SGLangConfig
from nanoverl_async.reaper import Reaper, signal_group
from nanoverl_async.wire.sglang_http import SGLangClient, SGLangError

log = logging.getLogger(__name__)

HEALTH_POLL_S = 0.2
LORAS_PER_BATCH = 8  # SGLang's default: the adapters of the versions still in flight, within the staleness bound


class SGLangServer(SGLangClient):
    """A client (nanoverl_async/wire/sglang_http.py) of a server this process launches, watches and restarts."""

    def __init__(self, model_path: str, port: int, cfg: SGLangConfig, *, command: Optional[list[str]] = None,
                 url: str = "", seed: int = 0, dtype: str = "auto", lora: Optional[LoRAConfig] = None):
        super().__init__(url or f"http://{cfg.host}:{port}", cfg.control_timeout_s, tp_size=cfg.tp_size)
        self.model_path = model_path
        self.port = port
        self.cfg = cfg
        self.version = 0  # the weights version this server holds
        # generator.sglang.server_command, else SGLang's own launcher; a given url is not ours to launch
        default = [] if url else list(cfg.server_command) or [sys.executable, "-m", "sglang.launch_server"]
        self.command = command if command is not None else default
        self.seed = seed
        self.dtype = dtype
        self.lora = lora
        self.process: Optional[subprocess.Popen] = None
        self._watcher: Optional[Reaper] = None  # ends the server's group if this process dies
        self.restarts = 0

    # --- process ---------------------------------------------------------------------------------
    def launch_args(self) -> list[str]:
        cfg = self.cfg
        return [*self.command, "--model-path", self.model_path, "--host", cfg.host, "--port", str(self.port),
                "--tp-size", str(cfg.tp_size), "--mem-fraction-static", str(cfg.mem_fraction_static),
                "--weight-version", str(self.version), "--random-seed", str(self.seed), "--dtype", self.dtype,
                "--skip-server-warmup", *self.lora_args(), *cfg.server_args]

    def lora_args(self) -> list[str]:
        """SGLang's multi-LoRA serving, sized for learner.lora: its rank, its layers (PEFT's all-linear is
        SGLang's all), and room in a batch for the base and the adapters of the versions in flight."""
        if self.lora is None:
            return []
        targets = ["all"] if list(self.lora.target_modules) == ["all-linear"] else list(self.lora.target_modules)
        return ["--enable-lora", "--max-lora-rank", str(self.lora.rank), "--lora-target-modules", *targets,
                "--max-loras-per-batch", str(LORAS_PER_BATCH)]

    def launch(self) -> None:
        """Start the server process (if ours to start), watched (reaper.py)."""
        if self.process is None and self.command:
            args = self.launch_args()
            log.info("starting SGLang server: %s", " ".join(args))
            self.process = subprocess.Popen(args, start_new_session=True)  # leads its own group
            self._watcher = Reaper(group=self.process.pid)

    def wait_ready(self) -> None:
        """Wait for GET /health == 200, then read the server's version to pick the protocol variant."""
        timeout_s = self.cfg.launch_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise SGLangError(f"SGLang server {self.url} exited with code {self.process.returncode} "
                                  "while starting (see its log above)")
            with suppress(httpx.TransportError):  # not listening yet
                if self._http.get(self.url + "/health", timeout=min(30.0, timeout_s)).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SGLangError(f"SGLang server {self.url} not healthy within {timeout_s:.0f} s")
            time.sleep(HEALTH_POLL_S)
        self.detect_protocol()

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def restart(self, model_path: str) -> None:
        """Kill (if needed) and relaunch with `model_path` (the newest weights) at version `self.version`."""
        self.stop()
        self.model_path = model_path
        self.restarts += 1
        log.warning("restarting SGLang server %s (restart %d) with %s, version %d",
                    self.url, self.restarts, model_path, self.version)
        self.launch()
        self.wait_ready()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `timeout_s`, then SIGKILL what is left of
        it (children that outlived the server); then its watcher leaves."""
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
        if self._watcher is not None:
            self._watcher.release()
            self._watcher = None

    def close(self) -> None:
        self.stop()
        super().close()

    # --- weights (transport disk; the other control calls are SGLangClient's) -------------------
    def load_lora(self, name: str, path: str) -> None:
        """Load PEFT's adapter folder at `path` as adapter `name` (SGLang's /load_lora_adapter)."""
        self.post("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora(self, name: str) -> None:
        self.post("/unload_lora_adapter", {"lora_name": name})

    def update_from_disk(self, model_path: str, version: int) -> None:
        """Load a Hugging Face directory as weights `version` (the old weights stay on failure)."""
        self.post("/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version),
                                                "abort_all_requests": False, "flush_cache": True})
        self.model_path, self.version = model_path, version
