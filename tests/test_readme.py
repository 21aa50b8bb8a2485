"""README promises: it stays short, every path its Files tree names exists, and CI runs exactly the test
command it gives. (Its commands, config keys, other paths and links: tests/test_docs.py, as for every doc.)
Run alone: `python -m pytest tests/test_readme.py -q`.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAX_LINES = 250  # issue 34: a README a researcher reads in ten minutes; measurements live in docs/benchmarks.md
NAME = re.compile(r"[\w.-]+(?:\.\w+|/)")  # a file or folder name in the tree


def files_block() -> list[str]:
    """The tree under "## Files": two spaces of indent per level, folders end with '/'. A line is one name and
    a phrase, or only names (the files of the folder above, listed side by side)."""
    block = README.split("## Files", 1)[1].split("```")[1]
    paths, folders = [], []  # folders: the open folder at each depth
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        words = line.split()
        names = words if all(NAME.fullmatch(word) for word in words) else words[:1]
        folders = folders[:depth]
        paths += ["".join(folders) + name for name in names]
        if len(names) == 1 and names[0].endswith("/"):
            folders.append(names[0])
    return paths


def test_the_readme_stays_short():
    assert len(README.splitlines()) <= MAX_LINES


def test_every_path_in_the_files_tree_exists():
    paths = files_block()
    assert len(paths) > 60 and "nanoverl_async/generators/kv_blocks.py" in paths  # names-only lines are read
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README names paths that do not exist: {missing}"


def test_the_files_tree_lists_every_module():
    listed = set(files_block())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "nanoverl_async").rglob("*.py") if p.name != "__init__.py"}
    assert not modules - listed, f"modules README's Files tree leaves out: {sorted(modules - listed)}"


def test_ci_runs_the_readme_test_command():
    bash_blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    test_command = bash_blocks[1].strip()
    assert "pytest" in test_command
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines
    assert "nanoverl-async launch configs/agent_grpo.yaml" in bash_blocks[0]
