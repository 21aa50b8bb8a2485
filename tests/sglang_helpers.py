"""Shared pieces of the SGLang tests: two tiny random Qwen2 checkpoints, a fake-server fixture, a reference
forward for logprobs, and small HTTP helpers. Not a test module (no test_ prefix)."""

import functools
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from fake_sglang_server import FakeSGLangServer

PROMPT = [5, 6, 7, 8, 9]
TOL = 1e-4


def tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two checkpoints of the same architecture: weights version 0 and version 1."""
    torch.set_num_threads(1)
    dirs = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"qwen2_v{seed}")
        tiny_qwen2(seed).save_pretrained(path)
        dirs.append(str(path))
    return dirs


@pytest.fixture(scope="module")
def shared_server(model_dirs):
    fake = FakeSGLangServer(model_dirs[0], weight_version="0").start()
    fake.initial_state = {k: v.clone() for k, v in fake.engine.model.state_dict().items()}
    yield fake
    fake.stop()


@pytest.fixture
def server(shared_server, model_dirs):
    """The module's fake server, reset to a fresh start: weights version 0, not paused, no requests."""
    fake = shared_server

    async def reset():
        fake.engine.stage_weights(fake.initial_state, 0)

    fake.on_loop(reset())
    fake.paused, fake.updating, fake.in_begin, fake.groups = None, False, False, {}
    fake.token_delay_s, fake.max_running_requests = 0.0, 1 << 20
    fake.weight_version, fake.model_path, fake.calls = "0", model_dirs[0], []
    yield fake
    fake.abort_matching(lambda rid: True)
    fake.paused = None
    fake.wait_until(lambda: not fake.requests)


@pytest.fixture
def threads():
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


def post(server, path: str, body=None, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def generate(server, rid: str, max_new_tokens: int, prompt=PROMPT, **extra) -> httpx.Response:
    body = {"rid": rid, "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, **extra.pop("sampling", {})}, **extra}
    return post(server, "/generate", body)


def wait_tokens(server, rid: str, count: int, timeout_s: float = 20.0) -> None:
    """Until request `rid` has sampled at least `count` tokens (it must be in flight)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        request = server.requests.get(rid)
        if request is not None and len(request.out) >= count:
            return
        assert time.monotonic() < deadline, f"request {rid} never reached {count} tokens"
        time.sleep(0.005)


@functools.lru_cache(maxsize=4)
def _model(model_dir: str) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(model_dir).eval()


def reference_logprobs(model_dir: str, prompt: list, tokens: list, temperature: float = 1.0) -> list:
    """log softmax(logits / T) of each token given everything before it, from one full forward."""
    model = _model(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits / temperature, -1)
    return logprobs.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL, (got, want)
