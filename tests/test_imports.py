"""The package's import graph: every import runs down ORDER, so no cycles (lazy imports inside functions count
too), and the value checker stays pure (it reaches nothing that opens a socket or runs user code); static, from
the source. And what one process really imports: the buffer's and the controller's stay light."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanoverl_async"
SOCKETS_OR_USER_CODE = {"zmq", "ray", "httpx", "nanoverl_async.agents.user_code", "nanoverl_async.agents.env",
                        "nanoverl_async.agents.rewards", "nanoverl_async.buffer.service", "nanoverl_async.checkpoint"}

# The package's units, bottom to top: each folder under nanoverl_async/ and each root module. A module imports
# only from its own unit or a lower one (docs/design.md "The import order" says why each sits where it does).
ORDER = ["validation", "config_file", "config", "algorithms", "wire", "checkpoint", "reaper", "agents", "observe",
         "buffer", "simulator", "models", "generators", "learners", "controller", "launcher", "cli"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> every module or top-level library it imports, anywhere in its source."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):  # `if TYPE_CHECKING:` imports count too
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[module_name(path)] = names
    modules = set(graph)
    return {me: {n if n in modules else n.split(".")[0] for n in names if n != me and not me.startswith(n + ".")}
            for me, names in graph.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for name in graph.get(todo.pop(), ()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_no_import_cycles():
    graph = import_graph()
    cycles = sorted(m for m in graph if m in reachable(graph, m) and m != "nanoverl_async")
    assert not cycles, f"modules on an import cycle: {cycles}"


def unit(module: str) -> str:
    """nanoverl_async.agents.env -> agents; nanoverl_async.cli -> cli."""
    return module.split(".")[1]


def test_every_import_runs_down_the_order():
    graph = import_graph()
    units = {unit(m) for m in graph if m != "nanoverl_async"}
    assert units == set(ORDER), f"not in ORDER: {sorted(units - set(ORDER))}; gone: {sorted(set(ORDER) - units)}"
    upward = sorted(f"{me} imports {name} ({unit(name)} is above {unit(me)})"
                    for me, names in graph.items() if me != "nanoverl_async"
                    for name in names if name.startswith("nanoverl_async.")
                    and ORDER.index(unit(name)) > ORDER.index(unit(me)))
    assert not upward, "imports that run up the order (tests/test_imports.py ORDER):\n  " + "\n  ".join(upward)
    assert "nanoverl_async.controller.roles" in graph["nanoverl_async.launcher"]  # the graph is real


def test_the_design_note_gives_the_same_order():
    section = (PACKAGE.parent / "docs" / "design.md").read_text().split("\n## The import order\n")[1].split("\n## ")[0]
    listed = [line.split("`")[1].removesuffix(".py").removesuffix("/") for line in section.splitlines()
              if line.startswith("- `")]
    assert listed == ORDER


def test_the_value_checker_opens_no_socket_and_runs_no_user_code():
    graph = import_graph()
    reached = reachable(graph, "nanoverl_async.validation")
    assert not reached & SOCKETS_OR_USER_CODE, sorted(reached & SOCKETS_OR_USER_CODE)
    assert "nanoverl_async.validation" in reachable(graph, "nanoverl_async.config")  # the graph is real


@pytest.mark.parametrize("process, modules, heavy", [
    ("the buffer's", "nanoverl_async.config, nanoverl_async.controller.role_actors", ("torch", "transformers")),
    ("the controller's", "nanoverl_async.launcher", ("torch.distributed.fsdp", "transformers.modeling_utils")),
])
def test_processes_import_only_what_their_role_needs(process, modules, heavy):
    """Ray imports an actor's class module in the actor's process (the buffer's: role_actors.py, unpickling
    a Config), and the controller imports the launcher: neither may pull in what only the generators and
    learner ranks need, seconds of CPU at start-up beside the roles that do."""
    probe = f"import sys\nimport {modules}\nprint(','.join(sorted({set(heavy)!r} & set(sys.modules))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{process} process would import {out.stdout.strip()}"


def test_a_config_is_checked_without_torch_and_knows_every_registered_algorithm():
    """The CLI checks a config before it starts Ray: the algorithm keys' choices come from the algorithm
    modules' source (validation.algorithm_names), so no torch is imported (~3 s of CPU), and they are
    exactly the names those modules register when imported."""
    probe = ("import sys\nfrom nanoverl_async.config import load_config\n"
             "from nanoverl_async.controller.preflight import prepare\n"
             "prepare(load_config('configs/agent_grpo.yaml', []))\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False"
    from nanoverl_async import algorithms
    from nanoverl_async.validation import algorithm_names

    tables = ("ADVANTAGES", "POLICY_LOSSES", "CORRECTIONS", "IS_LEVELS", "AGGREGATIONS", "KL_ESTIMATORS")
    assert {t: algorithm_names()[t] for t in tables} == {t: tuple(getattr(algorithms, t)) for t in tables}


def test_local_ray_workers_import_this_checkout(monkeypatch):
    """start_ray puts the folder holding nanoverl_async/ first on the workers' PYTHONPATH (the package, not one of
    its subfolders: controller/startup.py sits two levels down)."""
    import ray

    from nanoverl_async.config import RayConfig
    from nanoverl_async.controller import startup

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert startup.start_ray(RayConfig()) is True
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(PACKAGE.parent), "/elsewhere"]


def test_a_user_error_names_the_users_frames_not_the_packages():
    """user_frames skips every frame of the package, whichever subpackage it is in (here wire/)."""
    from nanoverl_async.agents.user_code import user_frames
    from nanoverl_async.wire.trajectory import decode

    def users_step():
        decode(b"not a trajectory")

    with pytest.raises(Exception) as error:
        users_step()
    frames = user_frames(error.value)
    assert "in users_step" in frames and "trajectory.py" not in frames, frames
