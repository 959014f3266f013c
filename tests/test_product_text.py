"""Product files speak of the product, not of the work that made it.

No product file names a work session (the word "session" followed by its number, or "s" and the
number as a word, or in a results file's name) or an issue by its number: what changed and when is
what git keeps, and a figure says where it comes from by its command and the machine its JSON records. The
product files are the package, the kernels, the benchmark scripts, the documents and the names of
the benchmarks' results. A Ray, HTTP or test session is no work session: only a number after the
word counts. And the documents cite only files the repository holds.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
TEXT_SUFFIXES = {".py", ".pyi", ".c", ".h", ".md"}

WORK_SESSION = re.compile(r"\bsessions?[ -]?\d+|\bs\d{1,2}\b", re.IGNORECASE)
ISSUE = re.compile(r"\bissues?[ -]?#?\d+", re.IGNORECASE)
SESSION_IN_NAME = re.compile(r"(?:^|[.\-_])s\d+(?=[.\-_]|$)|session|issue", re.IGNORECASE)

# Paths being cleaned on another branch: expected to fail until it lands, and the merge empties this
# set (the marks are strict, so a cleaned path left here fails the suite).
PENDING: set[str] = set()


def texts_of(area: str) -> Iterator[Path]:
    """The text files of one product area, relative paths in a stable order."""
    if area == "benchmarks/*.py":
        yield from sorted((ROOT / "benchmarks").glob("*.py"))
    elif area == "docs/*.md":
        yield from sorted(path for path in (ROOT / "docs").glob("*.md") if rel(path) not in PENDING)
    elif area.endswith(".md"):
        yield ROOT / area
    else:
        yield from sorted(path for path in (ROOT / area).rglob("*")
                          if path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def history_in(paths: Iterator[Path]) -> list[str]:
    """`file:line: text` for each line that names a work session or an issue."""
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if WORK_SESSION.search(line) or ISSUE.search(line):
                found.append(f"{rel(path)}:{number}: {line.strip()}")
    return found


def pending(area: str) -> pytest.MarkDecorator | tuple[()]:
    reason = f"{area} is being cleaned on another branch (PENDING)"
    return pytest.mark.xfail(strict=True, reason=reason) if area in PENDING else ()


AREAS = ["cluster", "kernels", "benchmarks/*.py", "docs/*.md", "README.md", "docs/performance.md"]


@pytest.mark.parametrize("area", [pytest.param(area, marks=pending(area)) for area in AREAS])
def test_product_text_names_no_work_session_or_issue(area: str) -> None:
    found = history_in(texts_of(area))
    assert not found, "history belongs to git, not to the product:\n" + "\n".join(found)


@pytest.mark.parametrize("area", [pytest.param(RESULTS, marks=pending(RESULTS))])
def test_results_are_named_by_what_they_measure_not_by_session(area: str) -> None:
    names = sorted(rel(path) for path in (ROOT / area).rglob("*") if SESSION_IN_NAME.search(path.name))
    assert not names, "a result's name says what it measures and where, not in which session:\n" + "\n".join(names)


# The examples carry `{n}` for the number, so that this file does not itself read as history.
@pytest.mark.parametrize(("text", "history"), [
    ("as session {n} left it", True), ("session-{n}'s runs", True), ("the s{n} runs", True),
    ("issue {n}, item 3", True), ("Issue {n}'s done-when", True), ("issue-{n} target", True),
    ("issues {n} and 17", True),
    ("one Ray session per test session", False), ("aiohttp.ClientSession()", False), ("an open issue", False),
    ("sm_90 and s390x", False), ("triton-lang/triton#11584", False),
])
def test_the_patterns_tell_history_from_product_words(text: str, history: bool) -> None:
    text = text.format(n=12)
    assert bool(WORK_SESSION.search(text) or ISSUE.search(text)) is history


@pytest.mark.parametrize(("name", "history"), [
    ("lscpu-s{n}.txt", True), ("kv-transfer.amx-s{n}.json", True), ("scaling-step.s{n}-quiet-1.3x.json", True),
    ("step-vs-linear.epyc-s{n}-fp8write.png", True), ("kv-transfer.json", False), ("serve-threads.xeon.json", False),
    ("step-vs-linear.fp8.png", False),
])
def test_the_name_pattern_tells_a_session_from_a_measure(name: str, history: bool) -> None:
    assert bool(SESSION_IN_NAME.search(name.format(n=12))) is history


# ---- the documents cite files that exist -------------------------------------------------------------

TOP_LEVEL = ("cluster", "kernels", "tests", "benchmarks", "docs", "deploy", "helm", "proto", "requirements", ".ci")
TOP_ALTERNATIVES = "|".join(re.escape(top) for top in TOP_LEVEL)
CITED = re.compile(r"(?<![\w./-])(?:\.\./)?((?:" + TOP_ALTERNATIVES + r")/[\w./<>{},*-]*)")
WILDCARD = re.compile(r"[<{*]")
DOCUMENT = re.compile(r"(?<![\w./-])([A-Za-z][\w-]*\.md)\b")  # a document named alone: in docs/ or at the top


def cited_paths(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in CITED.finditer(line):
            yield number, match.group(1)
        for match in DOCUMENT.finditer(line):
            name = match.group(1)
            yield number, name if (ROOT / name).is_file() else f"docs/{name}"


def exists(cited: str, files: frozenset[str]) -> bool:
    """A path, a folder, `name.json/png` (one name, two suffixes), a stem (`serve-rate-sweep.{json,png}`,
    `cpu_decode.c/.py`, `triton_*.py`: some file begins with it) or a template of what a command writes
    (`kernels-<gpu>.json`: its folder exists)."""
    wildcard = WILDCARD.search(cited)
    stem = cited[:wildcard.start()] if wildcard else cited.rstrip(".,:;)")
    if "/." in stem:  # `cpu_decode.c/.py`: the first name is the path
        stem = stem[:stem.index("/.")]
    parent = stem.rsplit("/", 1)[0]
    if wildcard and cited[wildcard.start()] == "<":
        return parent in files
    return any(name.startswith(stem) for name in files) or (parent in files and "." in parent.rsplit("/", 1)[-1])


@functools.cache
def repository_files() -> frozenset[str]:
    """Every file and folder of the checkout, relative paths; caches, virtual environments and git's
    own folder left out (pruned, not walked)."""
    names = set()
    for folder, folders, files in os.walk(ROOT):
        folders[:] = [name for name in folders if not (name.startswith(".") and name != ".ci")
                      and name not in ("__pycache__", "mutants", "build", "dist")]
        for name in (*folders, *files):
            names.add(rel(Path(folder) / name))
    return frozenset(names)


DOCUMENTS = ["README.md", *sorted(rel(path) for path in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("document", [pytest.param(document, marks=pytest.mark.skipif(
    document in PENDING, reason="being rewritten on another branch (PENDING)")) for document in DOCUMENTS])
def test_documents_cite_only_files_that_exist(document: str) -> None:
    files = repository_files()
    missing = [f"{document}:{number}: {cited}" for number, cited in cited_paths(ROOT / document)
               if not exists(cited, files)]
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)
