"""Mutation testing of the trust-critical modules with mutmut: how many small bugs planted in the code the
tests catch. Not part of CI (minutes per module); run it after changing a module or its tests.

    .venv/bin/python bench/mutation.py                              # every module below
    .venv/bin/python bench/mutation.py --modules wire/trajectory.py      # one of them
    .venv/bin/python bench/mutation.py --modules buffer/gate.py --max-children 2 --timeout 900

mutmut (3.x) rewrites each function of a module into many mutants (a comparison flipped, a constant off
by one, an operator swapped, a string changed, ...) and runs, for each, the tests that call the function:
a mutant is killed when a test fails, survived when they all pass. Each module is mutated alone, against
the test files of MODULES only, in a copy of the checkout under --work (the checkout itself is never
touched), and the score is printed per module and over all:

    score = (killed + timed out) / mutants

mutmut lives in its own venv (--venv, made on first use: `pip install mutmut`), never in the project's;
a .pth file there puts this interpreter's packages (torch, pytest's plugins, the project's dependencies)
behind mutmut's own, so the tests run exactly as in the project's venv. Survivors are listed; `mutmut show
NAME` in the module's work folder prints one as a diff.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT_VERSION = "3.8.1"
COPIED = ("nanoverl_async", "tests", "pyproject.toml", "configs", "examples")  # what the tests read
# module (under nanoverl_async/) -> the test files that check it; only these run against its mutants
MODULES = {
    "wire/trajectory.py": ["tests/test_wire.py", "tests/test_buffer_service.py"],
    "buffer/gate.py": ["tests/test_gate.py", "tests/test_replay.py"],
    "buffer/replay.py": ["tests/test_replay.py", "tests/test_buffer_service.py"],
    "checkpoint.py": ["tests/test_checkpoint.py"],
    "agents/sandbox.py": ["tests/test_sandbox.py"],
    "wire/weights.py": ["tests/test_weights.py", "tests/test_wire_auth.py"],
}


def mutmut_venv(venv: Path) -> Path:
    """`venv`'s mutmut, installing it there first if needed; returns the mutmut executable."""
    mutmut = venv / "bin" / "mutmut"
    if not mutmut.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"mutmut=={MUTMUT_VERSION}"], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "zz_project_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after mutmut's own
    return mutmut


def prepare(work: Path, module: str, tests: list[str]) -> None:
    """A fresh copy of what the tests need, with mutmut's setup.cfg for `module` and `tests`."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, work / name)
    lines = ["[mutmut]", "source_paths=nanoverl_async", f"only_mutate=nanoverl_async/{module}",
             "pytest_add_cli_args_test_selection=", *(f"    {t}" for t in tests), "also_copy=",
             "    configs", "    examples"]
    (work / "setup.cfg").write_text("\n".join(lines) + "\n")


def run_module(mutmut: Path, work: Path, max_children: int, timeout_s: float) -> dict:
    """mutmut run in `work`; its counts (mutmut's export-cicd-stats) and the survivors' names."""
    try:
        subprocess.run([str(mutmut), "run", "--max-children", str(max_children)], cwd=work, timeout=timeout_s,
                       stdout=subprocess.DEVNULL, stderr=(work / "mutmut.log").open("w"))
    except subprocess.TimeoutExpired:
        print(f"  stopped after {timeout_s:.0f} s: the counts cover the mutants tried so far", flush=True)
    subprocess.run([str(mutmut), "export-cicd-stats"], cwd=work, check=True, capture_output=True)
    stats = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text())
    results = subprocess.run([str(mutmut), "results"], cwd=work, capture_output=True, text=True).stdout
    stats["survivors"] = [line.split(":")[0].strip() for line in results.splitlines() if line.endswith("survived")]
    return stats


def score(stats: dict) -> float:
    return (stats["killed"] + stats["timeout"]) / max(1, stats["total"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", default=list(MODULES), choices=list(MODULES))
    parser.add_argument("--venv", type=Path, default=Path("/tmp/mutvenv"), help="mutmut's own venv")
    parser.add_argument("--work", type=Path, default=Path("/tmp/nanoverl-mutation"), help="copies, one per module")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested at once")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per module")
    parser.add_argument("--show-survivors", type=int, default=10, help="survivors listed per module")
    args = parser.parse_args()
    mutmut = mutmut_venv(args.venv)
    totals = {"killed": 0, "timeout": 0, "total": 0}
    for module in args.modules:
        work = args.work / module.replace("/", "_").removesuffix(".py")
        print(f"{module}: mutating against {' '.join(MODULES[module])} in {work}", flush=True)
        prepare(work, module, MODULES[module])
        stats = run_module(mutmut, work, args.max_children, args.timeout)
        print(f"  {stats['total']} mutants: {stats['killed']} killed, {stats['timeout']} timed out, "
              f"{stats['survived']} survived, {stats['no_tests']} without a test: score {score(stats):.1%}",
              flush=True)
        for name in stats["survivors"][:args.show_survivors]:
            print(f"    survived: {name}")
        for key in totals:
            totals[key] += stats[key]
    print(f"mutation score over {', '.join(args.modules)}: {score(totals):.1%} "
          f"({totals['killed'] + totals['timeout']} of {totals['total']} mutants caught)")


if __name__ == "__main__":
    main()
