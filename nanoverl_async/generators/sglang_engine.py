"""The `Engine` protocol (agents/engine.py) on a pool of SGLang servers, driven over SGLang's native HTTP API.

    engine = SGLangEngine(model_dir, SGLangConfig(servers=2), generator_id=0)   # launches, waits /health
    completion = await engine.generate(prompt_ids, SamplingParams(64, 1.0, (eos,)), episode_id="g3-s1")
    engine.stage_weights(state_dict, version=4)   # pause, update_weights_from_disk, continue

Requests (docs/sglang.md "Generation"): `POST /generate` with `input_ids`,
`return_logprob: true`, `stream: false`. Tokens and logprobs come from `meta_info.output_token_logprobs`
(`[logprob, token, null]`, the log softmax of logits / temperature before top-p/top-k, i.e. the
behaviour logprob the loss wants). Versions per token come from `meta_info.weight_versions` spans where
the server returns them (0.5.23), else from `meta_info.weight_version` of that reply, else this engine's
version when the reply arrived (client-side tagging; exact only in abort mode, where one reply never spans
two versions).

Invariants:
  - an aborted reply (`finish_reason.type == "abort"`, HTTP 200, e.g. from `/pause_generation` abort mode)
    is resumed: its partial tokens are appended to `input_ids`, `max_new_tokens` drops by their count,
    their logprobs and versions are kept, and the rest is requested again from the same server (the new
    request blocks server-side until `/continue_generation`);
  - routing: an `episode_id` seen before goes to the same server (its prefix cache holds the episode's
    history); otherwise the server with the fewest outstanding requests;
  - a server whose process died is restarted once per failure (newest weights, current version) and its
    in-flight requests are re-issued from their partial tokens; an external or living server that drops
    a connection, or any call past its timeout, raises `SGLangError` (fail loudly);
  - like every engine: the stop token is kept and finishes with "stop"; SGLang also stops at the model's
    own EOS tokens (also "stop").

Weights: `stage_weights` (transport disk) writes a Hugging Face directory (safetensors + the base model's
config and tokenizer files; a shard per bucket of a version, wire/buckets.py) and, once a version's last bucket
is written, runs pause -> `/update_weights_from_disk` -> continue on every server. It
blocks the caller for the update's duration (it is called between decode steps by the worker).
With LoRA (`lora`, learner.lora): a version is its adapters. `stage_weights` writes PEFT's adapter folder and
loads it on every server as `v{version}` (`/load_lora_adapter`; the servers run with `--enable-lora`, SGLang's
multi-LoRA serving), without a pause: a request names the adapter of the version current when it was sent
(`lora_path`), and its tokens carry that version, so a segment never spans two versions; the next segment or
turn names the newest. Adapters no request names any more are unloaded at the next version.
Transport nccl: learner rank 0 loads each version into these servers itself (`update_weights_from_distributed`,
learners/sglang_nccl.py; `endpoints` tells it where they are), then publishes a version notice (an empty
state dict): `stage_weights` only records that version, after checking a server holds it. A server that
dies under nccl is not restarted (it could not rejoin rank 0's group): the generator fails, naming it.
Run alone: `python -m pytest tests/test_sglang_contract.py -q` (fake servers).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import json
import os
import shutil
import tempfile
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple, Optional

import httpx
import torch
from safetensors.torch import save_file

from nanoverl_async.config import LoRAConfig, SGLangConfig
from nanoverl_async.agents.engine import Completion, SamplingParams
from nanoverl_async.generators.sglang_server import SGLangServer
from nanoverl_async.wire.sglang_http import SGLangError, checked, paused
from nanoverl_async.models.lora import gathered, save_adapter

STICKY_EPISODES = 65_536  # episode -> server entries kept (oldest forgotten first)
MAX_EMPTY_RESUMES = 1_000  # consecutive aborted replies without a token before giving up
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


class SGLangEngine:
    def __init__(self, model_path: str, cfg: SGLangConfig, *, generator_id: int = 0, seed: int = 0, dtype: str = "auto",
                 servers: Optional[list[SGLangServer]] = None, start: bool = True, lora: Optional[LoRAConfig] = None):
        self.cfg = cfg
        self.base_model_path = model_path
        self.version = 0
        self.lora = lora
        self.adapter: Optional[str] = None  # with LoRA, the adapter new requests name (None: the base, version 0)
        self.adapter_requests: dict[str, int] = {}  # requests in flight per adapter, current or not
        self._adapter_parts: dict[str, torch.Tensor] = {}  # the loading version's adapters so far
        # The servers are this process's children, on this node: a local directory is enough.
        root = cfg.weights_dir or os.path.join(tempfile.gettempdir(), f"nanoverl_sglang_{os.getpid()}")
        self.weights_dir = Path(root) / f"generator_{generator_id}"
        if servers is None:
            # sglang is an optional extra, never imported (a server_command launches something else)
            if not cfg.server_command and importlib.util.find_spec("sglang") is None:
                raise SGLangError("generator.engine=sglang needs `pip install -e '.[sglang]'` on a GPU machine")
            servers = [SGLangServer(model_path, cfg.port_base + generator_id * cfg.servers + i, cfg,
                                    seed=seed * 1_000 + i, dtype=dtype, lora=lora) for i in range(cfg.servers)]
        self.servers = servers
        self.outstanding = [0] * len(servers)
        self.latest_path = model_path  # the weights a restarted server loads
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._clients: dict[int, httpx.AsyncClient] = {}  # one per event loop
        self._restart_locks: dict[int, asyncio.Lock] = {}
        atexit.register(self.close)  # never leave server processes behind a normal exit
        if start:
            for server in servers:  # launch all first: model loading overlaps
                server.launch()
            for server in servers:
                server.wait_ready()

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def endpoints(self, node_ip: str = "") -> list[dict]:
        """Where the servers listen and which protocol they speak, for learner rank 0's weight-update
        group (sglang_nccl.server_handles). A server bound to every interface is reached at `node_ip`."""
        return [{"url": s.url.replace("://0.0.0.0:", f"://{node_ip}:") if node_ip else s.url,
                 "tp_size": s.tp_size, "server_version": s.server_version,
                 "legacy_protocol": s.legacy_protocol, "node_ip": node_ip} for s in self.servers]

    # --- generation --------------------------------------------------------------------------------
    def route(self, episode_id: Optional[str]) -> int:
        """The episode's server if it has one, else the least busy (ties: the lowest index)."""
        if episode_id in self._sticky:
            self._sticky.move_to_end(episode_id)
            return self._sticky[episode_id]
        index = min(range(len(self.servers)), key=lambda i: self.outstanding[i])
        if episode_id is not None:
            self._sticky[episode_id] = index
            if len(self._sticky) > STICKY_EPISODES:
                self._sticky.popitem(last=False)
        return index

    async def generate(self, input_ids: list[int], params: SamplingParams, *,
                       episode_id: Optional[str] = None) -> Completion:
        if len(input_ids) == 0:
            raise ValueError("generate needs at least one input token")
        index, input_ids = self.route(episode_id), list(input_ids)
        completion = Completion()
        rid = f"{episode_id or 'req'}-{uuid.uuid4().hex[:12]}"
        segment = 0
        empty = 0
        self.outstanding[index] += 1
        try:
            while True:
                remaining = params.max_new_tokens - len(completion.token_ids)
                if remaining <= 0:  # a resumed request whose partial tokens already used the whole budget
                    completion.finish_reason = "length"
                    return completion
                body = {"rid": f"{rid}-{segment}", "input_ids": input_ids + completion.token_ids,
                        "return_logprob": True, "stream": False,
                        "sampling_params": {"max_new_tokens": remaining, "temperature": params.temperature,
                                            "top_p": 1.0, "top_k": -1, "stop_token_ids": list(params.stop_token_ids),
                                            "skip_special_tokens": False, "no_stop_trim": True}}
                segment += 1
                adapter, version = self.adapter, self.version
                if adapter is not None:
                    body["lora_path"] = adapter
                reply = await self._post_adapted(index, body, adapter)
                if reply is None:  # the server was restarted: re-issue from the partial tokens
                    continue
                tokens, logprobs, versions, finish = parse_reply(reply, self.version)
                if self.lora is not None:  # the server's own version is its base's: the adapter's is the one
                    versions = [version] * len(tokens)
                completion.token_ids += tokens
                completion.logprobs += logprobs
                completion.versions += versions
                if finish != "abort":
                    completion.finish_reason = finish
                    return completion
                empty = 0 if tokens else empty + 1
                if empty > MAX_EMPTY_RESUMES:
                    raise SGLangError(f"{self.servers[index].url}: request {rid} aborted {empty} times without a "
                                      "token")
        finally:
            self.outstanding[index] -= 1

    def in_flight(self) -> int:
        return sum(self.outstanding)

    async def _post_adapted(self, index: int, body: dict, adapter: Optional[str]) -> Optional[dict]:
        """`_post_generate`, counting the request against its adapter meanwhile (an adapter in use stays loaded)."""
        if adapter is not None:
            self.adapter_requests[adapter] = self.adapter_requests.get(adapter, 0) + 1
        try:
            return await self._post_generate(index, body)
        finally:
            if adapter is not None:
                self.adapter_requests[adapter] -= 1

    async def _post_generate(self, index: int, body: dict) -> Optional[dict]:
        """The parsed reply, or None after restarting a server that died under the request."""
        server = self.servers[index]
        restarts, loop_id = server.restarts, id(asyncio.get_running_loop())
        if loop_id not in self._clients:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
            self._clients[loop_id] = httpx.AsyncClient(timeout=self.cfg.request_timeout_s, limits=limits)
        try:
            response = await self._clients[loop_id].post(server.url + "/generate", json=body)
        except httpx.TimeoutException as error:
            raise SGLangError(f"{server.url}/generate: no reply within {self.cfg.request_timeout_s:.0f} s "
                              f"(rid {body['rid']})") from error
        except httpx.TransportError as error:
            if not await self._restart_if_dead(index, restarts):
                raise SGLangError(f"{server.url}/generate: {type(error).__name__}: {error} "
                                  f"(rid {body['rid']})") from error
            return None
        return checked(response, server.url + "/generate")

    async def _restart_if_dead(self, index: int, restarts_seen: int) -> bool:
        """Restart server `index` if its process has exited (once, however many requests saw it die)."""
        server = self.servers[index]
        lock = self._restart_locks.setdefault(index, asyncio.Lock())
        async with lock:
            if server.restarts != restarts_seen:  # another request restarted it meanwhile
                return True
            if server.process is None:
                return False  # not ours to restart
            for _ in range(50):  # a dropped connection may come just before the exit is visible
                if not server.alive():
                    break
                await asyncio.sleep(0.1)
            if server.alive():
                return False
            if self.cfg.weight_transport == "nccl":  # a fresh server would serve the base weights forever
                raise SGLangError(f"SGLang server {server.url} died (exit code {server.process.returncode}); with "
                                  "generator.sglang.weight_transport=nccl a restarted server cannot rejoin learner "
                                  "rank 0's weight-update group and would serve stale weights. Restart the run, or use "
                                  "generator.sglang.weight_transport=disk (servers restart with the newest weights)")
            await asyncio.to_thread(server.restart, self.latest_path)
            if self.adapter is not None:  # a restarted server holds the base alone: requests re-issued name this one
                await asyncio.to_thread(server.load_lora, self.adapter, str(self.weights_dir / self.adapter))
            return True

    # --- weights -----------------------------------------------------------------------------------
    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int, bucket: tuple[int, int] = (0, 1)
                      ) -> None:
        """Write `state_dict`, bucket (index, count) of `version`, as one shard of a Hugging Face directory, and
        once its last bucket is written load it on every server as `version` (the servers never see part of a
        version); with transport nccl, take `version` as loaded already (a version notice: `state_dict` is empty);
        with LoRA, the buckets hold the version's adapters, loaded once the last is in (module docstring)."""
        if self.lora is not None:
            if (adapters := gathered(self._adapter_parts, state_dict, bucket)) is not None:
                self.stage_adapter(adapters, version)
            return
        if self.cfg.weight_transport != "nccl":
            path = self.weights_dir / f"v{version}"
            if bucket[0] == 0:  # a version started and abandoned (a bucket lost on the way) is never loaded
                for stale in self.weights_dir.glob("v*"):
                    if str(stale) != self.latest_path:
                        shutil.rmtree(stale, ignore_errors=True)
            write_hf_dir(state_dict, self.base_model_path, path, bucket)
            if bucket[0] == bucket[1] - 1:
                self.update_from_disk(str(path), version)
            return
        # nccl: learner rank 0 loaded `version` into the servers before publishing this notice. One server is
        # asked, so a notice never runs ahead of the weights it names.
        if state_dict:
            raise ValueError(f"generator.sglang.weight_transport=nccl: stage_weights takes version notices (an "
                             f"empty state dict), got {len(state_dict)} tensors for version {version}")
        held = self.servers[0].weight_version()
        if _number(held, -1) < version:  # rank 0 may have loaded a newer one meanwhile, never an older one
            raise SGLangError(f"{self.servers[0].url} holds weights version {held!r}, but learner rank 0 announced "
                              f"version {version} as loaded (weight_transport=nccl)")
        self.version = version

    def stage_adapter(self, adapters: dict[str, torch.Tensor], version: int) -> None:
        """Load `adapters` on every server as adapter `v{version}`, which new requests then name; unload (and
        delete) the older adapters no request in flight names. A failed load leaves the current adapter current."""
        name = f"v{version}"
        save_adapter(adapters, self.lora, self.base_model_path, str(self.weights_dir / name))
        for server in self.servers:
            server.load_lora(name, str(self.weights_dir / name))
        old = self.adapter
        self.adapter = name
        self.version = version
        unused = [adapter for adapter, count in self.adapter_requests.items() if count == 0 and adapter != name]
        for adapter in unused + ([old] if old is not None and old not in self.adapter_requests else []):
            for server in self.servers:
                server.unload_lora(adapter)
            shutil.rmtree(self.weights_dir / adapter, ignore_errors=True)
            self.adapter_requests.pop(adapter, None)

    def update_from_disk(self, path: str, version: int) -> None:
        """pause (cfg.pause_mode) -> /update_weights_from_disk -> continue, on every server."""
        with paused(self.servers, self.cfg.pause_mode):  # a failed update still continues every server
            for server in self.servers:
                server.update_from_disk(path, version)
        old = self.latest_path
        self.latest_path = path
        self.version = version
        if old != self.base_model_path and Path(old).parent == self.weights_dir:
            shutil.rmtree(old, ignore_errors=True)  # keep only the newest written version


class Reply(NamedTuple):
    """What one /generate reply brought: its tokens with their logprobs and versions, and the finish type."""
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str  # finish_reason.type; "abort": a pause stopped it, to be resumed from its tokens


def parse_reply(reply: dict, fallback_version: int) -> Reply:
    """A /generate reply, checked (docs/sglang.md "Generation")."""
    meta = reply["meta_info"]
    triples = meta.get("output_token_logprobs") or []
    tokens = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    if "output_ids" in reply and list(reply["output_ids"]) != tokens:
        raise SGLangError(f"reply {meta.get('id')}: output_ids and output_token_logprobs disagree")
    return Reply(tokens, logprobs, token_versions(meta, len(tokens), fallback_version), meta["finish_reason"]["type"])


def token_versions(meta: dict, count: int, fallback: int) -> list[int]:
    """Per-token versions: the `weight_versions` spans, else `weight_version`, else `fallback`."""
    spans = meta.get("weight_versions")
    if not spans:
        return [_number(meta.get("weight_version", ""), fallback)] * count
    versions = [-1] * count
    for span in spans:
        versions[span["start"]:span["end"]] = [_number(span["version"], fallback)] * (span["end"] - span["start"])
    if -1 in versions or len(versions) != count:
        raise SGLangError(f"reply {meta.get('id')}: weight_versions {spans} do not cover {count} tokens")
    return versions


def _number(version, fallback: int) -> int:
    """A server version string as our int version; "default" (never updated) or none -> fallback."""
    return int(version) if str(version).isdigit() else fallback


def write_hf_dir(state_dict: dict[str, torch.Tensor], base_model_path: str, path: Path,
                 bucket: tuple[int, int] = (0, 1)) -> Path:
    """A directory `from_pretrained` (and SGLang) loads: model.safetensors + the base config/tokenizer files, or,
    written a bucket (index, count) at a time, one shard per bucket and their index (complete with the last).
    Written in place: no server is told of it before this returns."""
    index, count = bucket
    if index == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        for name in COPIED_FILES:
            if (Path(base_model_path) / name).exists():
                shutil.copy(Path(base_model_path) / name, path / name)
    seen, tensors = set(), {}
    for name, tensor in state_dict.items():  # safetensors refuses shared storage (tied embeddings)
        tensor = tensor.detach().cpu().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    shard = "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    if count > 1:  # the shards' index (transformers' layout), one bucket's names more each time
        index_path = path / "model.safetensors.index.json"
        weight_map = json.loads(index_path.read_text())["weight_map"] if index else {}
        weight_map.update(dict.fromkeys(tensors, shard))
        index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
