"""The docs cannot drift from the code: every command in the README and in docs/ is parsed against what it names.

A `primaplug ...` line goes through primaplug's own argument parser (a flag that does not exist, or a value it
refuses, fails here); `make X` needs the target in the Makefile; a benchmark or script needs its file, and each
`--flag` it is given must be one its source defines; a Python block must compile. Other tools' commands (pip,
docker, git, ...) are theirs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELLS = ("sh", "bash", "shell", "console")
COMMANDS = ("primaplug ", ".venv/bin/primaplug ", "make ", "sudo ", ".venv/bin/python ", "python ")


def blocks(path: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def commands(text: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments and prompts dropped."""
    out, line = [], ""
    for raw in text.splitlines():
        line += raw.rstrip()
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        if line.strip():
            out.append(line.strip().removeprefix("$ "))
        line = ""
    return out


def words(command: str) -> list[str]:
    argv = shlex.split(command, comments=True)
    while argv and (argv[0] in ("sudo", "env", "nice") or re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0])):
        argv = argv[1:]
    return argv


def check_primaplug(argv: list[str]) -> None:
    from primaplug.cli import build_parser

    # "..." stands for what the reader fills in: a value after an option (a node's address, say), else nothing
    argv = [("127.0.0.1:7000" if i and argv[i - 1].startswith("-") else None) if a == "..." else a
            for i, a in enumerate(argv)]
    argv = [a for a in argv if a is not None]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"primaplug {' '.join(argv)}: the parser refuses it") from e


# scripts that take their flags from another file
FLAGS_FROM = {"scripts/build_engine.py": "primaplug/engine/build.py"}


def check_script(path: Path, flags: list[str]) -> None:
    assert path.exists(), f"{path.relative_to(ROOT)} does not exist"
    source = path.read_text() if path.is_file() else "".join(p.read_text() for p in path.glob("*.py"))
    if str(path.relative_to(ROOT)) in FLAGS_FROM:
        source += (ROOT / FLAGS_FROM[str(path.relative_to(ROOT))]).read_text()
    for flag in flags:
        name = flag.split("=", 1)[0]
        defined = re.search(rf"[\"'\s|(]{re.escape(name)}[\"'\s)|=]", source)
        assert defined, f"{path.relative_to(ROOT)} defines no {name}"


def check_command(argv: list[str], targets: set[str]) -> bool:
    """Checks one command; False where it is another tool's."""
    if not argv:
        return False
    tool = argv[0].removeprefix(".venv/bin/")
    if tool == "primaplug":
        check_primaplug(argv[1:])
    elif tool == "make":
        for target in (a for a in argv[1:] if "=" not in a and not a.startswith("-")):
            assert target in targets, f"make {target}: no such target in the Makefile"
    elif tool in ("python", "python3", "sh") and len(argv) > 1:
        flags = [a for a in argv[2:] if a.startswith("--")]
        if argv[1] == "-m" and argv[2].startswith(("benchmarks", "primaplug")):
            module = ROOT / argv[2].replace(".", "/")
            check_script(module if module.is_dir() else module.with_suffix(".py"),
                         [a for a in argv[3:] if a.startswith("--")])
        elif argv[1].startswith(("benchmarks/", "scripts/", "examples/")):
            check_script(ROOT / argv[1], flags)
        else:
            return False
    else:
        return False
    return True


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_in_the_docs_is_one_the_code_takes(path: Path) -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    checked, failures = 0, []
    for lang, text in blocks(path):
        if lang == "python":
            compile(text, f"{path.name} block", "exec")
            checked += 1
            continue
        if lang not in SHELLS and lang:
            continue
        for command in commands(text):
            if not lang and not command.startswith(COMMANDS):  # an unlabelled block: a diagram, or output
                continue
            try:
                checked += check_command(words(command), targets)
            except (AssertionError, ValueError) as e:
                failures.append(f"{command}\n    {e}")
    assert not failures, f"{path.relative_to(ROOT)}:\n" + "\n".join(failures)
    if path.name == "README.md":
        assert checked >= 7  # the two commands, the four, the Python block


def test_the_readme_fits_about_a_screen_and_links_what_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    for target in re.findall(r"\]\(([^)#]+)", readme):
        if "://" not in target:
            assert (ROOT / target.replace("%5B", "[").replace("%5D", "]")).exists(), target
