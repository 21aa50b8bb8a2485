"""Where the host waits for the GPU: each synchronising CUDA call that torch flags (sync debug mode), counted by
the innermost Python frame that made it. Used by the GPU benches' --profile.

    counts = host_wait_sites(lambda: update(batch))     # Counter of "file:line" -> waits, during one call
    print_wait_sites(console, "the learner", counts)     # a table of the most frequent sites

torch flags most synchronising calls (item, tolist, nonzero, copies from pageable memory), not all; a wait made
during backward counts at the line that called backward (autograd replays its warnings in the calling thread).
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table


def host_wait_sites(run: Callable[[], object]) -> Counter:
    """Run `run()` once with CUDA's sync debug mode on; the synchronising calls it made, by file:line."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    root = os.path.dirname(os.path.dirname(torch.__file__))
    return Counter(f"{os.path.relpath(w.filename, root) if w.filename.startswith(root) else w.filename}:{w.lineno}"
                   for w in caught if "synchronizing" in str(w.message))


def print_wait_sites(console: Console, title: str, counts: Counter, per: tuple[str, int] = ("", 0)) -> None:
    """The 15 most frequent sites of `counts`, and all; `per` = (unit, n) adds a column of waits per unit."""
    unit, n = per
    table = Table(title=f"{title}: where the host waited for the GPU (sync debug mode)")
    for column in ("file:line (innermost Python frame)", "waits", *([f"per {unit}"] if n else [])):
        table.add_column(column, justify="right")
    for site, count in [*counts.most_common(15), ("all", sum(counts.values()))]:
        table.add_row(site, str(count), *([f"{count / n:.2f}"] if n else []))
    console.print(table)
