"""How long a weight version takes from the learner to a generator on one host, through the socket (the payload
sent over ZeroMQ) against shared memory (the payload left in place, read by path), through the real classes.

    python bench/weights_latency.py [--models tiny,qwen-body] [--versions 3]

tiny: the built-in model in float32; qwen-body: the Qwen2.5-0.5B body on the tiny tokenizer, ~358M parameters,
float32 master weights in a one-rank `LearnerRank` (FSDP2), published in bfloat16 (717 MB a version). Per model
and transport, in the order socket, shared memory, shared memory, socket (A B B A: a drift of the machine's
load shows as a difference between the two blocks of one transport), --versions versions each, published one
at a time as the learner publishes one per step: `LearnerRank.publish_weights` (rank 0 copies each tensor,
cast, into its bucket; it returns once the buckets are queued), and the whole path from calling it until a
generator's copy of the model holds it (the publisher's checksum and send; the subscriber's copy and checksum,
or the socket's transfer and checksum; `load_state_dict` into a model in the run's dtype). min-max (median),
and the median of each block in the order run.
A first version per block warms the buckets (the learner reuses them) and is not counted.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from nanoverl_async.config import LearnerConfig, ModelConfig
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.setup import LearnerSetup
from nanoverl_async.models.load import DTYPES, resolve_model_path
from nanoverl_async.wire.weights import WeightSubscriber

TIMEOUT_S = 120
ORDER = ("socket", "shared memory", "shared memory", "socket")  # A B B A


def model(name: str) -> tuple[str, str]:
    """(model directory, the run's dtype)."""
    if name == "tiny":
        return resolve_model_path("builtin:tiny"), "float32"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from qwen_shape import qwen_body_with_tiny_tokenizer

    return qwen_body_with_tiny_tokenizer(), "bfloat16"


def block(rank: LearnerRank, generator_model, first_version: int, versions: int) -> tuple[list[float], list[float]]:
    """([publish_weights s], [publish_weights called -> the generator's model holds it s]) for versions
    first_version + 1 .. first_version + versions (first_version itself warms up)."""
    subscriber = WeightSubscriber(rank.weights_endpoint())
    publishing, applied = [], []
    try:
        for version in range(first_version, first_version + versions + 1):
            started = time.perf_counter()
            rank.publish_weights(version)
            published = time.perf_counter() - started
            while True:  # each bucket into the model as it comes, as a generator stages it
                bucket = subscriber.poll_bucket(version - 1)
                assert time.perf_counter() - started < TIMEOUT_S, f"version {version} not received"
                if bucket is None:
                    time.sleep(0.001)
                    continue
                generator_model.load_state_dict(bucket.tensors, strict=False)
                if bucket.index == bucket.count - 1:
                    break
            if version > first_version:
                publishing.append(published)
                applied.append(time.perf_counter() - started)
    finally:
        subscriber.close()
    return publishing, applied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,qwen-body", help="comma-separated: tiny, qwen-body")
    parser.add_argument("--versions", type=int, default=3, help="timed versions per block (4 blocks a model)")
    args = parser.parse_args()
    table = Table(title="Weights from the learner to a generator, one host, 2 torch threads: socket vs shared memory")
    for column in ("model", "MB a version", "transport", "publish_weights s", "publish -> applied s",
                   "applied: median per block"):
        table.add_column(column, justify="left" if column in ("model", "transport") else "right")
    span = lambda values: f"{min(values):.3f}-{max(values):.3f} ({statistics.median(values):.3f})"  # noqa: E731
    for name in args.models.split(","):
        path, dtype = model(name)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        setup = LearnerSetup(model=ModelConfig(path=path, dtype=dtype), learner=LearnerConfig(torch_threads=2))
        rank = LearnerRank(setup, 0, "127.0.0.1", port)
        generator_model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
        results: dict[str, tuple[list, list, list]] = {}
        try:
            version = 1
            for transport in ORDER:
                rank.publisher.shared_memory = transport == "shared memory"
                publishing, applied = block(rank, generator_model, version, args.versions)
                version += args.versions + 1
                results.setdefault(transport, ([], [], []))
                results[transport][0].extend(publishing)
                results[transport][1].extend(applied)
                results[transport][2].append(statistics.median(applied))
        finally:
            rank.shutdown()
        megabytes = sum(p.numel() for p in generator_model.state_dict().values()) * DTYPES[dtype].itemsize / 1e6
        for transport, (publishing, applied, blocks) in results.items():
            table.add_row(f"{name} ({dtype})", f"{megabytes:,.1f}", transport, span(publishing), span(applied),
                          ", ".join(f"{median:.3f}" for median in blocks))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
