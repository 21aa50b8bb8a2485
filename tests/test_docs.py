"""Documents the code points to exist: every repository path a docstring or comment in nanoverl_async/
names, every document it cites, and every `docs/<name>.md "Heading"` section it cites. Static: reads
the source only. Run alone: `python -m pytest tests/test_docs.py -q`.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

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
