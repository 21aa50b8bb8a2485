"""The roles placed in their processes by Ray, and every wait on them: `Roles` places one buffer,
`generator.replicas` generators and `learner.world_size` learner ranks (the actor classes of role_actors.py,
the ranks through learner_pool.py) in the order that starts them fastest, wires weights to the generators
(CUDA IPC handles on a shared GPU, SGLang's NCCL group), publishes a resumed run's weights, and answers the
launcher's step loop (launcher.py): the next batch, a publish, an evaluation, the trace's events.

A role that dies ends the run with `RunFailed` naming it (and its node, on a cluster), never a hang: the
loop waits on the buffer and on every generator at once, and every wait has a timeout.

Run alone: there is no standalone entry point; tests/test_cli_run.py and tests/test_configs_run.py place
every role end to end.
"""

from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Optional

import ray

from nanoverl_async.agents.data import load_samples
from nanoverl_async.config import Config, ConfigError, RayConfig
from nanoverl_async.controller.learner_pool import LearnerPool
from nanoverl_async.controller.role_actors import BufferRole, GeneratorRole
from nanoverl_async.models.load import vocab_size
from nanoverl_async.observe.trace import TracedRole
from nanoverl_async.wire.auth import run_keys


class RunFailed(RuntimeError):
    """A role died or a wait timed out; the message names the role."""


class Roles:
    """The placed processes: one buffer, `generator.replicas` generators, `learner.world_size` ranks,
    each built from `cfg` as preflight.prepare returned it (agent.env filled in, user paths absolute).
    With `resume_from` (a checkpoint of step `start`), buffer and learners restore it before any
    generator connects, and the restored weights are published before the constructor returns."""

    def __init__(self, cfg: Config, model_path: str, resume_from: Optional[Path] = None, start: int = 0):
        self.cfg, self.nodes = cfg, {}  # role -> node, known on a cluster once every role is up (_placement)
        check_placement(cfg.ray)
        # Every socket, loopback included, admits only processes holding this run's keys (kept in memory only)
        curve = self.curve = run_keys()
        # run.eval_every's prompts (validation checked that data.val_files is set), loaded once
        self.val_samples = [{**s, "index": i} for i, s in enumerate(load_samples(cfg.data.val_files,
                                                                                cfg.data.skip_rows))] \
            if cfg.run.eval_every else []
        # Every role's process starts at once (each spends seconds importing torch and loading a model), the
        # learner ranks first (the slowest: on a small machine they get Ray's prestarted workers), the buffer
        # last (it starts fast); generators connect to the buffer and the weights only once both exist.
        with role_failures("learner pool"):
            self.learners = LearnerPool(cfg, model_path, curve)
        generator_actor = ray.remote(num_cpus=0, num_gpus=generator_gpus(cfg),
                                     resources=cfg.ray.resources("generator"))(GeneratorRole)
        self.generators = [generator_actor.remote(generator_id=i, cfg=cfg, model_path=model_path)
                           for i in range(cfg.generator.replicas)]
        self.buffer = ray.remote(num_cpus=0, max_concurrency=4, resources=cfg.ray.resources("buffer"))(
            BufferRole).remote(cfg, vocab_size(model_path), curve=curve,
                               state=(resume_from / "buffer.msgpack").read_bytes() if resume_from else b"")
        with role_failures("learner pool"):
            self.learners.ready()
            if resume_from:
                self.learners.load_checkpoint(str(resume_from / "learner"))
        if cfg.learner.device == cfg.generator.device == "cuda" and cfg.generator.engine == "builtin":
            # on one GPU with learner rank 0: weights by CUDA IPC handles
            gpus = self.get("generators", [gen.gpu.remote() for gen in self.generators], cfg.run.step_timeout_s)
            with role_failures("learner pool"):
                self.learners.share_gpu_with(gpus)
        buffer_endpoints = self.get("buffer", self.buffer.bound_endpoints.remote(), 60)
        self.nodes = self._placement(buffer_endpoints) if cfg.ray.address else {}
        self.generator_runs = {gen.run.remote(buffer_endpoints, self.learners.weights_endpoint, curve):
                               f"generator {i}" for i, gen in enumerate(self.generators)}
        sglang = cfg.generator.sglang
        if cfg.generator.engine == "sglang" and sglang.weight_transport == "nccl":
            # Learner rank 0 loads every version into every server itself, so it joins one group with all
            # of them before the first publish. A generator's constructor returns once its servers are up.
            servers = [gen.sglang_endpoints.remote() for gen in self.generators]
            endpoints = self.get("generators (SGLang endpoints)", servers, sglang.launch_timeout_s + 60)
            with role_failures("learner pool"):
                self.learners.connect_sglang([e for per_generator in endpoints for e in per_generator], sglang)
        if resume_from:  # generators start on the base weights; the restored buffer leases only to `start`
            self.publish_weights(version=start)

    def _placement(self, buffer_endpoints: dict) -> dict[str, str]:
        """On a cluster: the node each role runs on (every failure names it), printed once with the
        endpoints the roles bound there."""
        # each generator answers once its constructor is done (an SGLang one's, once its servers are up)
        generator_nodes = self.get("generators", [gen.node.remote() for gen in self.generators],
                                   self.cfg.generator.sglang.launch_timeout_s + 60)
        nodes = {"learner pool": ", ".join(dict.fromkeys(self.learners.nodes)),
                 "buffer": self.get("buffer", self.buffer.node.remote(), 60),
                 **{f"generator {i}": node for i, node in enumerate(generator_nodes)}}
        print(f"placed: {'; '.join(f'{role} on {node}' for role, node in nodes.items())}. wire: buffer "
              f"{buffer_endpoints['leases']}, weights {self.learners.weights_endpoint} (CURVE)",
              file=sys.stderr)
        return nodes

    def failures(self, name: str):
        """role_failures naming the node `name` runs on too, on a cluster (which machine to look at)."""
        return role_failures(f"{name} on node {self.nodes[name]}" if name in self.nodes else name)

    def get(self, name: str, refs, timeout_s: float):
        """ray.get of what role `name` answers, within `timeout_s`; its death or a timeout: RunFailed naming it."""
        with self.failures(name):
            return ray.get(refs, timeout=timeout_s)

    def publish_weights(self, version: int) -> None:
        """The buffer learns of `version` first (it refuses tokens and requests from versions never
        published), then learner rank 0 publishes it."""
        self.get("buffer", self.buffer.publishing.remote(version), 60)
        with self.failures("learner pool"):
            self.learners.publish_weights(version)

    def evaluate(self, version: int) -> dict:
        """Near-greedy episodes on data.val_files by generator 0 once it holds weights `version` or newer
        (worker.evaluate) -> eval/* metrics."""
        return self.get("generator 0", self.generators[0].evaluate.remote(self.val_samples, version),
                        self.cfg.run.step_timeout_s)

    def next_batch(self, version: int):
        """The buffer's batch for the update of weights `version` (step version + 1), while watching every
        generator: a dead one fails the run, even when the batch is ready at the same moment (checked before
        the batch is returned)."""
        batch_ref = self.buffer.next_batch.remote(version, self.cfg.run.step_timeout_s)
        runs = list(self.generator_runs)
        while True:
            ready, _ = ray.wait([batch_ref, *runs], num_returns=1)
            ended, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
            for run_ref in ended:  # a generator's `run` only returns when it failed (or was stopped)
                name = self.generator_runs[run_ref]
                with self.failures(name):
                    ray.get(run_ref)
                raise RunFailed(f"{name} stopped unexpectedly during step {version + 1}")
            if batch_ref in ready:
                with self.failures("buffer"):
                    return ray.get(batch_ref)

    def traced(self) -> list[TracedRole]:
        """The buffer and each generator as run.trace reaches them: their `trace_events` (trace.py)."""
        named = [("buffer", self.buffer), *((f"generator {i}", gen) for i, gen in enumerate(self.generators))]
        return [TracedRole(name, partial(self._trace_events, name, actor)) for name, actor in named]

    def _trace_events(self, name: str, actor) -> tuple[float, list]:
        return self.get(name, actor.trace_events.remote(), 60)

    def shutdown(self) -> None:
        """Stop generators first (they talk to the others), then learners and buffer; never hangs."""
        for gen in self.generators:
            gen.stop.remote()
        ray.wait(list(self.generator_runs), num_returns=len(self.generator_runs), timeout=10)
        self.learners.shutdown()
        for actor in [*self.generators, self.buffer]:
            ray.kill(actor)


def generator_gpus(cfg: Config) -> float:
    """GPUs Ray reserves for one generator replica: an SGLang replica's servers run on the GPUs its actor
    is given (servers x tp_size); a transformers engine on cuda takes generator.gpus_per_replica."""
    if cfg.generator.device != "cuda":
        return 0
    sglang = cfg.generator.sglang
    return sglang.servers * sglang.tp_size if cfg.generator.engine == "sglang" else cfg.generator.gpus_per_replica


@contextmanager
def role_failures(name: str):
    """Turn a dead actor or a timed-out wait into RunFailed naming the role."""
    try:
        yield
    except (ray.exceptions.RayError, TimeoutError) as error:
        cause = getattr(error, "cause", None) or error
        raise RunFailed(f"{name}: {type(cause).__name__}: {str(cause).strip().splitlines()[-1]}") from error


def check_placement(cfg: RayConfig) -> None:
    """Every ray.*_resource must be offered by some node of the cluster: one line now, not actors pending
    until a timeout."""
    offered = ray.cluster_resources()
    for key in (f.name for f in dataclasses.fields(cfg) if f.name.endswith("_resource")):
        name = getattr(cfg, key)
        if name and name not in offered:
            custom = sorted(k for k in offered if k not in ("CPU", "GPU", "memory", "object_store_memory")
                            and not k.startswith(("node:", "accelerator_type:")))
            raise ConfigError(f"config key 'ray.{key}': no node of the Ray cluster offers the resource {name!r} "
                              f"(custom resources offered: {', '.join(custom) or 'none'}); start the node meant "
                              f"for it with ray start --resources='{{\"{name}\": 1}}'")
