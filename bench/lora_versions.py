"""What a weight version weighs with LoRA against the whole model, through the real classes, one table.

    python bench/lora_versions.py [--models smollm2,qwen-0.5b] [--rank 16]

smollm2: SmolLM2-135M (builtin:smollm2-135m, its converted weights; float32, as configs/smollm2_tools.yaml runs
it); qwen-0.5b: Qwen2.5-0.5B-Instruct's exact shape (bench/qwen_shape.py: 151,936-token vocabulary, random
weights), bfloat16. For each, one `LearnerRank` (world size 1) trains the whole model, another LoRA of
--rank on every linear layer (learner.lora defaults: all-linear, alpha 32): parameters trained, the bytes of
one published version (the tensors of the payload a subscriber receives; weights.py's header adds a few KB),
and the seconds from `publish_weights` to a subscriber holding it, the median of three versions after one
that warms the payloads. Shared memory on this host, as a local run publishes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benches beside this file
from qwen_shape import qwen_shaped_model  # noqa: E402

from nanoverl_async.config import LearnerConfig, LoRAConfig, ModelConfig  # noqa: E402
from nanoverl_async.learners.fsdp_rank import LearnerRank  # noqa: E402
from nanoverl_async.learners.setup import LearnerSetup  # noqa: E402
from nanoverl_async.models.load import resolve_model_path  # noqa: E402
from nanoverl_async.wire.weights import WeightSubscriber  # noqa: E402

TIMEOUT_S = 300
VERSIONS = 3


def model(name: str, scratch: str) -> tuple[str, str]:
    """(model directory, the run's dtype)."""
    if name == "smollm2":
        return resolve_model_path("builtin:smollm2-135m"), "float32"
    return qwen_shaped_model(os.path.join(scratch, "qwen-0.5b")), "bfloat16"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(path: str, dtype: str, lora: LoRAConfig) -> tuple[int, int, float]:
    """(parameters trained, bytes of a version, median s from publish_weights to a subscriber holding it)."""
    setup = LearnerSetup(ModelConfig(path=path, dtype=dtype), LearnerConfig(torch_threads=2, lora=lora))
    rank = LearnerRank(setup, 0, "127.0.0.1", free_port())
    subscriber = WeightSubscriber(rank.weights_endpoint())
    seconds, nbytes = [], 0  # bytes of the tensors a subscriber received
    try:
        trained = sum(p.numel() for p in rank.model.parameters() if p.requires_grad)
        for version in range(1, VERSIONS + 2):
            started = time.perf_counter()
            rank.publish_weights(version)
            while (newest := subscriber.poll_newest(version - 1)) is None:
                assert time.perf_counter() - started < TIMEOUT_S, f"version {version} not received"
                time.sleep(0.001)
            if version > 1:
                seconds.append(time.perf_counter() - started)
            nbytes = sum(t.numel() * t.element_size() for t in newest[1].values())
    finally:
        subscriber.close()
        rank.shutdown()
    return trained, nbytes, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,qwen-0.5b", help="comma-separated: smollm2, qwen-0.5b")
    parser.add_argument("--rank", type=int, default=16, help="learner.lora.rank of the LoRA rows")
    args = parser.parse_args()
    table = Table(title="One weight version, whole model against LoRA (learner.lora.rank="
                        f"{args.rank}, all-linear), one host, shared memory")
    for column in ("model", "dtype", "trained", "parameters trained", "MB a version", "publish -> held s"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            path, dtype = model(name, scratch)
            for label, lora in (("whole model", LoRAConfig()), ("LoRA", dataclasses.replace(LoRAConfig(),
                                                                                             rank=args.rank))):
                trained, nbytes, seconds = measure(path, dtype, lora)
                table.add_row(name, dtype, label, f"{trained / 1e6:.2f}M", f"{nbytes / 1e6:.1f}", f"{seconds:.3f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
