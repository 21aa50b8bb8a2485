"""Weights from learner rank 0 straight into SGLang servers over NCCL (`update_weights_from_distributed`).

    sender = SGLangWeightSender(servers, master_address=node_ip, master_port=29600)
    sender.init_group(torch.device("cuda", 0))   # servers join as ranks 1..; rank 0 is this process
    sender.send(state_dict.items(), version=7)    # pause, [begin], buckets, [end], continue

Protocol (docs/sglang.md "Weights over NCCL"): `/init_weights_update_group` blocks on every server
until rank 0 joins, so those calls run on threads while this process joins the group. For each bucket
(at most `bucket_bytes`), `/update_weights_from_distributed` with its names, dtypes (torch attribute
names, "bfloat16") and shapes is posted on threads, then rank 0 broadcasts each tensor in the same
order; the call returns when its broadcasts are done. Only the last bucket flushes the cache. Servers
of 0.5.23 and later need `/begin_weight_update` .. `/end_weight_update` around it (SGLangClient decides
from the server's version). The servers are paused (`pause_mode`) for the whole update, so no token is
sampled from half-updated weights; every token carries the version it was sampled with.

`broadcast` replaces the NCCL broadcast (tests pass the fake server's queue). The group's backend is
`nccl` when rank 0's device is cuda and `gloo` on cpu (`/init_weights_update_group` passes it through), so
the CPU tests run the real path against fake server processes. Status: wired end to end with
`generator.sglang.weight_transport: nccl` (LearnerPool.connect_sglang, LearnerRank.publish_weights; the
generators learn each version from an empty-state-dict notice); tested with gloo against the fake server
(tests/test_sglang_nccl.py, including the real CLI); NCCL with a real SGLang server has never run (no GPU,
no sglang here).
"""

from __future__ import annotations

import datetime
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

import torch

from nanoverl_async.config import SGLangConfig
from nanoverl_async.wire.sglang_http import SGLangClient, SGLangError, paused

log = logging.getLogger(__name__)


def buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a bigger tensor is a bucket alone)."""
    out, size = [[]], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return [bucket for bucket in out if bucket]


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float, device: Optional[torch.device] = None):
    """A process group outside the default world, as SGLang's own `init_custom_process_group` builds it
    on the server side (a TCPStore rendezvous prefixed by `group_name`)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # A default group bound to a device (the learner's NCCL world) would make torch build this group with
    # ncclCommSplit from the learner's communicator, which the servers are not part of: rank 0 would hang.
    # Hide the binding for the call, so the group gets its own communicator (as NeMo RL does).
    default = _world.default_pg
    bound = default.bound_device_id if default is not None else None
    if default is not None:
        default.bound_device_id = None
    try:
        group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                             timeout=timeout, device_id=device if backend == "nccl" else None)
    finally:
        if default is not None:
            default.bound_device_id = bound
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def server_handles(endpoints: list[dict], cfg: SGLangConfig) -> list[SGLangClient]:
    """Clients of servers a generator launched (GeneratorRole.sglang_endpoints: url, tp_size,
    server_version, legacy_protocol): the version fields pick the protocol variant without asking the
    servers again."""
    return [SGLangClient(e["url"], cfg.control_timeout_s, tp_size=e["tp_size"], server_version=e["server_version"],
                         legacy_protocol=e["legacy_protocol"]) for e in endpoints]


def check_reachable(endpoints: list[dict], rank0_ip: str) -> None:
    """Raise if a server listens on loopback on another node than learner rank 0 (it could not be reached)."""
    unreachable = [e["url"] for e in endpoints
                   if "://127.0.0.1:" in e["url"] and e.get("node_ip", "") not in ("", rank0_ip)]
    if unreachable:
        raise SGLangError(f"learner rank 0 (node {rank0_ip}) cannot reach SGLang servers {unreachable} on other "
                          "nodes: they listen on 127.0.0.1; set generator.sglang.host=0.0.0.0 (or the node's "
                          "address) for weight_transport=nccl across nodes")


class SGLangWeightSender:
    def __init__(self, servers: list[SGLangClient], master_address: str, master_port: int, *,
                 group_name: str = "weight_update_group", bucket_bytes: int = 512 << 20, pause_mode: str = "abort",
                 timeout_s: float = 300.0, broadcast: Optional[Callable[[torch.Tensor], None]] = None):
        self.servers = servers
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.timeout_s, self.broadcast = timeout_s, broadcast
        self.device: Optional[torch.device] = None
        self.group = None
        self._threads = ThreadPoolExecutor(max_workers=max(1, len(servers)), thread_name_prefix="sglang-weights")

    def _on_all(self, path: str, bodies: list[dict]) -> list:
        """Post bodies[i] to server i on threads; the futures (call .result to wait and raise)."""
        return [self._threads.submit(server.post, path, body) for server, body in zip(self.servers, bodies)]

    def init_group(self, device: Optional[torch.device] = None) -> None:
        """Create the group {rank 0: this process, ranks 1..: every server's TP ranks}: nccl when `device`
        is cuda, gloo otherwise (default: cpu)."""
        self.device = device if device is not None else torch.device("cpu")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        world_size = 1 + sum(server.tp_size for server in self.servers)
        offsets = [1 + sum(s.tp_size for s in self.servers[:i]) for i in range(len(self.servers))]
        bodies = [{"master_address": self.master_address, "master_port": self.master_port, "rank_offset": offset,
                   "world_size": world_size, "group_name": self.group_name, "backend": backend} for offset in offsets]
        pending = self._on_all("/init_weights_update_group", bodies)
        if self.broadcast is None:  # the real thing: join as rank 0 (blocks until every server has joined)
            self.group = init_custom_process_group(backend, f"tcp://{self.master_address}:{self.master_port}",
                                                   world_size=world_size, rank=0, group_name=self.group_name,
                                                   timeout_s=self.timeout_s, device=self.device)
        for future in pending:
            future.result(self.timeout_s)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load every tensor into every server as weights `version` (servers paused meanwhile)."""
        if self.group is None and self.broadcast is None:
            raise SGLangError("SGLangWeightSender.send before init_group")
        parts = buckets(list(named_tensors), self.bucket_bytes)
        broadcast = self.broadcast or (
            lambda tensor: torch.distributed.broadcast(tensor.to(self.device), src=0, group=self.group))
        with paused(self.servers, self.pause_mode):
            for server in self.servers:
                server.begin_update()
            for index, bucket in enumerate(parts):
                body = {"names": [n for n, _ in bucket],
                        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                        "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                        "flush_cache": index == len(parts) - 1, "weight_version": str(version),
                        "load_format": None, "abort_all_requests": False}
                pending = self._on_all("/update_weights_from_distributed", [body] * len(self.servers))
                for _, tensor in bucket:  # the servers receive in the order of `names`
                    broadcast(tensor.contiguous())
                for future in pending:
                    future.result(self.timeout_s)
            for server in self.servers:
                server.end_update()

    def close(self) -> None:
        """Leave the group. The servers may be gone already (generators stop first at shutdown): a failed
        `/destroy_weights_update_group` is only logged."""
        for server in self.servers:
            try:
                server.post("/destroy_weights_update_group", {"group_name": self.group_name})
            except SGLangError as error:
                log.info("weight-update group not destroyed on %s: %s", server.url, error)
        self._threads.shutdown(wait=False)
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None
