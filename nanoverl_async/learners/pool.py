"""LearnerPool: `learner.world_size` LearnerRank processes placed by Ray; the only Ray code of learners/.

Every call goes to all ranks at once (they run collectives together) with the whole batch, put into
Ray's object store once; each rank takes its own shard. Metrics come back already reduced over ranks,
so rank 0's dict is the pool's. The rendezvous address is picked on rank 0's own node, so the ranks
may live on several machines of a Ray cluster. Every wait has a timeout.

Run alone: there is no standalone entry point; tests/test_fsdp.py and tests/test_fsdp_schedule.py cover
LearnerRank without Ray, tests/test_cli_run.py and tests/test_configs_run.py cover this pool end to end.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Optional

import numpy as np
import ray
import torch

from nanoverl_async.config import AlgorithmConfig, CriticConfig, KLConfig, LearnerConfig, SGLangConfig, WireConfig
from nanoverl_async.learners.batch import TrainBatch, collate, explained_variance, group_size_of, with_advantages
from nanoverl_async.learners.fsdp_rank import PROCESS_GROUP_TIMEOUT_S, LearnerRank
from nanoverl_async.learners.sglang_nccl import check_reachable

TIMEOUT_S = PROCESS_GROUP_TIMEOUT_S + 60  # a rank stuck in a collective fails first, with its own error


class _DeferredRank(LearnerRank):
    """A LearnerRank whose construction waits until rank 0 has told everyone where to meet."""

    def __init__(self):  # the real __init__ runs in `start`
        pass

    def rendezvous_address(self) -> tuple[str, int]:
        with socket.socket() as probe:
            probe.bind(("", 0))
            return ray.util.get_node_ip_address(), probe.getsockname()[1]

    def start(self, *args, **kwargs) -> None:
        LearnerRank.__init__(self, *args, **kwargs)


class LearnerPool:
    def __init__(self, cfg: LearnerConfig, algo: AlgorithmConfig, model_path: str, temperature: float, seed: int,
                 wire: Optional[WireConfig] = None, dtype: str = "float32", initial_version: int = 0,
                 kl: Optional[KLConfig] = None, reference_path: str = "", max_length: int = 0,
                 critic: Optional[CriticConfig] = None):
        self.algo, self.kl = algo, kl or KLConfig()
        self.max_length = max_length  # agent.max_total_tokens: the overlong shaping's limit
        # p_old must be recomputed unless the update's own forward (one optimizer step) sees the same weights
        self.needs_proximal = cfg.ppo_epochs * cfg.minibatches > 1
        self.needs_reference = self.kl.loss_coef > 0 or self.kl.reward_coef > 0
        actor = ray.remote(num_cpus=0, num_gpus=cfg.gpus_per_rank if cfg.device == "cuda" else 0)(_DeferredRank)
        self.ranks = [actor.remote() for _ in range(cfg.world_size)]
        master_addr, master_port = ray.get(self.ranks[0].rendezvous_address.remote(), timeout=TIMEOUT_S)
        wire_host = (wire or WireConfig()).host
        ray.get([actor_rank.start.remote(rank, cfg.world_size, master_addr, master_port, model_path, cfg, algo,
                                         temperature, seed, kl=self.kl, reference_path=reference_path, critic=critic,
                                         max_tokens=max_length, dtype=dtype,
                                         wire_host=wire_host, initial_version=initial_version)
                 for rank, actor_rank in enumerate(self.ranks)], timeout=TIMEOUT_S)
        self.weights_endpoint: str = ray.get(self.ranks[0].weights_endpoint.remote(), timeout=TIMEOUT_S)

    def _all(self, method: str, *args) -> list:
        """Call `method(*args)` on every rank at once (they run collectives together); one result per rank.
        The first rank to fail raises at once: its peers would otherwise sit in a collective until timeout."""
        refs = [getattr(rank, method).remote(*args) for rank in self.ranks]
        pending, deadline = list(refs), time.monotonic() + TIMEOUT_S
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"learner ranks did not finish {method} within {TIMEOUT_S:.0f} s")
            ray.get(ready)  # raises the rank's own error
        return ray.get(refs)

    def prepare(self, batch) -> TrainBatch:
        """The buffer's Batch (or a TrainBatch) -> a TrainBatch ready for `update`: overlong-shaped
        rewards, the proximal logprobs of the current weights when the update takes several optimizer
        steps, the reference logprobs when KL is on, the critic's values for gae (each gathered from every
        rank's shard), and the advantages of `algorithm.advantage`. With one optimizer step per batch the update's own forward
        runs on exactly the weights of version `step`: its detached logprobs ARE the proximal logprobs,
        so that forward is not run twice."""
        if isinstance(batch, TrainBatch):
            train_batch, group_size = batch, None
        else:
            train_batch, group_size = collate(batch.trajectories), group_size_of(batch.trajectories)
        shared = ray.put(train_batch)
        if self.needs_proximal:
            parts = self._all("compute_logprobs", shared, "policy")
            train_batch = dataclasses.replace(train_batch, proximal_logprobs=torch.from_numpy(np.concatenate(parts)))
        if self.needs_reference:
            parts = self._all("compute_logprobs", shared, "reference")
            train_batch = dataclasses.replace(train_batch, reference_logprobs=torch.from_numpy(np.concatenate(parts)))
        if self.algo.advantage == "gae":
            values = torch.from_numpy(np.concatenate(self._all("compute_values", shared)))
            train_batch = dataclasses.replace(train_batch, values=values)
        if group_size is None:
            return train_batch  # a ready TrainBatch keeps its advantages
        return with_advantages(train_batch, group_size, self.algo, self.kl, self.max_length)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """learner.ppo_epochs x learner.minibatches optimizer steps on the batch, one new version;
        metrics reduced over ranks."""
        metrics = self._all("update", ray.put(batch))[0]
        if batch.returns is not None:  # how much of the returns' variance the critic's values explain
            metrics["explained_variance"] = explained_variance(batch)
        return metrics

    def connect_sglang(self, endpoints: list[dict], cfg: SGLangConfig) -> None:
        """generator.sglang.weight_transport=nccl: rank 0 joins one process group with every SGLang server
        (GeneratorRole.sglang_endpoints), meeting at its own node's IP on a free port there. From then on
        `publish_weights` loads weights straight into the servers."""
        master_addr, master_port = ray.get(self.ranks[0].rendezvous_address.remote(), timeout=TIMEOUT_S)
        check_reachable(endpoints, master_addr)
        self._all("connect_sglang", endpoints, cfg, master_addr, master_port)

    def publish_weights(self, version: int) -> None:
        """Gathers the full state dict on rank 0, which sends it on a background thread (disk transport), or
        loads it into the SGLang servers before returning and then sends a version notice (nccl)."""
        self._all("publish_weights", version)

    def save_checkpoint(self, path: str) -> None:
        """Every rank writes its DCP shards of models and optimizers under `path` (learners/checkpoint.py)."""
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str, version: int) -> None:
        """Every rank loads its shards from `path`; the pool's weights are then version `version`."""
        self._all("load_checkpoint", path, version)

    def save_pretrained(self, path: str) -> None:
        self._all("save_pretrained", path)

    def shutdown(self) -> None:
        """Close the publisher and process groups, then end the actors; never hangs."""
        refs = [rank.shutdown.remote() for rank in self.ranks]
        ray.wait(refs, num_returns=len(refs), timeout=30)
        for rank in self.ranks:
            ray.kill(rank)
