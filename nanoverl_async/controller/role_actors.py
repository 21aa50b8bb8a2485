"""The processes Ray runs the buffer, each generator and each learner rank in: BufferService itself plus
what Ray needs, and thin classes around GeneratorWorker and LearnerRank, whose methods the controller calls
(roles.py; the ranks through learner_pool.py).

Ray imports an actor's class from its module in the actor's process, so this module imports nothing heavy:
the buffer's process starts without torch (seconds of start-up on a small machine, beside the roles that
need it), and a generator or learner rank imports torch, transformers and its model in its own constructor,
with the garbage collector paused (startup.collecting_later: ~15% less CPU).
"""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Optional

import ray

from nanoverl_async.buffer.service import BufferService
from nanoverl_async.config import Config, SGLangConfig
from nanoverl_async.agents.data import prompt_source
from nanoverl_async.learners.setup import LearnerSetup
from nanoverl_async.controller.startup import collecting_later
from nanoverl_async.wire.auth import CurveKeys, bind_host


class Role:
    """What the controller asks of every role's process besides its work (Ray runs a plain method of an
    async actor, a generator's, on its event loop)."""

    def node(self) -> str:
        """This process's node address: on a cluster every failure names it."""
        return ray.util.get_node_ip_address()


class BufferRole(BufferService, Role):
    """The buffer service in its own process: Ray calls its methods (next_batch, publishing) and these."""

    def __init__(self, cfg: Config, vocab_size: int, curve: Optional[CurveKeys] = None, state: bytes = b""):
        host = bind_host(cfg.wire.host, ray.util.get_node_ip_address())  # this node's address on a cluster
        super().__init__(cfg.data.prompts_per_step, cfg.data.samples_per_prompt, cfg.staleness.max, cfg.buffer,
                         host, cfg.generator, vocab_size, prompt_source(cfg.data, cfg.run.seed),
                         cfg.algorithm.group_filter, curve, trace=cfg.run.trace, max_tokens=cfg.agent.max_total_tokens)
        if state:  # a checkpoint's buffer.msgpack, before any generator connects (Roles starts them afterwards)
            self.restore(state)

    def state(self, version: int) -> tuple[bytes, dict]:
        """buffer.msgpack's bytes for the controller to write, and the gate's counters for meta.json."""
        state, stats = self.state_bytes(version), self.stats()
        return state, {key: stats[key] for key in ("leased", "consumed", "released", "expired", "reissued",
                                                   "groups_in_flight", "groups_ready")}

    def bound_endpoints(self) -> dict:
        """`endpoints` (an attribute, which Ray cannot call): the addresses generators connect to."""
        return self.endpoints

    def trace_events(self) -> tuple[float, list]:
        """run.trace: this process's clock (for the controller's offset) and the spans closed since the last call."""
        return time.time(), self.trace.take()


class GeneratorRole(Role):
    """A generator worker in its own process; `run` lives until `stop` (or dies, which Roles sees)."""

    def __init__(self, **kwargs):
        with collecting_later():  # imports and a model: seconds of CPU, less without the collector (startup.py)
            # in the generator's own process: the engine's imports (torch, transformers) stay out of this module
            from nanoverl_async.generators.worker import GeneratorWorker
            from nanoverl_async.models.load import require_model_dir

            require_model_dir(kwargs["model_path"], f"node {ray.util.get_node_ip_address()}")
            self.worker = GeneratorWorker(**kwargs)

    async def run(self, buffer_endpoints: dict, weights_endpoint: str, curve: Optional[CurveKeys] = None) -> None:
        try:
            await self.worker.run(buffer_endpoints, weights_endpoint, curve)
        finally:
            getattr(self.worker.engine, "close", lambda: None)()  # an SGLang engine stops its server processes

    async def stop(self) -> None:
        self.worker.stop()

    async def trace_events(self) -> tuple[float, list]:
        """run.trace: this process's clock (for the controller's offset) and the spans closed since the last call."""
        return time.time(), self.worker.trace.take()

    async def evaluate(self, samples: list, min_version: int) -> dict:
        return await self.worker.evaluate(samples, min_version)

    async def gpu(self) -> str:
        """The UUID of the GPU this generator's builtin engine computes on (Roles asks only when it is on
        cuda), for LearnerPool.share_gpu_with."""
        import torch

        return str(torch.cuda.get_device_properties(self.worker.engine.device).uuid)

    async def sglang_endpoints(self) -> list[dict]:
        """This generator's SGLang servers (url, tp_size, server_version, legacy_protocol), for learner rank 0
        to load weights into them (generator.sglang.weight_transport=nccl)."""
        return self.worker.engine.endpoints(node_ip=ray.util.get_node_ip_address())


class LearnerRankRole(Role):
    """One learner rank's process. It starts empty, so that rank 0 can first pick where the ranks meet;
    `start` then builds the LearnerRank, imported only there, in the rank's own process (the controller
    needs none of FSDP or a model class). The methods after it are the LearnerRank's own (learners/fsdp_rank.py
    documents each), named here so that the pool's calls read as what they do."""

    def rendezvous_address(self) -> tuple[str, int]:
        with socket.socket() as probe:
            probe.bind(("", 0))
            return ray.util.get_node_ip_address(), probe.getsockname()[1]

    def start(self, setup: LearnerSetup, rank: int, rendezvous: tuple[str, int]) -> None:
        with collecting_later():  # imports and a model: seconds of CPU, less without the collector (startup.py)
            from nanoverl_async.learners.fsdp_rank import LearnerRank
            from nanoverl_async.models.load import require_model_dir

            node = ray.util.get_node_ip_address()
            require_model_dir(setup.model.path, f"node {node}")
            setup = dataclasses.replace(setup, wire_host=bind_host(setup.wire_host, node))
            self.rank = LearnerRank(setup, rank, *rendezvous)

    def compute(self, batch, field: str):
        return self.rank.compute(batch, field)

    def update(self, batch, version: int) -> dict[str, float]:
        return self.rank.update(batch, version)

    def publish_weights(self, version: int) -> None:
        self.rank.publish_weights(version)

    def weights_endpoint(self) -> str:
        return self.rank.weights_endpoint()

    def connect_sglang(self, endpoints: list[dict], cfg: SGLangConfig, master_addr: str, master_port: int) -> None:
        self.rank.connect_sglang(endpoints, cfg, master_addr, master_port)

    def save_checkpoint(self, path: str) -> None:
        self.rank.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.rank.load_checkpoint(path)

    def save_pretrained(self, path: str) -> None:
        self.rank.save_pretrained(path)

    def shutdown(self) -> None:
        self.rank.shutdown()

    def share_gpu_with(self, generator_gpus: list[str]) -> bool:
        """Rank 0, on cuda (Roles asks only then): publish weights by CUDA IPC handles (weights.py) if every
        generator is on this rank's GPU (their UUIDs) and on this machine (a publisher on loopback); whether it will."""
        import torch

        publisher, own = self.rank.publisher, str(torch.cuda.get_device_properties(self.rank.device).uuid)
        publisher.device_handles = publisher.shared_memory and all(gpu == own for gpu in generator_gpus)
        return publisher.device_handles
