"""The user docs (README.md, docs/*.md) against the code: the job-key reference is the one the
settings' comments generate, every link lands, every command shown parses with the CLI, and no
lab-notebook lines (issue numbers, CI timings) creep back in."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import typer

import cli
from slora_batch.jobs import reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "samples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
HISTORY = {  # pattern -> what it is; none belongs in a user guide
    r"\bissue #?\d+": "an issue number",
    r"\bstop #?\d+\b": "a project stop",
    r"\b\d+ min \d+ s\b": "a CI timing",
    r"\b\d+:\d\d \+ \d+:\d\d\b": "a CI timing",
    r"\bpassed in\b": "a CI timing",
}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
UsageError = typer.exceptions.TyperException  # typer's click: a usage error, unknown option, ...
SHELL_OPS = {"&&", "||", ";", "|", "&"}
REDIRECT = re.compile(r"^\d*(>>?|<)")


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def test_job_keys_reference_is_generated_from_the_settings():
    missing = reference.undescribed()
    assert not missing, (
        "every job key needs a comment beside its dataclass field (or a COLUMN_MEANINGS entry "
        f"in slora_batch/jobs/reference.py); none for: {', '.join(missing)}"
    )
    reference.column_meanings()
    written = reference.DOC_PATH.read_text() if reference.DOC_PATH.exists() else ""
    assert written == reference.render(), (
        f"docs/job-keys.md is not what the settings' comments give; regenerate it: "
        f"{reference.COMMAND}"
    )


def test_field_comments_follow_the_field(tmp_path, monkeypatch):
    """A trailing comment continues on the lines below while the next field has its own; lines
    above a field without a trailing comment are that field's."""
    source = '''
from dataclasses import dataclass

@dataclass
class Settings:
    """Doc."""

    a: int = 1  # first line of a
    # and its second line
    b: str = "x"  # b's own
    # c's comment, above it
    # over two lines
    c: int | None = None

    d: bool = True  # d, the last field
    # still d

    def method(self) -> None:
        pass  # not a field
'''
    path = tmp_path / "reference_probe.py"  # inspect.getsource reads the class from its file
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("reference_probe", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "reference_probe", module)
    spec.loader.exec_module(module)
    assert reference.field_comments(module.Settings) == {
        "a": "first line of a and its second line",
        "b": "b's own",
        "c": "c's comment, above it over two lines",
        "d": "d, the last field still d",
    }


def test_readme_is_a_short_guide():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move detail into docs/"
    )


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_no_history_in_the_guide(path):
    found = [
        f"{page_id(path)}:{number}: {what}: {line.strip()!r}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for pattern, what in HISTORY.items()
        if re.search(pattern, line, re.I)
    ]
    assert not found, "history belongs in git, not in the guide:\n" + "\n".join(found)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    text = FENCE.sub("", path.read_text())
    result = set()
    for heading in re.findall(r"^#+\s+(.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        result.add(slug)
    return result


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_relative_links_land(path):
    text = FENCE.sub("", path.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target} (no file {linked.relative_to(ROOT)})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.relative_to(ROOT)})")
    assert not broken, f"{page_id(path)} links to what is not there: {', '.join(broken)}"


def commands(path: Path) -> list[list[str]]:
    """Every simple command of the page's bash blocks, as words (continuation lines joined,
    comments dropped, split at &&, ;, | and redirections)."""
    result = []
    for body in blocks(path, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            current: list[str] = []
            for word in [*words, ";"]:
                if word in SHELL_OPS:
                    if current:
                        result.append(current)
                    current = []
                elif REDIRECT.match(word):
                    current.append(">")  # the rest of the command is a redirection
                else:
                    current.append(word)
    return [c[: c.index(">")] if ">" in c else c for c in result]


def parse_cli(args: list[str]) -> None:
    """Parse ``slora-batch ARGS`` as the CLI would, running nothing."""
    group = typer.main.get_command(cli.app)
    parent = group.make_context("slora-batch", list(args), resilient_parsing=False)
    name = args[0]
    command = group.get_command(parent, name)
    assert command is not None, f"no command {name!r}"
    if name == "bench":  # its options belong to the benchmark's own app, loaded when it runs
        from slora_batch.bench.cli import app as bench_app

        command = typer.main.get_command(bench_app)
    try:
        command.make_context(name, list(args[1:]), parent=parent, resilient_parsing=False)
    except typer.Exit as exc:  # --help
        assert exc.exit_code == 0


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_commands_run_as_written(path, capsys):
    """Each ``slora-batch ...`` line parses with the CLI; each script a Python line runs, and
    each job file a command names, exists."""
    problems = []
    for words in commands(path):
        shown = " ".join(words)
        for index, word in enumerate(words):
            if Path(word).name == "slora-batch":
                try:
                    parse_cli(words[index + 1 :])
                except (UsageError, AssertionError) as exc:
                    problems.append(f"{shown!r}: {getattr(exc, 'format_message', exc.__str__)()}")
            elif Path(word).name in ("python", "python3") and index + 1 < len(words):
                problems += python_target(words[index + 1 :], shown)
        for word in words:
            local = (
                word.endswith((".yaml", ".py", ".sh", ".jsonl", ".parquet"))
                and "/" in word
                and not word.startswith("/")
            )
            if local and not (ROOT / word).exists():
                problems.append(f"{shown!r}: no file {word}")
    capsys.readouterr()  # --help output
    assert not problems, f"{page_id(path)}:\n" + "\n".join(problems)


def python_target(args: list[str], shown: str) -> list[str]:
    """A ``python`` line's script must exist; a ``-m`` module must be importable or a file."""
    if args[0] == "-m":
        module = args[1]
        if importlib.util.find_spec(module.split(".")[0]) is None and not any(
            (ROOT / (module.replace(".", "/") + suffix)).exists()
            for suffix in (".py", "/__main__.py")
        ):
            return [f"{shown!r}: no module {module}"]
        return []
    if args[0].endswith(".py") and not (ROOT / args[0]).exists():
        return [f"{shown!r}: no script {args[0]}"]
    return []


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_python_examples_compile(path):
    for body in blocks(path, "python"):
        compile(body, f"{page_id(path)} python block", "exec")


def test_cli_check_catches_a_wrong_command():
    """The command check can fail: an unknown option and an unknown command do not parse."""
    with pytest.raises(UsageError):
        parse_cli(["run", "JOBS.yaml", "--replica", "2"])
    with pytest.raises(AssertionError):
        parse_cli(["start", "JOBS.yaml"])
    parse_cli(["run", "JOBS.yaml", "--ray", "auto", "--replicas", "8"])
    with pytest.raises(UsageError):
        parse_cli(["bench", "--sytems", "slora"])
