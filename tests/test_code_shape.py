"""The package's shape stays readable: no line over MAX_COLUMNS columns, no module over MAX_MODULE_LINES lines,
no function over MAX_FUNCTION_LINES lines (from its `def` to its last line, docstring included). Each failure
names its offenders as file:line. Static: reads the source only.
Run alone: `python -m pytest tests/test_code_shape.py -q`.
"""

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "nanoverl_async"
MAX_COLUMNS = 120
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def where(path: Path, line: int) -> str:
    return f"nanoverl_async/{path.relative_to(PACKAGE)}:{line}"


def long_lines() -> list[str]:
    return [f"{where(path, number)} ({len(text)} columns)" for path in modules()
            for number, text in enumerate(path.read_text().splitlines(), start=1) if len(text) > MAX_COLUMNS]


def long_modules() -> list[str]:
    return [f"{where(path, 1)} ({count} lines)" for path in modules()
            if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES]


def long_functions() -> list[str]:
    found = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = node.end_lineno - node.lineno + 1
                if count > MAX_FUNCTION_LINES:
                    found.append(f"{where(path, node.lineno)} {node.name} ({count} lines)")
    return found


def test_no_line_over_max_columns():
    found = long_lines()
    assert not found, f"lines over {MAX_COLUMNS} columns (wrap them): " + ", ".join(found)


def test_no_module_over_max_lines():
    found = long_modules()
    assert not found, f"modules over {MAX_MODULE_LINES} lines (split them): " + ", ".join(found)


def test_no_function_over_max_lines():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them): " + ", ".join(found)


def test_the_checks_name_what_they_find(tmp_path, monkeypatch):
    """Each check finds a planted offender and names it by file:line."""
    planted = tmp_path / "nanoverl_async"
    planted.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (planted / "wide.py").write_text(f"x = 1\ny = '{'a' * MAX_COLUMNS}'\n\n\ndef long():\n{body}\n")
    (planted / "tall.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    monkeypatch.setitem(globals(), "PACKAGE", planted)
    assert long_lines() == [f"nanoverl_async/wide.py:2 ({MAX_COLUMNS + 6} columns)"]
    assert long_modules() == [f"nanoverl_async/tall.py:1 ({MAX_MODULE_LINES + 1} lines)"]
    assert long_functions() == [f"nanoverl_async/wide.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]
