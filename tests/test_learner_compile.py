"""learner.compile: every decoder layer compiled (torch.compile, dynamic shapes) trains as the eager layers do.

The same tiny random Qwen2 as tests/test_fsdp.py, one rank: three updates on batches of one layout and different
shapes, compiled and eager side by side from the same weights. Inductor fuses the elementwise ops, so sums round
differently: the results agree to float32 tolerance, not bit for bit. Compiling takes 30-60 s on two cores (the
first update's forward and backward, once: the later shapes reuse its graph).
"""

import dataclasses
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from nanoverl_async.config import ConfigError, KLConfig, LearnerConfig, ModelConfig, load_config
from nanoverl_async.controller.preflight import prepare
from nanoverl_async.learners.batch import collate, with_advantages
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.setup import LearnerSetup
from synthetic import episodes
from test_fsdp import ALGO, TEMPERATURE, free_port, write_model_dir

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor builds its CPU kernels with g++")
LEARNER = LearnerConfig(lr=1e-3, grad_clip=0.5, torch_threads=1)
METRICS = ("loss", "pg_loss", "grad_norm", "entropy", "clip_fraction", "is_weight_mean", "behaviour_kl")


def batches():
    """Three batches of one layout (several rows; groups sharing their prompts under a mask), of different shapes.
    A layout without the mask, or of one row, would be a graph of its own (compiled when first met)."""
    shapes = [[(5, [6, 3], 0.0), (5, [2], 1.0), (3, [7], 1.0), (3, [4, 4], 0.0), (6, [9], 0.0), (6, [1], 1.0)],
              [(3, [4, 2], 1.0), (3, [5], 0.0), (4, [2], 0.0), (4, [1], 1.0), (2, [8, 8], 1.0), (2, [3], 0.0)],
              [(7, [2, 2], 0.0), (7, [3], 1.0), (4, [11], 1.0), (4, [6], 0.0)]]
    return [with_advantages(collate(episodes(shape, seed=seed, shared_prompts=True)), 2, ALGO, KLConfig(),
                            max_total_tokens=32) for seed, shape in enumerate(shapes)]


def trained(model_dir: str, compile_layers: bool) -> tuple[list[dict], dict, LearnerRank, int]:
    """(metrics of each update, the weights after them, the rank, graphs compiled after the first update)."""
    learner = dataclasses.replace(LEARNER, compile=compile_layers)
    rank = LearnerRank(LearnerSetup(ModelConfig(path=model_dir), learner, ALGO, temperature=TEMPERATURE), 0,
                       "127.0.0.1", free_port())
    first, *others = batches()
    metrics = [rank.update(first, 0)]
    graphs = counters["stats"]["unique_graphs"]
    metrics += [rank.update(batch, version) for version, batch in enumerate(others, start=1)]
    weights = {name: tensor.detach().clone() for name, tensor in rank.model.state_dict().items()}
    return metrics, weights, rank, counters["stats"]["unique_graphs"] - graphs


def test_compiled_layers_train_as_eager_ones(tmp_path):
    model_dir = write_model_dir(tmp_path)
    torch._dynamo.reset()
    eager, eager_weights, eager_rank, _ = trained(model_dir, compile_layers=False)
    eager_rank.shutdown()
    compiled, weights, rank, recompiled = trained(model_dir, compile_layers=True)
    rank.shutdown()

    assert all(layer._compiled_call_impl is not None for layer in rank.model.model.layers)  # each, in place
    assert list(weights) == list(eager_weights)  # so parameter names are unchanged (checkpoints, publishing)
    assert recompiled == 0  # later batches' shapes reuse the first one's graph
    for step, (ours, theirs) in enumerate(zip(compiled, eager)):
        assert ours["tokens"] == theirs["tokens"], step
        for key in METRICS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), (step, key)
    for name, tensor in weights.items():
        assert torch.allclose(tensor, eager_weights[name], atol=1e-5), name


def test_compiling_on_the_cpu_without_a_compiler_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ConfigError, match=r"^config key 'learner\.compile': .* none is here .* install g\+\+"):
        prepare(load_config("configs/agent_grpo.yaml", ["learner.compile=true"]))
    prepare(load_config("configs/agent_grpo.yaml", ["learner.compile=false"]))  # nothing to build
    monkeypatch.delenv("CXX")
    prepare(load_config("configs/agent_grpo.yaml", ["learner.compile=true"]))  # g++
