"""A protocol-faithful fake of SGLang's native HTTP server (docs/sglang.md "Contract checks").

Backed by the transformers engine, so tokens and logprobs are real: each request samples one token per
engine call (`max_new_tokens=1` on the whole sequence so far), and concurrent requests batch inside the
engine. Between two tokens a request checks for abort, pause and retract, which gives SGLang's
semantics at token granularity:
  - pause `abort`: running and waiting requests end with finish_reason abort and their partial tokens;
    the pause call returns once they have; new /generate calls wait until /continue_generation;
  - pause `retract` / `in_place`: requests park between tokens (HTTP kept open) and go on after continue,
    under whatever weights were loaded meanwhile: `meta_info.weight_versions` then has two spans;
  - weight updates take a writer lock when not paused (wait for in-flight requests, or abort them with
    `abort_all_requests`); `--fake-version` picks 0.5.2/0.5.10/0.5.23 (docs/sglang.md "Version differences").
`/update_weights_from_distributed` receives its tensors from rank 0 of the group `/init_weights_update_group`
made. As a process (`real_groups`), the fake really joins that group with the body's backend (gloo on a
CPU; learners/sglang_nccl.py's `init_custom_process_group`, as SGLang does) and receives the broadcasts; in
process, it takes them from `server.nccl`, a queue a test fills in broadcast order (the sender's `broadcast`
hook). `--fake-events FILE` appends one JSON line per weight update (tests check what really loaded).
`--enable-lora --max-lora-rank R`: SGLang's LoRA adapter loading, `lora_path` per request (fake_sglang_lora.py).
Greedy (temperature 0) is approximated by temperature 1e-4.

In-process: `server = FakeSGLangServer(model_dir); server.start(); ...; server.stop()`.
As a process (same flags as `python -m sglang.launch_server`, unknown ones ignored):
    python tests/fake_sglang_server.py --model-path DIR --port 30000 --weight-version 0 [--fake-version 0.5.10]
        [--fake-events FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from fake_sglang_generate import GenerateMixin
from fake_sglang_lora import LoRAMixin

VERSIONS = ("0.5.2", "0.5.10", "0.5.23")
BEGIN_END_MESSAGE = "{} must run between begin_weight_update() and end_weight_update()"
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")
WAIT_S = 0.002


class HTTPError(Exception):
    def __init__(self, status: int, body, content_type: str = "application/json"):
        super().__init__(status, body)
        self.status, self.body, self.content_type = status, body, content_type


def value_error(message: str) -> HTTPError:  # a handler ValueError: {"error": {"message": ...}}
    return HTTPError(400, {"error": {"message": message}})


class FakeSGLangServer(GenerateMixin, LoRAMixin):
    def __init__(self, model_path: str, *, host: str = "127.0.0.1", port: int = 0, weight_version: str = "default",
                 fake_version: str = "0.5.23", max_running_requests: int = 1 << 20, seed: int = 0):
        assert fake_version in VERSIONS, fake_version
        self.model_path, self.weight_version, self.fake_version = model_path, str(weight_version), fake_version
        self.max_running_requests, self.seed = max_running_requests, seed
        self.token_delay_s = 0.0  # tests slow decoding down to catch requests in flight
        self.ready = False
        self.paused = None  # None | "abort" | "retract" | "in_place"
        self.updating = False  # the writer lock is held: new requests wait
        self.in_begin = False
        self.groups: dict[str, dict] = {}
        self.requests: dict = {}  # rid -> _Request, running or waiting
        self.lock = threading.Lock()
        self.nccl: "queue.Queue[torch.Tensor]" = queue.Queue()  # the fake broadcast (see the docstring)
        self.real_groups = False  # join /init_weights_update_group's process group for real (see the docstring)
        self.events_path = ""  # append a JSON line per weight update here
        self.calls: list[str] = []  # every path served, in order (tests check the protocol sequence)
        self.loop = asyncio.new_event_loop()
        self.httpd = _HTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"

    def start(self, load: bool = True) -> "FakeSGLangServer":
        threading.Thread(target=self.loop.run_forever, daemon=True, name="fake-sglang-loop").start()
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="fake-sglang-http").start()
        if load:
            self.load()
        return self

    def load(self) -> None:
        from nanoverl_async.generators.builtin_engine import BuiltinEngine

        torch.set_num_threads(1)
        self.engine = BuiltinEngine(self.model_path, seed=self.seed)
        self.eos_ids = set(_as_list(getattr(self.engine.model.config, "eos_token_id", None)))
        self.context_length = int(getattr(self.engine.model.config, "max_position_embeddings", 1 << 30))
        self.ready = True

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.loop.call_soon_threadsafe(self.loop.stop)

    def on_loop(self, coroutine, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    # --- routing -------------------------------------------------------------------------------------
    def handle(self, method: str, path: str, body):
        self.calls.append(path)
        if path in ("/health", "/health_generate", "/ready"):
            return (200, b"", "text/plain") if self.ready else (503, b"", "text/plain")
        if not self.ready:
            raise HTTPError(503, {"error": {"message": "server is starting"}})
        if path in ("/generate",) and method in ("POST", "PUT"):
            return self.generate_endpoint(body)
        if path == "/flush_cache":
            return self.flush_cache()
        if method == "GET":
            return 200, self.get_endpoint(path)
        handler = {
            "/pause_generation": self.pause, "/continue_generation": self.continue_generation,
            "/abort_request": self.abort_request, "/update_weights_from_disk": self.update_from_disk,
            "/update_weight_version": self.update_weight_version,
            "/init_weights_update_group": self.init_group, "/destroy_weights_update_group": self.destroy_group,
            "/update_weights_from_distributed": self.update_from_distributed,
            "/update_weights_from_tensor": self.update_from_tensor,
            "/begin_weight_update": self.begin_update, "/end_weight_update": self.end_update,
            "/load_lora_adapter": self.load_lora, "/unload_lora_adapter": self.unload_lora,
            "/release_memory_occupation": lambda b: None, "/resume_memory_occupation": lambda b: None,
        }.get(path)
        if handler is None or (path in ("/begin_weight_update", "/end_weight_update") and not self.v23):
            raise HTTPError(404, {"detail": "Not Found"})
        return 200, handler(body or {})

    @property
    def v23(self) -> bool:
        return self.fake_version == "0.5.23"

    def get_endpoint(self, path: str):
        info = {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version}
        if path == "/get_model_info" or (path == "/model_info" and self.fake_version != "0.5.2"):
            return info if path == "/get_model_info" and self.fake_version == "0.5.2" else {
                **info, "served_model_name": self.model_path, "load_format": "auto", "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"], "has_image_understanding": False}
        if path == "/get_weight_version" and self.fake_version == "0.5.2":
            return {"weight_version": self.weight_version}
        if path in ("/server_info", "/get_server_info"):
            return {"model_path": self.model_path, "port": self.port, "version": self.fake_version,
                    "internal_states": [{}], "max_running_requests": self.max_running_requests}
        raise HTTPError(404, {"detail": "Not Found"})

    # --- control -------------------------------------------------------------------------------------
    def wait_until(self, condition, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise HTTPError(500, {"error": {"message": "fake server: timed out waiting"}})
            time.sleep(WAIT_S)

    def pause(self, body: dict):
        mode = "abort" if self.fake_version == "0.5.2" else body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPError(400, {"object": "error", "message": f"mode: invalid value {mode!r}",
                                  "type": "Bad Request", "param": None, "code": 400})
        self.paused = mode
        if mode == "abort":  # in-flight requests end with their partial tokens; new ones wait for continue
            aborted = self.abort_matching(lambda rid: True)
            self.wait_until(lambda: all(r.done for r in aborted))
        else:
            self.wait_until(lambda: all(r.parked or r.waiting or r.done for r in list(self.requests.values())))
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict):
        self.paused = None
        return {"message": "Generation continued successfully.", "status": "ok"}

    def abort_matching(self, match) -> list:
        """Mark matching requests aborted; returns them (callers may wait for them to end)."""
        with self.lock:
            hit = [request for rid, request in self.requests.items() if match(rid)]
        for request in hit:
            request.aborted = True
        return hit

    def abort_request(self, body: dict):
        rid = body.get("rid") or ""
        self.abort_matching(lambda r: body.get("abort_all") or (rid and r.startswith(rid)))
        return b""

    def flush_cache(self):
        busy = any(not r.parked for r in list(self.requests.values())) if self.paused != "retract" else False
        if self.paused == "in_place" or busy:
            return 400, b"Cache not flushed: requests running or queued.\n", "text/plain"
        return 200, FLUSHED.encode(), "text/plain"

    def writer_lock(self, body: dict) -> None:
        """Not paused: wait for in-flight requests (or abort them); new requests wait meanwhile."""
        if self.paused is not None:
            return
        self.updating = True
        with self.lock:
            in_flight = [r for r in self.requests.values() if not r.waiting]
        if body.get("abort_all_requests"):
            self.abort_matching(lambda rid: True)
        self.wait_until(lambda: all(r.done for r in in_flight))

    def finish_update(self, body: dict, version) -> dict:
        self.updating = False
        if version is not None:
            self.weight_version = str(version)
        if body.get("flush_cache", True) and self.paused == "in_place":
            raise HTTPError(400, {"success": False, "message": "Weights were updated, but the cache was not "
                                  "flushed because requests are running in in_place pause mode."})
        return {"success": True, "message": f"Succeeded to update model weights. Weight version updated to "
                f"{self.weight_version}.", "num_paused_requests": 0}

    def update_from_disk(self, body: dict):
        self.writer_lock(body)
        try:
            from transformers import AutoModelForCausalLM

            state = AutoModelForCausalLM.from_pretrained(body["model_path"]).state_dict()
            self.on_loop(self._load(state, body.get("weight_version"), strict=True))
        except Exception as error:  # the old weights stay loaded
            self.updating = False
            raise HTTPError(400, {"success": False, "message": f"Failed to update weights: {error}"}) from None
        self.model_path = body["model_path"]
        self.record({"update": "disk", "version": body.get("weight_version")})
        return self.finish_update(body, body.get("weight_version"))

    async def _load(self, state: dict, version, strict: bool) -> None:
        number = int(version) if str(version).isdigit() else self.engine.version
        if strict:
            self.engine.stage_weights(state, number)
        else:  # one bucket of a distributed update
            self.engine.model.load_state_dict(state, strict=False)
            self.engine.version = number

    def update_weight_version(self, body: dict):
        if body.get("abort_all_requests", True):
            self.abort_matching(lambda rid: True)
        self.weight_version = str(body["new_version"])
        return {"success": True, "message": f"Weight version updated to {self.weight_version}",
                "new_version": self.weight_version}

    def init_group(self, body: dict):
        group = {**body, "master_port": int(body["master_port"])}  # AReaL sends a str
        if self.real_groups:  # blocks until rank 0 (the trainer) joins, as SGLang's does
            from nanoverl_async.learners.sglang_nccl import init_custom_process_group

            try:
                group["pg"] = init_custom_process_group(
                    body.get("backend", "nccl"), f"tcp://{body['master_address']}:{group['master_port']}",
                    body["world_size"], body["rank_offset"], body["group_name"], timeout_s=60)
            except Exception as error:
                raise HTTPError(400, {"success": False, "message": f"Failed to init group: {error}"}) from None
        self.groups[body["group_name"]] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict):
        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is not None and group.get("pg") is not None:
            torch.distributed.destroy_process_group(group["pg"])
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def begin_update(self, body: dict):
        if self.in_begin:
            raise HTTPError(400, {"success": False, "message": "begin_weight_update called twice"})
        self.in_begin = True
        return {"success": True, "message": "Success"}

    def end_update(self, body: dict):
        if not self.in_begin:
            raise HTTPError(400, {"success": False, "message": "end_weight_update called without begin"})
        self.in_begin = False
        return {"success": True, "message": "Success"}

    def check_begin(self, endpoint: str) -> None:
        if self.v23 and not self.in_begin:
            raise HTTPError(400, {"success": False, "message": BEGIN_END_MESSAGE.format(endpoint)})

    def update_from_tensor(self, body: dict):
        self.check_begin("update_weights_from_tensor")
        raise HTTPError(400, {"success": False, "message": "fake server: tensor payloads are CUDA IPC handles"})

    def update_from_distributed(self, body: dict):
        self.check_begin("update_weights_from_distributed")
        if body.get("group_name", "weight_update_group") not in self.groups:
            raise HTTPError(400, {"success": False, "message": "process group not initialized"})
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        params = self.engine.model.state_dict()
        problems = [n for n, d, s in zip(names, dtypes, shapes) if n not in params or not isinstance(
            getattr(torch, d, None), torch.dtype) or list(params[n].shape) != list(s)]
        if problems or not len(names) == len(dtypes) == len(shapes):
            raise HTTPError(400, {"success": False, "message": f"bad names/dtypes/shapes: {problems[:3]}"})
        self.writer_lock(body)
        group = self.groups[body.get("group_name", "weight_update_group")].get("pg")
        state = {}
        for name, dtype, shape in zip(names, dtypes, shapes):  # broadcast from rank 0, in order
            if group is not None:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                torch.distributed.broadcast(tensor, src=0, group=group)
            else:
                tensor = self.nccl.get(timeout=30)
            assert tensor.dtype == getattr(torch, dtype) and list(tensor.shape) == list(shape), name
            state[name] = tensor
        self.on_loop(self._load(state, body.get("weight_version"), strict=False))
        self.record({"update": "distributed", "version": body.get("weight_version"), "tensors": len(names),
                     "backend": self.groups[body.get("group_name", "weight_update_group")].get("backend")})
        return self.finish_update(body, body.get("weight_version"))

    def record(self, event: dict) -> None:
        if self.events_path:
            with open(self.events_path, "a") as events:  # one short append per line: servers may share a file
                events.write(json.dumps({"port": self.port, **event}) + "\n")


class _HTTPServer(ThreadingHTTPServer):
    # SGLang (uvicorn) listens with a backlog of 2048. socketserver's 5 overflows when a pause aborts many
    # requests and their clients resubmit at once, and an overflowed connection can be reset mid-request.
    request_queue_size = 2048


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _handler(server: FakeSGLangServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _serve(self, method: str):
            try:
                self._answer(method)
            except (BrokenPipeError, ConnectionResetError):  # the client went away (a cancelled request)
                pass

        def _answer(self, method: str):
            path = self.path.split("?")[0]
            try:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw.strip() else None
                result = server.handle(method, path, body)
            except HTTPError as error:
                result = (error.status, error.body, error.content_type)
            except json.JSONDecodeError as error:
                result = (400, {"object": "error", "message": str(error), "type": "Bad Request",
                                "param": None, "code": 400})
            if callable(result):  # a stream writes itself
                return result(self)
            status, payload = result[0], result[1]
            content_type = result[2] if len(result) > 2 else "application/json"
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def do_PUT(self):
            self._serve("PUT")

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--fake-version", default="0.5.23")
    parser.add_argument("--fake-token-delay-s", type=float, default=0.0)
    parser.add_argument("--fake-events", default="")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=0)
    args, _ = parser.parse_known_args()
    server = FakeSGLangServer(args.model_path, host=args.host, port=args.port, weight_version=args.weight_version,
                              fake_version=args.fake_version, seed=args.random_seed)
    server.token_delay_s, server.events_path, server.real_groups = args.fake_token_delay_s, args.fake_events, True
    server.lora_enabled, server.max_lora_rank = args.enable_lora, args.max_lora_rank
    server.start(load=False)  # /health answers 503 until the model is loaded
    server.load()
    print(f"fake sglang {args.fake_version} ready at {server.url} {uuid.uuid4().hex[:4]}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
