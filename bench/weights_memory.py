"""The host memory a weights version costs each end, through the real classes: a publisher process (learner rank
0's side: its model, then `WeightPublisher.writable_buckets` written and published version after version) and a
subscriber process (a generator's side: its model, each bucket `poll_bucket` hands on copied into it), per
transport (socket, shared memory).

    python bench/weights_memory.py [--model-mb 400] [--bucket-mb 32] [--versions 3]

The model is random float32 tensors (--model-mb of 4 MiB tensors and one of 2.5 buckets, larger than a bucket).
Each process measures its peak RSS above its own model (VmHWM, reset after the model is built, minus VmRSS then;
/proc/self/status), and how much of that peak was shared memory (RssShmem, sampled every 2 ms: the publisher's
memfd buckets). The bounds: publisher extra <= 1.25 x the bytes a version publishes; subscriber extra <= one
bucket (the largest) beyond its model: its one copy of the bucket it holds, joined from the socket's parts,
plus the parts ZeroMQ has received meanwhile (weights.RECEIVE_QUEUE of weight_messages.PART_BYTES, and one on
its way in). Versions
are published one at a time, each once the subscriber holds the one before, as the learner publishes one per
step. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import torch

from nanoverl_async.wire.weights import WeightPublisher, WeightSubscriber

MIB = 2**20
TENSOR_MIB = 4
TIMEOUT_S = 120


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssShmem of this process, in bytes."""
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


class Peak:
    """The largest memory above the baseline taken at construction, sampled every 2 ms: private (RssAnon) plus
    shared (RssShmem) pages, which a process's data takes (RssFile, the libraries' code it pages in, is not
    counted), and RssShmem alone at that peak. `hwm`: the kernel's VmHWM above the baseline's VmRSS (reset then;
    code pages included), which no sampling misses."""

    def __init__(self):
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")  # resets VmHWM to the current RSS
        self.base = status()
        self.extra = self.shmem = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            now = status()
            shmem = now["RssShmem"] - self.base["RssShmem"]
            if now["RssAnon"] - self.base["RssAnon"] + shmem > self.extra:
                self.extra, self.shmem = now["RssAnon"] - self.base["RssAnon"] + shmem, shmem

    def report(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {"extra": self.extra, "shmem": self.shmem, "hwm": status()["VmHWM"] - self.base["VmRSS"]}


def model(model_mb: int, bucket_mb: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(TENSOR_MIB * MIB // 4, generator=generator)
               for i in range(model_mb // TENSOR_MIB)}
    tensors["embed.weight"] = torch.randn(bucket_mb * MIB * 5 // 8, generator=generator)  # 2.5 buckets
    return tensors


def publisher(args: argparse.Namespace) -> None:
    weights = model(args.model_mb, args.bucket_mb)
    entries = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in weights.items()}
    publishing = WeightPublisher("127.0.0.1", shared_memory=args.transport == "shared memory")
    peak = Peak()
    print(json.dumps({"endpoint": publishing.endpoint}), flush=True)
    for version in range(1, args.versions + 1):
        sys.stdin.readline()  # the subscriber holds the version before: the next step's publish
        buckets = publishing.writable_buckets(entries, torch.device("cpu"), args.bucket_mb * MIB)
        buckets.begin(version)
        for name, tensor in weights.items():
            tensor.add_(1.0)  # the step's update, in place
            buckets.write(name, tensor)
        publishing.publish(version, buckets)
    sys.stdin.readline()
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    print(json.dumps({"published": nbytes, "buckets": len(buckets.payloads), **peak.report(),
                      "largest": max(len(payload) for payload in buckets.payloads)}), flush=True)
    publishing.close(timeout_s=10)


def load(weights: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """A bucket into the model, as an engine stages it (a function: no name outlives it to keep the bucket)."""
    for name, tensor in tensors.items():
        weights[name].copy_(tensor)


def subscriber(args: argparse.Namespace) -> None:
    weights = {name: torch.empty_like(tensor) for name, tensor in model(args.model_mb, args.bucket_mb).items()}
    for tensor in weights.values():
        tensor.zero_()  # its pages taken: a loaded model
    subscribing, held = WeightSubscriber(args.endpoint), 0
    peak = Peak()  # after the socket and its threads: what a version costs, not what connecting does
    deadline = time.monotonic() + TIMEOUT_S
    while held < args.versions:
        assert time.monotonic() < deadline, f"version {held + 1} not received within {TIMEOUT_S} s"
        bucket = subscribing.poll_bucket(held)
        if bucket is None:
            time.sleep(0.001)
            continue
        load(weights, bucket.tensors)
        if bucket.index == bucket.count - 1:
            held = bucket.version
            print(json.dumps({"held": held}), flush=True)
        bucket = None  # its tensors go before the next poll, as a generator's do (over the socket: its frame)
    print(json.dumps({**peak.report(), **subscribing.counts}), flush=True)
    subscribing.close()


def measure(args: argparse.Namespace, transport: str) -> tuple[dict, dict]:
    common = [f"--model-mb={args.model_mb}", f"--bucket-mb={args.bucket_mb}", f"--versions={args.versions}",
              f"--transport={transport}"]
    learner = subprocess.Popen([sys.executable, __file__, "--role=publisher", *common], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    endpoint = json.loads(learner.stdout.readline())["endpoint"]
    generator = subprocess.Popen([sys.executable, __file__, "--role=subscriber", f"--endpoint={endpoint}", *common],
                                 stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # the subscription lands (a late one would be sent the newest version anyway)
        for _ in range(args.versions):
            learner.stdin.write("\n")
            learner.stdin.flush()
            json.loads(generator.stdout.readline())  # {"held": version}
        learner.stdin.write("\n")
        learner.stdin.flush()
        return json.loads(learner.stdout.readline()), json.loads(generator.stdout.readline())
    finally:
        for process in (learner, generator):
            process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mb", type=int, default=400)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--role", default="", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        (publisher if args.role == "publisher" else subscriber)(args)
        return
    mb = lambda nbytes: f"{nbytes / MIB:,.0f}"  # noqa: E731
    print(f"Above each process's own model ({args.model_mb} MiB + one tensor of 2.5 buckets), peak MiB: "
          f"private + shared (of which shared), and VmHWM; {args.versions} versions in buckets of {args.bucket_mb} MiB")
    print("| transport | MiB a version | buckets (largest MiB) | publisher extra (shared) | HWM | x published | "
          "subscriber extra (shared) | HWM | x largest bucket | dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for transport in ("shared memory", "socket"):
        sent, got = measure(args, transport)
        print(f"| {transport} | {mb(sent['published'])} | {sent['buckets']} ({mb(sent['largest'])}) "
              f"| {mb(sent['extra'])} ({mb(sent['shmem'])}) | {mb(sent['hwm'])} "
              f"| {sent['extra'] / sent['published']:.2f} "
              f"| {mb(got['extra'])} ({mb(got['shmem'])}) | {mb(got['hwm'])} | {got['extra'] / sent['largest']:.2f} "
              f"| {got['dropped']} |", flush=True)


if __name__ == "__main__":
    main()
