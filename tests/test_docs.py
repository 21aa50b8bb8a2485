"""Documents the code points to exist: every repository path a docstring or comment in nanoverl_async/
names, every document it cites, and every `docs/<name>.md "Heading"` or `README "Heading"` section that
the code, configs, benches, tests and docs cite (static: reads the source only). The docs a reader follows
(README.md, docs/*.md) say only true things about the repository: their commands name existing scripts,
subcommands, flags and gpu.sh steps, their launch commands load as configs, their config keys are keys of
the config tree, their paths exist and their links land on a heading (`doc_errors`). And docs/metrics.md
lists every metrics.jsonl key: each key conftest.py's real run writes has a row, each row is a key the
code can write, and a row the run does not write is marked conditional.
Run alone: `python -m pytest tests/test_docs.py -q`.
"""

import ast
import contextlib
import dataclasses
import functools
import io
import json
import re
import shlex
import tokenize
from fnmatch import fnmatch
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from nanoverl_async import cli
from nanoverl_async.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanoverl_async"
# a path from the repository root, or (generators/x.py, ...) from the package's own folders
ROOTED = re.compile(r"(?<![\w./-])((?:docs|tests|nanoverl_async|bench|configs|examples)/[\w./-]*\w)")
PACKAGE_FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
IN_PACKAGE = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGE_FOLDERS)})/\w+\.py)\b")
DOCUMENT = re.compile(r"(?<![\w./-])([\w./-]+\.md)\b")
SECTION = re.compile(r"(docs/[\w-]+\.md|README),?\s+\"([^\"]+)\"")


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


def cited_document(name: str) -> Path:
    """A cited document: README (as code and configs cite it) or a path from the repository root."""
    return ROOT / ("README.md" if name == "README" else name)


def section_errors(text: str) -> list[str]:
    """Each `docs/x.md "Heading"` or `README "Heading"` in `text` whose section does not exist (a heading cited
    across a line break counts as one line)."""
    return [f'{doc} "{heading}": no such section' for doc, heading in SECTION.findall(text)
            if not cited_document(doc).is_file() or " ".join(heading.split()) not in headings(cited_document(doc))]


def test_every_cited_section_exists():
    """Citations in the package's prose and in configs, benches, examples and tests (the docs' own: below).
    This file is left out: its checks spell out citations that must fail."""
    texts = cited()
    others = [path for pattern in ("configs/**/*.yaml", "bench/*", "examples/*", "tests/*.py")
              for path in ROOT.glob(pattern)]
    texts.update({str(p.relative_to(ROOT)): p.read_text() for p in others
                  if p.is_file() and p.resolve() != Path(__file__).resolve()})
    assert sum(len(SECTION.findall(text)) for text in texts.values()) > 20  # the pattern still finds them
    missing = [(source, error) for source, text in texts.items() for error in section_errors(text)]
    assert not missing, f"citations of sections that do not exist: {missing}"


# The docs a reader follows. `doc_errors` checks one document's text against the repository.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a dotted key of the config tree (`*` a wildcard: `generator.sglang.*`), not a call (`buffer.next_batch(t)`)
SECTIONS = "|".join(field.name for field in dataclasses.fields(Config))
CONFIG_KEY = re.compile(rf"(?<![\w./$-])((?:{SECTIONS})\.[\w*]+(?:\.[\w*]+)*)(?![\w(])")
A_FILE = re.compile(r"\.(py|md|json|jsonl|yaml|msgpack|safetensors|png|sh|tgz)$")  # `buffer.msgpack` is no key
SUBCOMMAND = re.compile(r"nanoverl-async\s+([\w|-]+)([^\n|;&]*)")
SCRIPT = re.compile(r"(?<![\w./-])((?:bench|examples|tests)/[\w/-]+\.(?:py|sh))([^\n|;&]*)")
GPU_STEPS = re.compile(r"\bSTEPS=(?:\"([^\"]*)\"|(\S+))")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def code_of(text: str) -> list[str]:
    """A document's code: each line of its fenced blocks (continuations joined, comments cut), each inline span."""
    fenced = "\n".join(re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)).replace("\\\n", " ")
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return [re.sub(r"(^|\s)#.*", "", line) for line in fenced.splitlines()] + inline


@functools.cache
def config_tree() -> DictConfig:
    """The tree load_config starts from (slow to build: once)."""
    return OmegaConf.structured(Config)


def config_key_error(key: str) -> str | None:
    """None if `key` names a section or field of the config tree, else why not."""
    node = config_tree()
    for depth, part in enumerate(key.split(".")):
        names = [name for name in node.keys() if fnmatch(name, part)] if isinstance(node, DictConfig) else []
        if not names:
            return f"`{key}`: no config key {'.'.join(key.split('.')[:depth + 1])}"
        node = node[names[0]]
    return None


@functools.cache
def subcommand_help(name: str) -> str | None:
    """`nanoverl-async NAME --help`'s text from the real parser, or None if there is no such subcommand."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.main([name, "--help"])
        except SystemExit as stop:
            return out.getvalue() if stop.code == 0 else None
    return None


def command_errors(line: str) -> list[str]:
    """What one line of code gets wrong: a subcommand, script, flag or gpu.sh step that does not exist, or a
    launch/validate command whose config does not load."""
    errors = []
    for names, args in SUBCOMMAND.findall(line):
        for name in names.split("|"):
            usage = subcommand_help(name)
            if usage is None:
                errors.append(f"`nanoverl-async {name}`: no such subcommand")
                continue
            options = set(re.findall(r"--[\w-]+", usage))
            errors += [f"`nanoverl-async {name} {flag}`: no such option" for flag in re.findall(r"--[\w-]+", args)
                       if flag not in options]
            words = shlex.split(args)
            if name in ("launch", "validate") and words and words[0].endswith(".yaml"):
                try:
                    load_config(str(ROOT / words[0]), [w for w in words[1:] if "=" in w and not w.startswith("-")])
                except ConfigError as error:
                    errors.append(f"`nanoverl-async {name}{args}`: {error}")
    for script, args in SCRIPT.findall(line):
        if not (ROOT / script).is_file():
            errors.append(f"`{script}`: no such script")
            continue
        source = (ROOT / script).read_text()
        errors += [f"`{script} {flag}`: no such option" for flag in re.findall(r"(?<![\w-])--[\w-]+", args)
                   if f'"{flag}"' not in source]
    steps = set(re.findall(r"\bwant (\w+)", (ROOT / "bench/gpu.sh").read_text()))
    errors += [f"`STEPS={word}`: no such step of bench/gpu.sh" for quoted, bare in GPU_STEPS.findall(line)
               for word in (quoted or bare).split() if word not in steps]
    return errors


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def link_errors(text: str, document: Path) -> list[str]:
    errors = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        if not path.exists():
            errors.append(f"link ({target}): no such file")
        elif anchor and anchor not in {slug(h) for h in headings(path)}:
            errors.append(f"link ({target}): no such heading in {path.name}")
    return errors


def doc_errors(text: str, document: Path) -> list[str]:
    """Everything in one document's text (`document`: where it lives, for its relative links) that is not true
    of the repository: commands, config keys, paths, links and cited sections."""
    errors = [error for line in code_of(text) for error in command_errors(line)]
    errors += [error for key in sorted(set(CONFIG_KEY.findall(text))) if not A_FILE.search(key)
               for error in [config_key_error(key)] if error]
    errors += [f"`{p}`: no such path" for p in sorted(set(ROOTED.findall(text))) if not (ROOT / p).exists()]
    errors += [f"`{p}`: no such file in nanoverl_async/" for p in sorted(set(IN_PACKAGE.findall(text)))
               if not (PACKAGE / p).exists()]
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))  # code may show a citation's form
    return errors + link_errors(text, document) + section_errors(prose)


def test_the_checker_reads_the_docs():
    """The patterns still find what the docs hold (else the test below would pass on nothing)."""
    texts = [document.read_text() for document in DOCS]
    code = [line for text in texts for line in code_of(text)]
    assert sum(len(CONFIG_KEY.findall(text)) for text in texts) > 100
    assert sum(len(SUBCOMMAND.findall(line)) for line in code) > 10
    assert sum(len(SCRIPT.findall(line)) for line in code) > 10
    assert sum(len(GPU_STEPS.findall(line)) for line in code) > 4
    assert sum(len(LINK.findall(text)) for text in texts) > 5


@pytest.mark.parametrize("document", DOCS, ids=lambda path: path.name)
def test_the_docs_say_only_true_things(document):
    errors = doc_errors(document.read_text(), document)
    assert not errors, f"{document.relative_to(ROOT)}: {errors}"


def test_the_doc_checker_finds_each_kind_of_error():
    """Each valid form passes, and the same form off by a character fails, naming what is wrong."""
    good = """`staleness.max`, `generator.sglang.*`, `data.*_files`, `algorithm.clip.ratio_c`, `buffer.msgpack`,
`buffer.next_batch(step)`, `nanoverl-async simulate RUN_DIR --staleness 0,2`, `nanoverl-async launch|validate`
```bash
nanoverl-async launch configs/agent_grpo.yaml staleness.max=0 \\
    run.total_steps=1      # a comment: nanoverl-async nonsense
STEPS="tests kv" bash bench/gpu.sh
.venv/bin/python bench/vs_trl.py --trl-python /tmp/trl/bin/python --vary-seed
```
[the loop](#how-it-works-one-step), [memory](docs/design.md#learner-memory), `nanoverl_async/generators/kv_blocks.py`,
generators/kv_blocks.py, docs/design.md "Learner memory", README "Files"."""
    assert doc_errors(good, ROOT / "README.md") == []
    bad = {"`staleness.maxx`": "staleness.maxx", "`generator.sglangx.*`": "generator.sglangx",
           "`staleness.max.deeper`": "staleness.max.deeper", "`data.*_filez`": "data.*_filez",
           "`nanoverl-async lunch x`": "lunch", "`nanoverl-async simulate RUN_DIR --stalenes 0`": "--stalenes",
           "```\nnanoverl-async launch configs/agent_grpo.yaml staleness.max=-1\n```": "staleness.max",
           "```\nnanoverl-async launch configs/agent_grpo.yaml staleness.maxx=1\n```": "staleness.maxx",
           "```\nnanoverl-async launch configs/nope.yaml\n```": "configs/nope.yaml",
           "`python bench/nope.py`": "bench/nope.py", "`python bench/vs_trl.py --vary-seeds`": "--vary-seeds",
           "```\nSTEPS=\"tests kvv\" bash bench/gpu.sh\n```": "kvv",
           "`nanoverl_async/generators/nope.py`": "generators/nope.py", "generators/nope.py": "generators/nope.py",
           "[x](docs/nope.md)": "docs/nope.md", "[x](docs/design.md#learner-memoryy)": "learner-memoryy",
           "[x](#nowhere)": "nowhere", 'docs/design.md "Learner memoryy"': "Learner memoryy",
           'README "Filez"': "Filez"}
    for text, named in bad.items():
        errors = doc_errors(text, ROOT / "README.md")
        assert errors and all(named in error for error in errors), (text, errors)


# docs/metrics.md: one row per metrics.jsonl key, `| `key` | unit | what | when |`; `when` is `always` for a key
# every row of every run has, else the setting or steps that write it. `<name>` in a key is a pattern.
METRICS_DOC = ROOT / "docs" / "metrics.md"
ALWAYS = "always"
# keys metrics.step_metrics builds from a name in these parts of the package rather than spelling them out
# (controller/: the learner pool adds explained_variance)
BUILT_FROM_NAMES = {"learner/": ("learners", "algorithms", "controller"), "buffer/": ("buffer",)}


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
