"""Documents the code points to exist: every repository path a docstring or comment in nanoverl_async/
names, every document it cites, and every `docs/<name>.md "Heading"` section it cites (static: reads the
source only). And docs/metrics.md lists every metrics.jsonl key: each key conftest.py's real run writes
has a row, each row is a key the code can write, and a row the run does not write is marked conditional.
Run alone: `python -m pytest tests/test_docs.py -q`.
"""

import ast
import io
import json
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanoverl_async"
# a path from the repository root, or (generators/x.py, ...) from the package's own folders
ROOTED = re.compile(r"(?<![\w./-])((?:docs|tests|nanoverl_async|bench|configs|examples)/[\w./-]*\w)")
IN_PACKAGE = re.compile(r"(?<![\w./-])((?:algorithms|buffer|generators|learners)/\w+\.py)\b")
DOCUMENT = re.compile(r"(?<![\w./-])([\w./-]+\.md)\b")
SECTION = re.compile(r"(docs/[\w-]+\.md),?\s+\"([^\"]+)\"")


def prose(path: Path) -> str:
    """The docstrings and comments of one module, joined."""
    source = path.read_text()
    parts = [node.body[0].value.value for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
             and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
             and isinstance(node.body[0].value.value, str)]
    parts += [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    return "\n".join(parts)


def cited() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): prose(path) for path in sorted(PACKAGE.rglob("*.py"))}


def headings(document: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return set(re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.M))


def test_every_named_path_exists():
    missing = [(module, p) for module, text in cited().items() for p in ROOTED.findall(text)
               if not (ROOT / p).exists()]
    missing += [(module, p) for module, text in cited().items() for p in IN_PACKAGE.findall(text)
                if not (PACKAGE / p).exists()]
    assert not missing, f"docstrings or comments name paths that do not exist: {missing}"


def test_every_cited_document_is_in_the_repository():
    missing = [(module, d) for module, text in cited().items() for d in DOCUMENT.findall(text)
               if not (ROOT / d).exists()]
    assert not missing, f"docstrings or comments cite documents that are not in the repository: {missing}"


def test_every_cited_section_exists():
    citations = [(module, doc, heading) for module, text in cited().items() for doc, heading in SECTION.findall(text)]
    assert len(citations) > 10  # the pattern still finds the citations
    missing = [c for c in citations if not (ROOT / c[1]).exists() or c[2] not in headings(ROOT / c[1])]
    assert not missing, f"citations of sections that do not exist: {missing}"


def test_paths_the_docs_name_exist():
    for document in sorted((ROOT / "docs").glob("*.md")):
        named = set(re.findall(r"`((?:docs|tests|nanoverl_async|bench|configs|examples)/[\w./-]*\w)`",
                               document.read_text()))
        missing = [p for p in named if not (ROOT / p).exists()]
        assert not missing, f"{document.name} names paths that do not exist: {missing}"


# docs/metrics.md: one row per metrics.jsonl key, `| `key` | unit | what | when |`; `when` is `always` for a key
# every row of every run has, else the setting or steps that write it. `<name>` in a key is a pattern.
METRICS_DOC = ROOT / "docs" / "metrics.md"
ALWAYS = "always"
# keys metrics.step_metrics builds from a name in these parts of the package rather than spelling them out
BUILT_FROM_NAMES = {"learner/": ("learners", "algorithms"), "buffer/": ("buffer",)}


def documented_metrics() -> dict[str, str]:
    """docs/metrics.md's keys -> their `when` cell."""
    rows = {}
    for line in METRICS_DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == 4 and all(cells), f"docs/metrics.md: a row needs key | unit | what | when: {line}"
        key = cells[0].strip("`")
        assert key not in rows, f"docs/metrics.md documents {key} twice"
        rows[key] = cells[3]
    return rows


def documents(key: str, documented: dict[str, str]) -> bool:
    """A key is documented by its own row or by a `<name>` pattern row."""
    return key in documented or any("<" in pattern and re.fullmatch(re.sub(r"<\w+>", r"[\\w.-]+", pattern), key)
                                    for pattern in documented)


def string_literals() -> set[str]:
    """Every string literal in the package."""
    return {node.value for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def dict_keys_in_code(*folders: str) -> set[str]:
    """The names these folders of the package put in dicts: literal keys (`{"name": ...}`), stores
    (`d["name"] = ...`) and keywords of `.update(name=...)`."""
    names = set()
    for path in (p for folder in folders for p in (PACKAGE / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                names.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                names.add(node.slice.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
                names.update(k.arg for k in node.keywords if k.arg)
    return names


def test_the_metrics_doc_parses_with_when_cells():
    documented = documented_metrics()
    assert len(documented) > 60  # the row pattern still finds the tables
    assert documented["reward/mean"] == ALWAYS and documented["memory/learner_peak_device_gb"] != ALWAYS
    assert documents("reward/accuracy", documented) and not documents("reward/acc/x", documented)
    assert not documents("reward", documented)


def test_every_documented_metric_is_one_the_code_can_write():
    literals, built = string_literals(), {p: dict_keys_in_code(*folders) for p, folders in BUILT_FROM_NAMES.items()}
    unknown = [key for key in documented_metrics() if "<" not in key and key not in literals
               and not any(key.startswith(p) and key[len(p):] in names for p, names in built.items())]
    assert not unknown, f"docs/metrics.md documents keys no code in nanoverl_async/ writes: {unknown}"


@pytest.mark.slow
def test_a_real_run_writes_exactly_the_documented_metrics(observed_run):
    """conftest.py's run (the default job, every observation key on): each key it writes has a row, and
    each row not marked conditional is a key it writes."""
    rows = [json.loads(line) for line in (observed_run / "metrics.jsonl").read_text().splitlines()]
    written = set().union(*rows)
    documented = documented_metrics()
    undocumented = sorted(k for k in written if not documents(k, documented))
    assert not undocumented, f"metrics.jsonl keys with no row in docs/metrics.md: {undocumented}"
    missing = sorted(k for k, when in documented.items() if when == ALWAYS and any(k not in row for row in rows))
    assert not missing, f"docs/metrics.md marks these `always`, but some of the run's rows lack them: {missing}"
