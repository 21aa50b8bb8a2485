"""How long a weight version takes from the learner to a generator on one host, and where the time goes,
for a model the size of the GPU benches' (bench/qwen_shape.py), through the real classes.

    python bench/weights_latency.py [--model qwen-body|tiny] [--versions 4]

qwen-body (the default): the Qwen2.5-0.5B body on the tiny tokenizer, ~358M parameters, float32 master
weights in a one-rank `LearnerRank` (FSDP2), published in bfloat16 (717 MB on the wire); tiny: the built-in
model in float32. Prints one table: `LearnerRank.publish_weights` (rank 0 gathers each tensor, casts it and
copies it into the wire payload; it returns once the payload is queued), then the whole path from calling
it to a `WeightSubscriber.poll_newest` returning the version (the publisher's checksum and send, ZeroMQ
over TCP loopback, the subscriber's checksum, tensors viewing the frame), min-max (median) over
--versions versions, each published once the previous one was received, as the learner publishes one per
step; and the checksum alone, xxh3-128 against blake2b-128, on the same payload.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from nanoverl_async.config import LearnerConfig, ModelConfig
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.setup import LearnerSetup
from nanoverl_async.models import DTYPES, resolve_model_path
from nanoverl_async.weights import WeightSubscriber, checksum, serialise

TIMEOUT_S = 120


def model(name: str) -> tuple[str, str]:
    """(model directory, the run's dtype)."""
    if name == "tiny":
        return resolve_model_path("builtin:tiny"), "float32"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from qwen_shape import qwen_body_with_tiny_tokenizer

    return qwen_body_with_tiny_tokenizer(), "bfloat16"


def seconds(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def learner_to_generator(rank: LearnerRank, versions: int) -> tuple[list[float], list[float]]:
    """([publish_weights s], [publish_weights called -> poll_newest returned s]) per version."""
    subscriber = WeightSubscriber(rank.weights_endpoint())
    publishing, received = [], []
    try:
        for version in range(1, versions + 1):
            started = time.perf_counter()
            rank.publish_weights(version)
            publishing.append(time.perf_counter() - started)
            while subscriber.poll_newest(version - 1) is None:
                assert time.perf_counter() - started < TIMEOUT_S, f"version {version} not received"
                time.sleep(0.002)
            received.append(time.perf_counter() - started)
    finally:
        subscriber.close()
    return publishing, received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen-body", choices=("qwen-body", "tiny"))
    parser.add_argument("--versions", type=int, default=4)
    args = parser.parse_args()
    path, dtype = model(args.model)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rank = LearnerRank(LearnerSetup(model=ModelConfig(path=path, dtype=dtype), learner=LearnerConfig(torch_threads=2)),
                       0, "127.0.0.1", port)
    try:
        publishing, received = learner_to_generator(rank, args.versions)
        payload = serialise({name: tensor.full_tensor().to(DTYPES[dtype])
                             for name, tensor in rank.model.state_dict().items()})
    finally:
        rank.shutdown()
    table = Table(title=f"Weights from the learner to a generator, one host: {args.model}, "
                        f"{sum(p.numel() for p in rank.model.parameters()) / 1e6:.0f}M parameters, {dtype} on the wire "
                        f"({payload.nbytes / 1e6:,.0f} MB a version), 2 torch threads")
    table.add_column("")
    table.add_column("seconds", justify="right")
    span = lambda values: f"{min(values):.2f}-{max(values):.2f} ({statistics.median(values):.2f})"  # noqa: E731
    table.add_row(f"LearnerRank.publish_weights, {args.versions} versions: min-max (median)", span(publishing))
    table.add_row("publish_weights called -> the generator's poll_newest returns it", span(received))
    table.add_row("checksum alone: xxh3-128 (the wire's)", f"{seconds(lambda: checksum(payload)):.3f}")
    table.add_row("checksum alone: blake2b-128, for comparison",
                  f"{seconds(lambda: hashlib.blake2b(payload, digest_size=16).digest()):.3f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
