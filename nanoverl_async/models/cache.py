"""The cache of built-in models: each is a directory built once, then found.

    path = build_once("tiny", recipe.contents(), write, cache_dir, note="one-time warm start, ~70 s")

`write(directory)` fills an empty directory with a Hugging Face model (config, weights, tokenizer) and
returns a short summary for the log line. Used by every `builtin:` model (nanoverl_async/models/load.py).

Invariants:
- the directory is `<root>/<kind>-<digest>`, the digest a hash of `recipe`: everything that determines the
  contents, so a changed recipe never reuses a stale model;
- it is built in a temporary directory and renamed into place under an fcntl lock: it exists only when
  complete, and two processes (every role resolves `model.path`) never build it twice; a failed build
  leaves nothing behind.

The root is the `cache_dir` argument, else $NANOVERL_CACHE, else ~/.cache/nanoverl_async.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable


def default_cache_dir(cache_dir: str = "") -> Path:
    """The argument, else $NANOVERL_CACHE, else ~/.cache/nanoverl_async."""
    return Path(cache_dir or os.environ.get("NANOVERL_CACHE") or Path.home() / ".cache" / "nanoverl_async")


def recipe_digest(recipe: dict) -> str:
    """The short hash that names a built model's directory: of everything that determines its contents."""
    return hashlib.blake2b(json.dumps(recipe, sort_keys=True).encode(), digest_size=8).hexdigest()


def build_once(kind: str, recipe: dict, write: Callable[[Path], str], cache_dir: str = "", note: str = "",
               what: str = "") -> str:
    """The directory of built-in model `kind` for `recipe` (JSON-able), made by `write` (under a lock) if missing;
    the log lines call it `what` (default builtin:KIND)."""
    what = what or f"builtin:{kind}"
    root = default_cache_dir(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{kind}-{recipe_digest(recipe)}"
    if final.is_dir():  # complete by construction: it only ever appears through the rename below
        return str(final)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we crash
        if final.is_dir():  # another process built it while we waited
            return str(final)
        print(f"building {what}{f' ({note})' if note else ''} in {final} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-build-", dir=root))
        try:
            summary = write(tmp)
            # mkdtemp makes the directory private (and transformers writes weights 0600); the cache may be shared
            for file in [tmp, *tmp.rglob("*")]:
                file.chmod(0o755 if file.is_dir() else 0o644)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"built {what} in {time.perf_counter() - started:.0f} s ({summary})", file=sys.stderr, flush=True)
    return str(final)
