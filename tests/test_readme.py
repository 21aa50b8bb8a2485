"""README promises: every path it names exists, and CI runs exactly the test command it gives."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def files_block() -> list[str]:
    """The tree under "## Files": two spaces of indent per level, folders end with '/'."""
    block = README.split("## Files", 1)[1].split("```")[1]
    paths, folders = [], []  # folders: the open folder at each depth
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0]
        folders = folders[:depth]
        path = "".join(folders) + name
        paths.append(path)
        if name.endswith("/"):
            folders.append(name)
    return paths


def test_every_path_in_the_files_tree_exists():
    paths = files_block()
    assert len(paths) > 20
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README names paths that do not exist: {missing}"


def test_every_backticked_repo_path_exists():
    candidates = set(re.findall(r"`((?:nanoverl_async|configs|bench|tests|examples)/[\w./-]+)`", README))
    assert candidates
    missing = [p for p in candidates if not (ROOT / p).exists()]
    assert not missing, missing


def test_ci_runs_the_readme_test_command():
    bash_blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    test_command = bash_blocks[1].strip()
    assert "pytest" in test_command
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines
    assert "nanoverl-async launch configs/agent_grpo.yaml" in bash_blocks[0]
