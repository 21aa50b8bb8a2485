"""LearnerPool: `learner.world_size` LearnerRank processes placed by Ray (each a role_actors.LearnerRankRole,
whose module is light, so a rank imports torch in its constructor); controller code, as learners/ has no Ray.

Every call goes to all ranks at once (they run collectives together) with the whole batch, put into
Ray's object store once per step phase that needs it; each rank takes its own shard. Metrics come back
already reduced over ranks, so rank 0's dict is the pool's. The rendezvous address is picked on rank 0's
own node, so the ranks may live on several machines of a Ray cluster. Every wait has a timeout.

Run alone: there is no standalone entry point; tests/test_fsdp.py and tests/test_fsdp_schedule.py cover
LearnerRank without Ray, tests/test_cli_run.py and tests/test_configs_run.py cover this pool end to end.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import numpy as np
import ray
import torch
from ray.actor import ActorHandle

from nanoverl_async.config import Config, SGLangConfig
from nanoverl_async.learners.batch import TrainBatch, collate, explained_variance, group_size_of, with_advantages
from nanoverl_async.learners.setup import PROCESS_GROUP_TIMEOUT_S, LearnerSetup
from nanoverl_async.learners.sglang_nccl import check_reachable
from nanoverl_async.controller.role_actors import LearnerRankRole
from nanoverl_async.wire.auth import CurveKeys

TIMEOUT_S = PROCESS_GROUP_TIMEOUT_S + 60  # a rank stuck in a collective fails first, with its own error


class LearnerPool:
    def __init__(self, cfg: Config, model_path: str, curve: Optional[CurveKeys] = None):
        """The ranks of `cfg.learner`, each built from the sections of `cfg` it reads (LearnerSetup);
        `model_path` is model.path resolved to a directory; `curve` the run's wire keys (wire/auth.py).
        They hold its weights until `load_checkpoint` restores a checkpoint's. Returns once the ranks are
        placed: they build their models while the caller starts the other roles (`ready` waits for them)."""
        self.setup = setup = LearnerSetup(
            dataclasses.replace(cfg.model, path=model_path), cfg.learner, cfg.algorithm, cfg.kl, cfg.reference,
            cfg.critic, cfg.wire.host, cfg.generator.temperature, cfg.run.seed, cfg.agent.max_total_tokens, curve,
            bucket_mb=cfg.weight_sync.bucket_mb)
        learner = cfg.learner
        gpus = learner.gpus_per_rank if learner.device == "cuda" else 0
        actor = ray.remote(num_cpus=0, num_gpus=gpus, resources=cfg.ray.resources("learner"))(LearnerRankRole)
        self.ranks = [actor.remote() for _ in range(learner.world_size)]
        rendezvous = self.ranks[0].rendezvous_address.remote()  # Ray hands every rank its value
        self._starts = [actor_rank.start.remote(setup, rank, rendezvous) for rank, actor_rank in enumerate(self.ranks)]
        self.weights_endpoint, self.nodes = "", []  # rank 0's publisher; each rank's node (set by `ready`)

    def ready(self) -> None:
        """Wait until every rank has built its models (raising a rank's own error); once, then returns at once."""
        if self._starts:
            ray.get(self._starts, timeout=TIMEOUT_S)
            self._starts = []
            self.weights_endpoint = ray.get(self.ranks[0].weights_endpoint.remote(), timeout=TIMEOUT_S)
            self.nodes = ray.get([rank.node.remote() for rank in self.ranks], timeout=TIMEOUT_S)

    def _all(self, method: str, call: Callable[[ActorHandle], ray.ObjectRef]) -> list:
        """`call(rank)` (the typed Ray call of LearnerRankRole's `method`) on every rank at once: they run
        collectives together; one result per rank. The first rank to fail raises at once: its peers would
        otherwise sit in a collective until timeout, which names `method`."""
        self.ready()
        refs = [call(rank) for rank in self.ranks]
        pending, deadline = list(refs), time.monotonic() + TIMEOUT_S
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"learner ranks did not finish {method} within {TIMEOUT_S:.0f} s")
            ray.get(ready)  # raises the rank's own error
        return ray.get(refs)

    def prepare(self, trajectories: list) -> TrainBatch:
        """A batch's trajectories (the buffer's Batch.trajectories, group-contiguous) -> a TrainBatch ready for
        `update`: overlong-shaped rewards, the proximal logprobs of the current weights when the update takes
        several optimizer steps, the reference logprobs when KL is on, the critic's values for gae (each
        gathered from every rank's shard), and the advantages of `algorithm.advantage`. With one optimizer step
        per batch the update's own forward runs on exactly the weights it updates: its detached logprobs ARE the
        proximal logprobs, so that forward is not run twice (and, with no KL and no critic, nothing runs here)."""
        train_batch, group_size = collate(trajectories), group_size_of(trajectories)
        # one copy in Ray's object store for every rank
        shared = ray.put(train_batch) if self.setup.forwards else None
        gathered = {}
        for field in self.setup.forwards:  # each [N, L]: every rank's [shard rows, L], concatenated in rank order
            shards = self._all("compute", lambda rank: rank.compute.remote(shared, field))
            gathered[field] = torch.from_numpy(np.concatenate(shards))
        return with_advantages(dataclasses.replace(train_batch, **gathered), group_size, self.setup.algorithm,
                               self.setup.kl, self.setup.max_total_tokens)

    def update(self, batch: TrainBatch, version: int) -> dict[str, float]:
        """learner.ppo_epochs x learner.minibatches optimizer steps on the batch, from the weights of `version`
        (the controller's count: step N trains N - 1) to those of version + 1; metrics reduced over ranks."""
        shared = ray.put(batch)
        metrics = self._all("update", lambda rank: rank.update.remote(shared, version))[0]
        if batch.returns is not None:  # how much of the returns' variance the critic's values explain
            metrics["explained_variance"] = explained_variance(batch)
        return metrics

    def connect_sglang(self, endpoints: list[dict], cfg: SGLangConfig) -> None:
        """generator.sglang.weight_transport=nccl: rank 0 joins one process group with every SGLang server
        (GeneratorRole.sglang_endpoints), meeting at its own node's IP on a free port there. From then on
        `publish_weights` loads weights straight into the servers."""
        self.ready()
        master_addr, master_port = ray.get(self.ranks[0].rendezvous_address.remote(), timeout=TIMEOUT_S)
        check_reachable(endpoints, master_addr)
        self._all("connect_sglang",
                  lambda rank: rank.connect_sglang.remote(endpoints, cfg, master_addr, master_port))

    def share_gpu_with(self, generator_gpus: list[str]) -> bool:
        """Weights to the generators without a host round trip when they all share rank 0's GPU (their device
        UUIDs, GeneratorRole.gpu): rank 0 hands over CUDA IPC handles. Returns whether it will."""
        self.ready()
        return ray.get(self.ranks[0].share_gpu_with.remote(generator_gpus), timeout=TIMEOUT_S)

    def publish_weights(self, version: int) -> None:
        """Gathers the full state dict on rank 0, which sends it on a background thread (disk transport), or
        loads it into the SGLang servers before returning and then sends a version notice (nccl)."""
        self._all("publish_weights", lambda rank: rank.publish_weights.remote(version))

    def save_checkpoint(self, path: str) -> None:
        """Every rank writes its DCP shards of models and optimizers under `path` (learners/checkpoint.py)."""
        self._all("save_checkpoint", lambda rank: rank.save_checkpoint.remote(path))

    def load_checkpoint(self, path: str) -> None:
        """Every rank loads its shards from `path` (the weights of the checkpoint's step: Roles publishes them)."""
        self._all("load_checkpoint", lambda rank: rank.load_checkpoint.remote(path))

    def save_pretrained(self, path: str) -> None:
        self._all("save_pretrained", lambda rank: rank.save_pretrained.remote(path))

    def shutdown(self) -> None:
        """Close the publisher and process groups, then end the actors; never hangs."""
        refs = [rank.shutdown.remote() for rank in self.ranks]
        ray.wait(refs, num_returns=len(refs), timeout=30)
        for rank in self.ranks:
            ray.kill(rank)
