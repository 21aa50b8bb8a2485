"""The CUDA paths, run only where a GPU is present (skipped on the CPU CI machine).

The transformers engine on cuda samples with logprobs equal to a full forward pass on the GPU (with its
decode steps replayed from CUDA graphs through joins, leaves, cache growth and a weight swap); one
float32 learner rank on NCCL (the plain model) takes the same two steps as plain torch on the CPU and
publishes exactly the weights it holds, and one bfloat16 rank (FSDP2 mixed precision, as a lone GPU learner
runs) accumulates micro-batches into a float32 pass's gradient (the checks of test_engine.py and
test_fsdp.py, on the other device). Ran on an H200 (see README "What runs where").
"""

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load as safetensors_load

from nanoverl_async.agents.engine import SamplingParams
from nanoverl_async.generators.builtin_engine import BuiltinEngine
from nanoverl_async.learners.checkpoint import full_state_dict
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.wire.weights import WeightPublisher, WeightSubscriber
from test_engine import tiny_qwen2
from test_fsdp import (LEARNER, bfloat16_rank_matches_a_float32_pass, free_port, make_batch, plain_reference,
                       published_versions_equal_held, setup, write_model_dir)
from test_weights import READER
from weight_waits import wait_newest, wait_sent

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = 1e-4  # fp32 on both devices; kernels differ in summation order


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_cuda")
    tiny_qwen2().save_pretrained(path)
    return str(path)


def test_engine_on_cuda_matches_a_full_forward(qwen_dir):
    engine = BuiltinEngine(qwen_dir, device="cuda", seed=3)
    reference = tiny_qwen2().cuda()
    prompts, limits = [[5, 6, 7, 8, 9], [3], [20, 21, 22, 23]], [12, 5, 9]

    async def main():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(n, 0.7)) for p, n in zip(prompts, limits)))

    for prompt, limit, completion in zip(prompts, limits, asyncio.run(main())):
        assert len(completion.token_ids) == limit and completion.versions == [0] * limit
        ids = torch.tensor([prompt + completion.token_ids], device="cuda")
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
        assert completion.logprobs == pytest.approx(expected.tolist(), abs=TOL)


def test_replayed_decode_graphs_match_a_full_forward(qwen_dir):
    """CUDA graphs under every change they must survive: rows joining and leaving (other batch buckets),
    a row outgrowing the cache (a new cache: captured again), a weight swap in place between steps."""
    engine = BuiltinEngine(qwen_dir, device="cuda", seed=4)
    old, new = tiny_qwen2().cuda(), tiny_qwen2(seed=1).cuda()
    stops = tuple(range(0, 96, 5))
    state_dict = {k: v for k, v in new.state_dict().items() if k != "lm_head.weight"}

    async def late(prompt, steps):
        while engine.decode_steps < steps:
            await asyncio.sleep(0)
        return await engine.generate(prompt, SamplingParams(30, 1.0, stops))

    async def swap():
        while engine.decode_steps < 40:
            await asyncio.sleep(0)
        engine.stage_weights(state_dict, 1)

    async def main():
        long = engine.generate([7] * 60, SamplingParams(70, 1.0))  # 60 + 70 positions: the cache grows past 64
        short = [engine.generate([i + 1] * (i % 7 + 1), SamplingParams(25, 1.0, stops)) for i in range(9)]
        return await asyncio.gather(long, *short, late([30, 31], 3), late([50] * 9, 10), swap())

    *completions, _ = asyncio.run(main())
    assert engine.runner.graphs is not None and len(engine.runner.graphs.graphs) >= 1
    prompts = [[7] * 60] + [[i + 1] * (i % 7 + 1) for i in range(9)] + [[30, 31], [50] * 9]
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion.token_ids], device="cuda")
        with torch.no_grad():
            logits = {v: model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
                      for v, model in ((0, old), (1, new))}
        for index, (token, logprob, version) in enumerate(zip(completion.token_ids, completion.logprobs,
                                                              completion.versions)):
            expected = torch.log_softmax(logits[version][index], -1)[token].item()
            assert logprob == pytest.approx(expected, abs=TOL), (prompt, index, version)
    assert completions[0].versions[-1] == 1  # the long row decoded across the swap


def test_nccl_learner_rank_matches_plain_torch(tmp_path):
    model_dir = write_model_dir(tmp_path)
    learner = LearnerRank(setup(model_dir, learner=dataclasses.replace(LEARNER, device="cuda")), 0, "127.0.0.1",
                          free_port())
    try:
        batch = make_batch()
        first, second = learner.update(batch, 0), learner.update(batch, 1)
        weights = full_state_dict(learner.model)
    finally:
        learner.shutdown()
    _, losses, reference_weights = plain_reference(model_dir, batch)
    assert [first["loss"], second["loss"]] == pytest.approx(losses, abs=TOL)
    for name, tensor in reference_weights.items():
        assert torch.allclose(weights[name].cpu(), tensor, atol=TOL), name


def test_bfloat16_fsdp2_rank_on_nccl_accumulates_like_a_float32_pass(tmp_path):
    bfloat16_rank_matches_a_float32_pass(write_model_dir(tmp_path), "cuda")


def test_each_published_version_is_the_weights_held_also_written_into_a_reused_pinned_payload(tmp_path):
    """From the GPU: cast there, copied into pinned host memory without blocking, one wait for all."""
    learner = LearnerRank(setup(write_model_dir(tmp_path), learner=dataclasses.replace(LEARNER, device="cuda")), 0,
                          "127.0.0.1", free_port())
    try:
        written = published_versions_equal_held(learner)
    finally:
        learner.shutdown()
    assert len(written[0].payloads) > 1 and all(buckets is written[0] for buckets in written)  # one set, reused


def test_a_process_on_the_same_gpu_reads_each_version_in_place_by_cuda_ipc_and_a_torn_one_is_refused(tmp_path):
    """Learner rank 0's side with `device_handles`: the buckets stay on the GPU, each notice carries its bucket's
    CUDA IPC handle and sum64; a second process maps each, copies it on the GPU and checks it (test_weights.py:
    the same logic through host shared memory)."""
    publisher = WeightPublisher("127.0.0.1")
    publisher.device_handles = True
    generator = torch.Generator().manual_seed(0)
    sent = {"w": torch.randn(257, 33, generator=generator).to(torch.bfloat16), "ids": torch.arange(5)}
    entries = {n: (t.dtype, tuple(t.shape)) for n, t in sent.items()}
    try:
        for version, tear in ((1, True), (2, False)):
            buckets = publisher.writable_buckets(entries, torch.device("cuda"), bucket_bytes=257 * 33 * 2)
            assert len(buckets.payloads) == 2 and all(p.is_cuda for p in buckets.payloads)
            buckets.begin(version)
            for name, tensor in sent.items():
                buckets.write(name, tensor)
            torch.cuda.synchronize()
            publisher.publish(version, buckets)
            wait_sent(publisher, version, 30)
            if tear:  # written after its checksum: what a reader sees when the learner reuses it meanwhile
                buckets.payloads[-1][-1] ^= 0xFF
                torch.cuda.synchronize()
            out = tmp_path / f"v{version}.safetensors"
            reader = subprocess.run([sys.executable, "-c", READER, publisher.endpoint, str(out), "5" if tear else "60"],
                                    capture_output=True, text=True, timeout=90)
            if tear:  # nothing valid to read: the reader times out having dropped the version
                assert reader.returncode != 0 and "checksum mismatch" in reader.stderr
                continue
            assert reader.returncode == 0, reader.stderr[-2000:]
            report = json.loads(reader.stdout.splitlines()[-1])
            assert report["version"] == 2 and report["devices"] == ["cuda"] and report["from_shared_memory"] == 2
            got = safetensors_load(out.read_bytes())
            for name, tensor in sent.items():
                assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    finally:
        publisher.close(timeout_s=5)


def test_nccl_weight_group_beside_the_learners_nccl_world(tmp_path):
    """Rank 0's side of update_weights_from_distributed on real NCCL, next to the learner's own NCCL world
    (bound to its device, which once made torch split the new group from it and hang). One GPU cannot
    hold two NCCL ranks, so the weight group here has rank 0 alone: no SGLang server joins."""
    from nanoverl_async.config import SGLangConfig

    ports = [free_port(), free_port()]
    learner = LearnerRank(setup(write_model_dir(tmp_path), learner=dataclasses.replace(LEARNER, device="cuda")), 0,
                          "127.0.0.1", ports[0])
    subscriber = WeightSubscriber(learner.weights_endpoint())
    try:
        learner.connect_sglang([], SGLangConfig(control_timeout_s=60), "127.0.0.1", ports[1])
        assert learner.sender.group is not None
        learner.update(make_batch(), 0)
        learner.publish_weights(version=1)  # gathered on the GPU, broadcast over the weight group
        version, notice = wait_newest(subscriber, current_version=0, timeout_s=60)
        assert version == 1 and notice == {}  # the version notice carries no tensors
    finally:
        subscriber.close()
        learner.shutdown()
