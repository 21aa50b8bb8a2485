"""How long a weight version takes from `WeightPublisher.publish` to `WeightSubscriber.poll_newest` on one
host, and where the time goes, for a model the size of the GPU benches' (bench/qwen_shape.py).

    python bench/weights_latency.py [--model qwen-body|tiny] [--versions 4]

qwen-body (the default): the Qwen2.5-0.5B body on the tiny tokenizer, ~358M parameters in bfloat16 (716 MB on
the wire); tiny: the built-in model. Prints one table: each stage alone (the payload's layout, its
checksum, blake2b's checksum for comparison, reading the payload back as tensors), then the whole path
publish -> received (serialise, checksum, ZMQ over TCP loopback, checksum, views), min-max over --versions
versions, each published once the previous one was received, as the learner publishes one per step.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file

from nanoverl_async.models import resolve_model_path
from nanoverl_async.weights import WeightPublisher, WeightSubscriber, checksum, deserialise, serialise

TIMEOUT_S = 120


def state_dict(model: str) -> dict[str, torch.Tensor]:
    if model == "tiny":
        path = resolve_model_path("builtin:tiny")
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from qwen_shape import qwen_body_with_tiny_tokenizer

        path = qwen_body_with_tiny_tokenizer()
    return {name: tensor for file in sorted(os.listdir(path)) if file.endswith(".safetensors")
            for name, tensor in load_file(os.path.join(path, file)).items()}


def seconds(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def publish_to_received(weights: dict[str, torch.Tensor], versions: int) -> list[float]:
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoint)
    latencies = []
    try:
        for version in range(1, versions + 1):
            copies = {name: tensor.clone() for name, tensor in weights.items()}  # the learner's fresh copies
            started = time.perf_counter()
            publisher.publish(version, copies)
            del copies
            while subscriber.poll_newest(version - 1) is None:
                assert time.perf_counter() - started < TIMEOUT_S, f"version {version} not received"
                time.sleep(0.002)
            latencies.append(time.perf_counter() - started)
    finally:
        subscriber.close()
        publisher.close()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen-body", choices=("qwen-body", "tiny"))
    parser.add_argument("--versions", type=int, default=4)
    args = parser.parse_args()
    weights = state_dict(args.model)
    payload = serialise(weights)
    stages = {
        "serialise (safetensors layout, torch copies)": seconds(lambda: serialise(weights)),
        "checksum (xxh3-128)": seconds(lambda: checksum(payload)),
        "checksum blake2b-128, for comparison": seconds(lambda: hashlib.blake2b(payload, digest_size=16).digest()),
        "deserialise (views of the frame)": seconds(lambda: deserialise(memoryview(payload))),
    }
    latencies = publish_to_received(weights, args.versions)
    parameters = sum(tensor.numel() for tensor in weights.values())
    table = Table(title=f"Weights, one host: {args.model}, {parameters / 1e6:.0f}M parameters, "
                        f"{payload.nbytes / 1e6:,.0f} MB a version, torch threads {torch.get_num_threads()}")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    for stage, value in stages.items():
        table.add_row(stage, f"{value:.3f}")
    table.add_row(f"publish -> received, {args.versions} versions (min-max)",
                  f"{min(latencies):.2f}-{max(latencies):.2f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
