"""The SGLang HTTP calls both roles make, below both: generators (which launch the servers) and learner
rank 0 (which loads weights into them over NCCL) each hold `SGLangClient`s and never import each other.

    client = SGLangClient("http://10.0.0.2:30000", timeout_s=60.0)
    client.detect_protocol()                 # GET /server_info -> version -> which variant to speak
    with paused([client], "abort"):          # /pause_generation ... /continue_generation, even on errors
        client.begin_update(); ...; client.end_update()

Generators subclass it (generators/sglang_server.py: a server they launch); learner rank 0 holds plain
clients (learners/sglang_nccl.py). `checked` turns any reply into a parsed body or an SGLangError, for
the engine's own `/generate` calls too.

Invariants (docs/sglang.md "Version differences"):
  - every call has a timeout (`timeout_s`) and fails loudly: `SGLangError` names the server, the
    endpoint, the status and the body; a reply with `success: false` is a failure too;
  - SGLang 0.5.10 or newer (older servers are refused); the variant follows the server's own version:
    from 0.5.23 distributed/tensor updates sit between `/begin_weight_update` and `/end_weight_update`
    (`legacy_protocol` = no wrap).
Run alone: `python -m pytest tests/test_sglang_contract.py -q` (fake servers).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Optional

import httpx


class SGLangError(RuntimeError):
    """An SGLang server refused a call, timed out, or died; the message names which and why."""


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.5.10.post1' -> (0, 5, 10); anything unparsable sorts as the newest protocol."""
    parts = [re.sub(r"\D", "", piece) for piece in str(text).split(".")[:3]]
    return tuple(map(int, parts)) if all(parts) else (99,)


class SGLangClient:
    def __init__(self, url: str, timeout_s: float, *, tp_size: int = 1, server_version: str = "",
                 legacy_protocol: Optional[bool] = None):
        self.url = url
        self.timeout_s = timeout_s
        self.tp_size = tp_size
        self.server_version = server_version
        self.legacy_protocol = legacy_protocol  # None = decide from the server's version
        self._http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def post(self, path: str, body: Optional[dict] = None, check_success: bool = True):
        """POST JSON; the parsed reply. A non-200 status or `success: false` raises SGLangError."""
        return self._call("POST", path, body, check_success)

    def get(self, path: str):
        return self._call("GET", path, None, False)

    def _call(self, method: str, path: str, body: Optional[dict], check_success: bool):
        try:
            reply = self._http.request(method, self.url + path, json=body)
        except httpx.TimeoutException as error:
            raise SGLangError(f"{self.url}{path}: no reply within {self.timeout_s:.0f} s") from error
        except httpx.TransportError as error:
            raise SGLangError(f"{self.url}{path}: {type(error).__name__}: {error}") from error
        return checked(reply, self.url + path, check_success)

    def detect_protocol(self) -> None:
        """Read the server's version (`GET /server_info`) and, unless forced, pick the protocol variant."""
        self.server_version = str(self.get("/server_info").get("version", ""))
        if version_tuple(self.server_version) < (0, 5, 10):  # 0.5.2 pauses without a mode, reads versions elsewhere
            raise SGLangError(f"{self.url} runs SGLang {self.server_version}; nanoverl-async needs 0.5.10 or newer")
        if self.legacy_protocol is None:
            self.legacy_protocol = version_tuple(self.server_version) < (0, 5, 23)

    def pause(self, mode: str) -> None:
        """Stop generation: `abort` returns in-flight requests with their partial tokens (once drained);
        `retract` keeps their HTTP calls open and finishes them after `resume`."""
        self.post("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self.post("/continue_generation", {})

    def weight_version(self) -> str:
        """The weights version the server holds."""
        return str(self.get("/model_info")["weight_version"])

    def begin_update(self) -> None:
        if not self.legacy_protocol:
            self.post("/begin_weight_update", {"selector": "all"})

    def end_update(self) -> None:
        if not self.legacy_protocol:
            self.post("/end_weight_update", {})


@contextmanager
def paused(clients: list[SGLangClient], mode: str):
    """Every server paused (`mode`) inside the block; after it, even on an error, every one continued
    (continue on a running server is a no-op), so no token is sampled from half-updated weights."""
    try:
        for client in clients:
            client.pause(mode)
        yield
    finally:
        for client in clients:
            client.resume()


def checked(reply: httpx.Response, where: str, check_success: bool = False):
    """The parsed reply (JSON, else text); a non-200 status, or `success: false` if checked, raises SGLangError."""
    parsed = reply.json() if "json" in reply.headers.get("content-type", "") else reply.text
    if reply.status_code != 200 or (check_success and isinstance(parsed, dict) and parsed.get("success") is False):
        raise SGLangError(f"{where} answered {reply.status_code}: {reply.text[:500]}")
    return parsed
