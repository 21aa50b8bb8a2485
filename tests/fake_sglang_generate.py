"""`POST /generate` of the fake SGLang server (tests/fake_sglang_server.py): validation, batches, `n`,
streaming, and the per-request token loop with abort / pause / retract (docs/sglang.md "Generation").

Each request runs as a coroutine on the server's event loop; it samples one token per engine call, so
concurrent requests batch in the transformers engine and every logprob is real:
log softmax(logits / temperature)[token]. Not runnable alone; see tests/test_sglang_contract.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import torch

from nanoverl_async.agents.engine import SamplingParams

INT_KEYS = ("max_new_tokens", "top_k", "n", "min_new_tokens", "sampling_seed")
FLOAT_KEYS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
OTHER_KEYS = ("stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
              "no_stop_trim", "json_schema", "regex", "ebnf", "logit_bias", "custom_params")
SAMPLING_KEYS = ("max_new_tokens", "stop", *INT_KEYS[1:], *FLOAT_KEYS, *OTHER_KEYS[1:])
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@dataclass
class _Request:
    rid: str
    ids: list[int]
    sampling: dict
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text: bool = False
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    lora: Optional[str] = None  # the adapter the request names (fake_sglang_lora.py); None: the base
    finish: Optional[dict] = None
    aborted: bool = False
    waiting: bool = True  # in the waiting queue (not yet prefilled)
    parked: bool = False  # retracted / frozen by a pause
    queue_abort: bool = False
    done: bool = False  # its coroutine has ended (the reply is ready)
    started: float = field(default_factory=time.perf_counter)


def schema_error(text: str):
    from fake_sglang_server import HTTPError

    return HTTPError(400, {"error": text})


class GenerateMixin:
    """Mixed into FakeSGLangServer (which provides engine, lock, requests, paused, updating, ...)."""

    def check_sampling(self, sampling: dict) -> None:
        from fake_sglang_server import HTTPError

        for key, value in sampling.items():
            if key not in SAMPLING_KEYS:
                if not self.v23:  # older servers: an uncaught TypeError
                    raise HTTPError(500, {"error": {"message": f"TypeError: SamplingParams.__init__() got an "
                                                                f"unexpected keyword argument '{key}'"}})
                expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
                raise schema_error(f"unknown field `{key}`, expected one of {expected}")
            if key in INT_KEYS and not (isinstance(value, int) and not isinstance(value, bool)):
                kind = "floating point" if isinstance(value, float) else type(value).__name__
                raise schema_error(f"invalid type: {kind} `{value}`, expected an integer (field `{key}`)")
        top_p = sampling.get("top_p", 1.0)
        if not 0 < top_p <= 1:
            raise schema_error(f"top_p must be in (0, 1], got {top_p}")

    def make_requests(self, body: dict) -> tuple[list[_Request], bool]:
        from fake_sglang_server import value_error

        sampling = dict(body.get("sampling_params") or {})
        self.check_sampling(sampling)
        ids = body.get("input_ids")
        if ids is None and body.get("text") is not None:
            raise value_error("fake server: send input_ids (text input needs a tokenizer)")
        if ids is None:
            raise value_error("Either text, input_ids or input_embeds should be provided.")
        batch = bool(ids) and isinstance(ids[0], list)
        prompts, rid = (ids if batch else [ids]), body.get("rid")
        rids = (rid if isinstance(rid, list) else [f"{rid}_{i}" if rid else uuid.uuid4().hex
                                                   for i in range(len(prompts))]) if batch else [rid or uuid.uuid4().hex]
        n = sampling.pop("n", 1)
        if n > 1:  # grouped by prompt, each sample with a fresh rid
            prompts, rids = [p for p in prompts for _ in range(n)], [uuid.uuid4().hex for _ in range(len(prompts) * n)]
        requests = [_Request(r, list(p), sampling, bool(body.get("return_logprob")),
                             int(body.get("logprob_start_len", -1)), bool(body.get("return_text_in_logprobs")))
                    for r, p in zip(rids, prompts)]
        for request in requests:
            request.lora = body.get("lora_path")
            self.engine_for(request.lora)  # a request naming an adapter not loaded is refused before it starts
            self.check_request(request)
        with self.lock:
            seen = set(self.requests)
            for request in requests:
                if request.rid in seen:
                    raise value_error(f"Duplicate request ID detected: {request.rid}")
                seen.add(request.rid)
            self.requests.update({r.rid: r for r in requests})
        return requests, batch or n > 1

    def check_request(self, request: _Request) -> None:
        from fake_sglang_server import value_error

        total = len(request.ids) + request.sampling.get("max_new_tokens", 128)
        if total > self.context_length:
            raise value_error(f"Requested token count exceeds the model's maximum context length of "
                              f"{self.context_length} tokens. You requested a total of {total} tokens: "
                              f"{len(request.ids)} tokens from the input messages and "
                              f"{total - len(request.ids)} tokens for the completion.")
        if request.logprob_start_len > len(request.ids):
            raise value_error(f"logprob_start_len ({request.logprob_start_len}) is superior to the number "
                              f"of input tokens ({len(request.ids)})")

    def generate_endpoint(self, body: dict):
        requests, is_list = self.make_requests(body or {})
        futures = [asyncio.run_coroutine_threadsafe(self.run_request(r), self.loop) for r in requests]
        if body.get("stream"):
            return lambda handler: self.stream(handler, requests, futures, is_list)
        for future in futures:
            future.result(600)
        replies = [self.reply(r) for r in requests]
        return 200, replies if is_list else replies[0]

    async def run_request(self, request: _Request) -> None:
        try:
            while self.paused or self.updating or self.running() >= self.max_running_requests:
                if request.aborted:
                    message = "Abort before prefill" if self.fake_version == "0.5.2" else "Abort in waiting queue"
                    request.finish, request.queue_abort = {"type": "abort", "message": message}, True
                    return
                await asyncio.sleep(0.002)
            request.waiting = False
            await self.decode(request)
            if request.return_logprob and request.logprob_start_len >= 0:
                request.input_logprobs = self.input_logprobs(request.ids, request.logprob_start_len)
        finally:
            with self.lock:
                self.requests.pop(request.rid, None)
            request.done = True

    def running(self) -> int:
        return sum(not r.waiting for r in list(self.requests.values()))

    async def decode(self, request: _Request) -> None:
        sampling = request.sampling
        limit, temperature = sampling.get("max_new_tokens", 128), sampling.get("temperature", 1.0) or 1e-4
        stops = set(sampling.get("stop_token_ids") or []) | (set() if sampling.get("ignore_eos") else self.eos_ids)
        while request.finish is None:
            if len(request.out) >= limit:
                request.finish = {"type": "length", "length": limit}
            elif request.aborted:
                request.finish = dict(ABORTED)
            elif self.paused in ("retract", "in_place"):
                request.parked = True
                await asyncio.sleep(0.002)
            else:
                request.parked = False
                version = self.weight_version
                engine = self.engine_for(request.lora)
                completion = await engine.generate(request.ids + request.out, SamplingParams(1, temperature))
                token = completion.token_ids[0]
                request.out.append(token)
                request.logprobs.append(completion.logprobs[0])
                request.versions.append(version)
                if token in stops:
                    request.finish = {"type": "stop", "matched": token}
                await asyncio.sleep(self.token_delay_s)

    def input_logprobs(self, ids: list[int], start: int) -> list:
        with torch.no_grad():
            logits = self.engine.model(input_ids=torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, -1)
        entries = [[None if i == start else logprobs[i - 1, ids[i]].item(), ids[i], None]
                   for i in range(start, len(ids))]
        return entries

    def reply(self, request: _Request, final: bool = True) -> dict:
        n = len(request.out)
        spans = []
        for i, version in enumerate(request.versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": version, "start": i, "end": i + 1})
        meta = {"id": request.rid, "finish_reason": request.finish if final else None,
                "prompt_tokens": len(request.ids), "completion_tokens": n, "cached_tokens": 0,
                "reasoning_tokens": 0, "num_retractions": 0,
                "weight_version": spans[-1]["version"] if spans and final else self.weight_version,
                "e2e_latency": time.perf_counter() - request.started, "response_sent_to_client_ts": time.time()}
        if request.queue_abort:
            del meta["prompt_tokens"]
        if self.v23 and final:
            meta["weight_versions"] = spans
        if request.return_logprob:
            text = [str(t) if request.return_text else None for t in request.out]
            meta["input_token_logprobs"] = getattr(request, "input_logprobs", [])
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(request.logprobs, request.out, text)]
            meta["output_token_logprobs_length"] = n
        return {"text": " ".join(map(str, request.out)), "output_ids": list(request.out), "meta_info": meta}

    def stream(self, handler, requests: list[_Request], futures: list, is_list: bool) -> None:
        """Server-sent events: cumulative chunks as tokens appear, a final chunk each, then [DONE]."""
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        handler.end_headers()
        sent, finished = [0] * len(requests), [False] * len(requests)
        while not all(finished):
            for i, (request, future) in enumerate(zip(requests, futures)):
                done = future.done()
                if finished[i] or (not done and len(request.out) == sent[i]):
                    continue
                chunk = self.reply(request, final=done)
                if is_list:
                    chunk["index"] = i
                handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                handler.wfile.flush()
                sent[i], finished[i] = len(request.out), done
            time.sleep(0.002)
        handler.wfile.write(b"data: [DONE]\n\n")
        handler.wfile.flush()
