"""SGLangEngine with LoRA (learner.lora) against the fake SGLang server's multi-LoRA serving
(tests/fake_sglang_lora.py): a version is an adapter folder loaded with /load_lora_adapter, requests name the
adapter of their version (`lora_path`) and their tokens carry it, adapters no request names are unloaded, the
launch flags, SGLang's refusals, and (slow) the CLI on fake server processes with LoRA.

Run alone: `python -m pytest tests/test_sglang_lora.py -q`.
"""

import asyncio

import pytest
import torch
from transformers import Qwen2ForCausalLM

from nanoverl_async.config import LoRAConfig, SGLangConfig
from nanoverl_async.agents.engine import SamplingParams
from nanoverl_async.wire.sglang_http import SGLangError
from nanoverl_async.generators.sglang_engine import SGLangEngine
from nanoverl_async.generators.sglang_server import SGLangServer
from nanoverl_async.models import lora
from sglang_helpers import PROMPT, assert_close, model_dirs, reference_logprobs, server, shared_server  # noqa: F401
from test_sglang_engine import run_cli_on_fake_servers

ADAPTERS = LoRAConfig(rank=4, alpha=8.0)


def adapters_and_merged(model_dir: str, seed: int, out_dir) -> tuple[dict, str]:
    """A version's adapters (PEFT's keys, random A and B from `seed`) for the model in `model_dir`, and a
    directory holding the model they make (W0 + s B A), for reference logprobs."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    lora.add_adapters(model, ADAPTERS)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if lora.adapter_key(name) is not None:
                parameter.normal_(0, 0.3)
    state = model.state_dict()
    merged = Qwen2ForCausalLM.from_pretrained(model_dir)
    merged.load_state_dict(lora.merged_state(state, lora.scaling(ADAPTERS)))
    merged.save_pretrained(out_dir)
    return {lora.adapter_key(n): t for n, t in state.items() if lora.adapter_key(n) is not None}, str(out_dir)


@pytest.fixture
def lora_server(server):
    server.lora_enabled, server.max_lora_rank = True, 8
    yield server
    server.adapter_engines().clear()
    server.lora_enabled = False


def lora_engine(fake, tmp_path) -> SGLangEngine:
    config = SGLangConfig(weights_dir=str(tmp_path / "weights"))
    return SGLangEngine(fake.model_path, config, servers=[SGLangServer(fake.model_path, fake.port, config,
                                                                       url=fake.url, lora=ADAPTERS)], lora=ADAPTERS)


def test_a_version_is_an_adapter_new_requests_name_and_a_request_keeps_its_own(lora_server, model_dirs, tmp_path):
    engine = lora_engine(lora_server, tmp_path)
    v1, merged_1 = adapters_and_merged(model_dirs[0], 1, tmp_path / "m1")
    v2, _ = adapters_and_merged(model_dirs[0], 2, tmp_path / "m2")
    lora_server.token_delay_s = 0.02

    async def run():
        in_flight = asyncio.create_task(engine.generate(PROMPT, SamplingParams(40, 1.0)))
        while not any(len(r.out) >= 3 for r in list(lora_server.requests.values())):
            await asyncio.sleep(0.005)
        await asyncio.to_thread(engine.stage_weights, v1, 1)  # no pause: the request goes on with the base
        after = await engine.generate(PROMPT, SamplingParams(20, 1.0))
        return await in_flight, after

    before, after = asyncio.run(run())
    assert before.versions == [0] * 40 and after.versions == [1] * 20
    assert_close(before.logprobs, reference_logprobs(model_dirs[0], PROMPT, before.token_ids))
    assert_close(after.logprobs, reference_logprobs(merged_1, PROMPT, after.token_ids))
    assert "/pause_generation" not in lora_server.calls and lora_server.calls.count("/load_lora_adapter") == 1
    assert (tmp_path / "weights" / "generator_0" / "v1" / "adapter_config.json").exists()

    engine.stage_weights(v2, 2)  # v1 is named by no request any more: unloaded, its folder deleted
    assert set(lora_server.adapter_engines()) == {"v2"} and engine.adapter == "v2" and engine.version == 2
    assert sorted(p.name for p in (tmp_path / "weights" / "generator_0").iterdir()) == ["v2"]


def test_an_adapter_a_request_still_names_stays_loaded_until_a_later_version(lora_server, model_dirs, tmp_path):
    engine = lora_engine(lora_server, tmp_path)
    versions = [adapters_and_merged(model_dirs[0], seed, tmp_path / f"m{seed}")[0] for seed in (1, 2, 3)]
    engine.stage_weights(versions[0], 1)
    lora_server.token_delay_s = 0.02

    async def run():
        task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(40, 1.0)))
        while not any(len(r.out) >= 3 for r in list(lora_server.requests.values())):
            await asyncio.sleep(0.005)
        await asyncio.to_thread(engine.stage_weights, versions[1], 2)
        loaded_meanwhile = set(lora_server.adapter_engines())
        return await task, loaded_meanwhile

    completion, loaded_meanwhile = asyncio.run(run())
    assert completion.versions == [1] * 40 and loaded_meanwhile == {"v1", "v2"}
    engine.stage_weights(versions[2], 3)
    assert set(lora_server.adapter_engines()) == {"v3"}


def test_servers_launch_with_sglang_s_lora_flags_sized_for_the_run():
    config = SGLangConfig(server_command=["serve"])
    plain = SGLangServer("m", 30000, config).launch_args()
    args = SGLangServer("m", 30000, config, lora=LoRAConfig(rank=16)).launch_args()
    assert "--enable-lora" not in plain
    assert args[args.index("--max-lora-rank") + 1] == "16" and args[args.index("--lora-target-modules") + 1] == "all"
    listed = SGLangServer("m", 30000, config, lora=LoRAConfig(rank=8, target_modules=["q_proj", "v_proj"]))
    args = listed.launch_args()
    assert args[args.index("--lora-target-modules") + 1:][:2] == ["q_proj", "v_proj"] and "--enable-lora" in args


def test_sglang_refuses_an_adapter_it_cannot_serve(server, model_dirs, tmp_path):
    engine = lora_engine(server, tmp_path)
    adapters, _ = adapters_and_merged(model_dirs[0], 1, tmp_path / "m1")
    with pytest.raises(SGLangError, match="LoRA is not enabled"):  # a server launched without --enable-lora
        engine.stage_weights(adapters, 1)
    server.lora_enabled, server.max_lora_rank = True, 3
    try:
        with pytest.raises(SGLangError, match="rank 4 > --max-lora-rank 3"):
            engine.stage_weights(adapters, 1)
        assert engine.adapter is None and engine.version == 0  # the base stays current
    finally:
        server.lora_enabled = False


@pytest.mark.slow
def test_cli_runs_lora_on_sglang_fake_server_processes(ray_session, tmp_path):
    rows = run_cli_on_fake_servers(tmp_path, "learner.lora.rank=4", "learner.lr=1e-3")
    assert rows[-1]["learner/version"] == 3
    folders = sorted((tmp_path / "w" / "generator_0").iterdir())
    assert folders and all((folder / lora.ADAPTER_FILE).exists() for folder in folders)
