"""The fake SGLang server follows docs/sglang.md "Contract checks", item by item (numbers in the test names).

The fake (tests/fake_sglang_server.py) is what the SGLang engine's own tests run against, so these tests
pin it to the protocol: response shapes and invariants, error shapes, abort/pause/retract semantics, and
both weight-update protocols. Tokens and logprobs are real (a tiny random Qwen2 in a tmp dir). Seconds
in all. Run alone: `python -m pytest tests/test_sglang_contract.py -q`.
"""

import json
import time

import httpx
import pytest

from fake_sglang_generate import ABORTED
from fake_sglang_server import FakeSGLangServer
from sglang_helpers import (PROMPT, assert_close, generate, model_dirs, post, reference_logprobs, server,  # noqa: F401
                            shared_server, threads, wait_tokens)

OK_PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
OK_CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}


def test_1_2_3_single_generate_invariants_and_real_logprobs(server, model_dirs):
    reply = generate(server, "traj7-turn2", 6, sampling={"temperature": 0.7})
    assert reply.status_code == 200
    body = reply.json()
    assert {"text", "output_ids", "meta_info"} <= set(body)
    meta, ids = body["meta_info"], body["output_ids"]
    assert meta["id"] == "traj7-turn2" and meta["prompt_tokens"] == len(PROMPT)
    assert len(ids) == meta["completion_tokens"] == len(meta["output_token_logprobs"]) == 6
    assert [t[1] for t in meta["output_token_logprobs"]] == ids
    assert all(t[2] is None for t in meta["output_token_logprobs"])  # 2: no text unless asked
    assert meta["input_token_logprobs"] == []  # 3: output logprobs only by default
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 6}] and meta["weight_version"] == "0"
    assert_close([t[0] for t in meta["output_token_logprobs"]], reference_logprobs(model_dirs[0], PROMPT, ids, 0.7))


def test_2_3_text_in_logprobs_and_input_logprobs(server):
    meta = generate(server, "t", 2, return_text_in_logprobs=True).json()["meta_info"]
    assert all(t[2] is not None for t in meta["output_token_logprobs"])
    meta = generate(server, "i", 1, logprob_start_len=0).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] and meta["input_token_logprobs"][0][0] is None
    meta = generate(server, "j", 1, logprob_start_len=2).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) + 2 == meta["prompt_tokens"]
    reply = generate(server, "k", 1, logprob_start_len=len(PROMPT) + 1)
    assert reply.status_code == 400 and "message" in reply.json()["error"]


def test_4_5_finish_reasons_stop_length_and_zero_tokens(server):
    body = generate(server, "s", 10, sampling={"stop_token_ids": list(range(96))}).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": body["output_ids"][-1]}
    assert len(body["output_ids"]) == 1  # the stop token is kept
    assert generate(server, "l", 3).json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    body = generate(server, "z", 0).json()
    assert body["output_ids"] == [] and body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_6_batches_in_order_and_n_grouped_with_fresh_rids(server):
    prompts = [[1, 2], [3, 4, 5], [6]]
    replies = post(server, "/generate", {"rid": "b", "input_ids": prompts, "sampling_params": {"max_new_tokens": 2}}).json()
    assert [r["meta_info"]["id"] for r in replies] == ["b_0", "b_1", "b_2"]
    assert [r["meta_info"]["prompt_tokens"] for r in replies] == [2, 3, 1]
    replies = post(server, "/generate", {"rid": "c", "input_ids": prompts[:2],
                                         "sampling_params": {"max_new_tokens": 2, "n": 2}}).json()
    assert [r["meta_info"]["prompt_tokens"] for r in replies] == [2, 2, 3, 3]
    rids = [r["meta_info"]["id"] for r in replies]
    assert len(set(rids)) == 4 and not any(r == "c" or r.startswith("c_") for r in rids)  # fresh ids, not derived from "c"


@pytest.mark.parametrize("sampling, body, shape", [
    ({"max_new_tokens": 2, "max_tokens": 2}, {}, "schema"),
    ({"max_new_tokens": 16.0}, {}, "schema"),
    ({"max_new_tokens": 2}, {"input_ids": None}, "value"),
    ({"max_new_tokens": 300}, {}, "value"),
])
def test_7_error_shapes(server, sampling, body, shape):
    request = {"input_ids": PROMPT, "sampling_params": sampling, **body}
    if request["input_ids"] is None:
        del request["input_ids"]
    reply = post(server, "/generate", request)
    assert reply.status_code == 400
    error = reply.json()["error"]
    if shape == "schema":  # {"error": "<text>"}
        assert isinstance(error, str) and ("unknown field `max_tokens`" in error or "floating point" in error)
    else:  # {"error": {"message": ...}}
        assert error["message"].startswith(("Either text, input_ids", "Requested token count exceeds"))


def test_7_duplicate_rid_and_validation_shape(server, threads):
    server.token_delay_s = 0.01
    first = threads.submit(generate, server, "dup", 200)
    wait_tokens(server, "dup", 1)
    reply = generate(server, "dup", 2)
    assert reply.status_code == 400 and reply.json() == {"error": {"message": "Duplicate request ID detected: dup"}}
    post(server, "/abort_request", {"rid": "dup"})
    assert first.result().json()["meta_info"]["finish_reason"] == ABORTED
    reply = post(server, "/pause_generation", {"mode": "sideways"})  # a FastAPI validation error
    assert reply.status_code == 400 and set(reply.json()) == {"object", "message", "type", "param", "code"}


def test_7_unknown_sampling_key_is_a_500_before_0_5_23(model_dirs):
    fake = FakeSGLangServer(model_dirs[0], fake_version="0.5.10").start()
    try:
        assert post(fake, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_tokens": 2}}).status_code == 500
    finally:
        fake.stop()


def test_8_stream_sends_cumulative_chunks_then_done(server):
    body = {"rid": "st", "input_ids": PROMPT, "return_logprob": True, "stream": True,
            "sampling_params": {"max_new_tokens": 5}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=30) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    for before, after in zip(chunks, chunks[1:]):
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]  # cumulative
    assert len(chunks[-1]["output_ids"]) == 5 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all("weight_versions" not in c["meta_info"] for c in chunks[:-1])
    assert "weight_versions" in chunks[-1]["meta_info"]


def test_9_pause_abort_returns_partial_tokens_blocks_and_resumes(server, threads):
    server.token_delay_s = 0.01
    running = threads.submit(generate, server, "x", 60)
    wait_tokens(server, "x", 3)
    assert post(server, "/pause_generation", {"mode": "abort"}).json() == OK_PAUSED
    reply = running.result()
    assert reply.status_code == 200
    partial = reply.json()
    assert partial["meta_info"]["finish_reason"] == ABORTED and 3 <= len(partial["output_ids"]) < 60
    blocked = threads.submit(generate, server, "y", 2)
    time.sleep(0.3)
    assert not blocked.done()  # a new /generate waits while paused
    assert post(server, "/continue_generation", {}).json() == OK_CONTINUED
    assert blocked.result().json()["meta_info"]["finish_reason"]["type"] == "length"
    server.token_delay_s = 0.0
    rest = generate(server, "x2", 60 - len(partial["output_ids"]), prompt=PROMPT + partial["output_ids"]).json()
    assert len(partial["output_ids"]) + len(rest["output_ids"]) == 60
    assert rest["meta_info"]["finish_reason"] == {"type": "length", "length": 60 - len(partial["output_ids"])}


def test_10_retract_then_update_leaves_two_version_spans(server, model_dirs, threads):
    server.token_delay_s = 0.03  # 17 tokens left take >= 0.5 s: the pause comes first
    running = threads.submit(generate, server, "r", 20)
    wait_tokens(server, "r", 3)
    assert post(server, "/pause_generation", {"mode": "retract"}).json() == OK_PAUSED
    flushed = httpx.get(server.url + "/flush_cache", timeout=10)
    assert flushed.status_code == 200 and flushed.headers["content-type"].startswith("text/plain")
    update = post(server, "/update_weights_from_disk", {"model_path": model_dirs[1], "weight_version": "1"})
    assert update.json()["success"] is True
    post(server, "/continue_generation", {})
    body = running.result().json()
    meta, ids = body["meta_info"], body["output_ids"]
    split = meta["weight_versions"][0]["end"]
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": split}, {"version": "1", "start": split, "end": 20}]
    assert meta["weight_version"] == "1" and meta["finish_reason"]["type"] == "length"
    logprobs = [t[0] for t in meta["output_token_logprobs"]]
    assert_close(logprobs[:split], reference_logprobs(model_dirs[0], PROMPT, ids)[:split])
    assert_close(logprobs[split:], reference_logprobs(model_dirs[1], PROMPT, ids)[split:])  # recomputed KV


def test_11_in_place_pause_refuses_flush(server, model_dirs):
    post(server, "/pause_generation", {"mode": "in_place"})
    assert httpx.get(server.url + "/flush_cache", timeout=10).status_code == 400
    reply = post(server, "/update_weights_from_disk", {"model_path": model_dirs[1], "flush_cache": True})
    assert reply.status_code == 400 and reply.json()["success"] is False
    assert "cache was not flushed" in reply.json()["message"]
    post(server, "/continue_generation", {})


def test_12_abort_request_by_prefix_all_and_unknown(server, threads):
    server.token_delay_s, server.max_running_requests = 0.01, 1
    first = threads.submit(generate, server, "ep1-turn0", 100)
    wait_tokens(server, "ep1-turn0", 1)
    queued = threads.submit(generate, server, "ep2-turn0", 5)
    server.wait_until(lambda: "ep2-turn0" in server.requests)
    assert post(server, "/abort_request", {"rid": "ep2"}).status_code == 200
    waiting = queued.result().json()["meta_info"]
    assert waiting["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in waiting and waiting["completion_tokens"] == 0
    unknown = post(server, "/abort_request", {"rid": "nobody"})
    assert unknown.status_code == 200 and unknown.content == b""
    assert not first.done()
    post(server, "/abort_request", {"abort_all": True})
    assert first.result().json()["meta_info"]["finish_reason"] == ABORTED


def test_13_disk_update_success_and_failure(server, model_dirs):
    reply = post(server, "/update_weights_from_disk", {"model_path": model_dirs[1], "weight_version": "7"})
    assert reply.status_code == 200 and reply.json() == {
        "success": True, "message": "Succeeded to update model weights. Weight version updated to 7.",
        "num_paused_requests": 0}
    info = httpx.get(server.url + "/model_info").json()
    assert info["model_path"] == model_dirs[1] and info["weight_version"] == "7"
    body = generate(server, "after", 4).json()
    assert body["meta_info"]["weight_version"] == "7"
    assert_close([t[0] for t in body["meta_info"]["output_token_logprobs"]],
                 reference_logprobs(model_dirs[1], PROMPT, body["output_ids"]))
    failed = post(server, "/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "8"})
    assert failed.status_code == 400 and failed.json()["success"] is False
    assert httpx.get(server.url + "/model_info").json()["weight_version"] == "7"


def test_13_14_update_waits_for_in_flight_or_aborts_them(server, model_dirs, threads):
    server.token_delay_s = 0.005
    running = threads.submit(generate, server, "w", 40)
    wait_tokens(server, "w", 1)
    update = threads.submit(post, server, "/update_weights_from_disk", {"model_path": model_dirs[1]})
    body = running.result().json()
    assert body["meta_info"]["finish_reason"]["type"] == "length"  # 14: the writer lock waited for it
    assert update.result().json()["success"] is True and set(body["meta_info"]["weight_versions"][0]) >= {"version"}
    running = threads.submit(generate, server, "w2", 200)
    wait_tokens(server, "w2", 1)
    post(server, "/update_weights_from_disk", {"model_path": model_dirs[0], "abort_all_requests": True})
    assert running.result().json()["meta_info"]["finish_reason"] == ABORTED  # 13: abort_all_requests


@pytest.mark.parametrize("fake_version", ["0.5.23", "0.5.10"])
def test_15_distributed_update_handshake_by_version(model_dirs, fake_version):
    fake = FakeSGLangServer(model_dirs[0], fake_version=fake_version).start()
    try:
        group = {"master_address": "127.0.0.1", "master_port": "29600", "rank_offset": 1, "world_size": 2,
                 "group_name": "weight_update_group", "backend": "nccl"}  # AReaL sends the port as a string
        assert post(fake, "/init_weights_update_group", group).json()["success"] is True
        update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                  "group_name": "weight_update_group", "weight_version": "3"}
        if fake_version == "0.5.23":
            for path in ("/update_weights_from_distributed", "/update_weights_from_tensor"):
                refused = post(fake, path, update if "distributed" in path else {"serialized_named_tensors": []})
                assert refused.status_code == 400 and "begin_weight_update()" in refused.json()["message"]
            assert post(fake, "/end_weight_update", {}).status_code == 400  # end without begin
            assert post(fake, "/begin_weight_update", {"selector": "all"}).json() == {"success": True, "message": "Success"}
            assert post(fake, "/begin_weight_update", {"selector": "all"}).status_code == 400  # twice
        else:
            assert post(fake, "/begin_weight_update", {}).status_code == 404  # legacy: no begin/end
        import torch

        fake.nccl.put(torch.full((64,), 2.0))  # what rank 0 would broadcast
        assert post(fake, "/update_weights_from_distributed", update).json()["success"] is True
        assert float(fake.engine.model.model.norm.weight[0].detach()) == 2.0 and fake.weight_version == "3"
        bad = {**update, "dtypes": ["torch.float32"]}  # dtypes are torch attribute names
        assert post(fake, "/update_weights_from_distributed", bad).status_code == 400
    finally:
        fake.stop()


@pytest.mark.parametrize("fake_version, path, status", [
    ("0.5.2", "/get_weight_version", 200), ("0.5.2", "/model_info", 404),
    ("0.5.10", "/get_weight_version", 404), ("0.5.10", "/model_info", 200), ("0.5.23", "/model_info", 200)])
def test_16_weight_version_read_paths(model_dirs, fake_version, path, status):
    from nanoverl_async.wire.sglang_http import SGLangClient, SGLangError

    fake = FakeSGLangServer(model_dirs[0], weight_version="5", fake_version=fake_version).start()
    try:
        reply = httpx.get(fake.url + path)
        assert reply.status_code == status and (status != 200 or reply.json()["weight_version"] == "5")
        client = SGLangClient(fake.url, timeout_s=30.0)
        if fake_version == "0.5.2":  # refused by name: it pauses without a mode and reads versions elsewhere
            with pytest.raises(SGLangError, match="runs SGLang 0.5.2; nanoverl-async needs 0.5.10 or newer"):
                client.detect_protocol()
        else:
            client.detect_protocol()
            assert client.weight_version() == "5" and client.legacy_protocol == (fake_version != "0.5.23")
        client.close()
    finally:
        fake.stop()


def test_17_health_memory_and_control_shapes(model_dirs):
    fake = FakeSGLangServer(model_dirs[0]).start(load=False)
    try:
        assert httpx.get(fake.url + "/health").status_code == 503  # starting
        fake.load()
        health = httpx.get(fake.url + "/health")
        assert health.status_code == 200 and health.content == b""
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            reply = post(fake, path, {"tags": ["kv_cache", "weights"]})
            assert reply.status_code == 200 and reply.json() is None
        assert post(fake, "/pause_generation", {}).json() == OK_PAUSED
        assert post(fake, "/continue_generation", {}).json() == OK_CONTINUED
        version = post(fake, "/update_weight_version", {"new_version": "8", "abort_all_requests": True}).json()
        assert version == {"success": True, "message": "Weight version updated to 8", "new_version": "8"}
    finally:
        fake.stop()
