"""README.md and docs/benchmarks.md read as a manual: the two commands at the top, questions
with answers, nothing only one machine or one tracker knows, and links that land."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# How far down README a newcomer reads before giving up on finding how to start.
COMMANDS_WITHIN_LINES = 60
DEMO_COMMAND = "uv run ringd demo"

# "issue 31", "issues 16 and 17", "#31": the tracker's numbers mean nothing to a reader of a
# clone. Not "#" in an anchor or a shell comment, whose digits never follow it directly.
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+|(?<![\w/&])#\d{2,}\b", re.IGNORECASE)
# A path that exists on one machine only (a baseline checkout, a scratch cache, a home).
# `~/...` and paths inside the repository are what every reader has.
MACHINE_PATH = re.compile(r"(?<![\w.~])/(tmp|root|home|Users|work)/")
UNDER_QUESTIONS = ("docs/benchmarks.md",)
FREE_OF_NUMBERS_AND_PATHS = ("README.md", "docs/benchmarks.md")


def ci_test_command(ci_script: str) -> str:
    """The test command .ci/run runs, as a user types it (`--frozen` is CI's: the lock as is)."""
    runs = [line.strip() for line in ci_script.splitlines() if line.strip().startswith("uv run ")]
    assert runs, ".ci/run runs no `uv run` line"
    return " ".join(word for word in runs[-1].split() if word != "--frozen")


def commands_missing_at_top(readme: str, command: str) -> list[str]:
    top = readme.splitlines()[:COMMANDS_WITHIN_LINES]
    return [c for c in (DEMO_COMMAND, command) if not any(line.strip().startswith(c) for line in top)]


def issue_numbers(text: str) -> list[str]:
    return [m.group(0) for m in ISSUE_NUMBER.finditer(text)]


def machine_paths(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if MACHINE_PATH.search(line)]


def headings_not_questions(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ") and not line.rstrip().endswith("?")]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation gone, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def broken_links(source: Path) -> list[str]:
    broken = []
    for target, anchor in re.findall(r"\]\(([^)\s#]*\.md)?(?:#([^)\s]+))?\)", source.read_text()):
        path = (source.parent / target) if target else source
        if not path.is_file():
            broken.append(f"{target} (no such file)")
        elif anchor and anchor not in anchors(path.read_text()):
            broken.append(f"{target or source.name}#{anchor}")
    return broken


def test_readme_gives_the_demo_and_the_test_command_at_its_top():
    command = ci_test_command((ROOT / ".ci" / "run").read_text())
    assert command == "uv run --group test pytest", ".ci/run's test command changed: is README's the same?"
    missing = commands_missing_at_top((ROOT / "README.md").read_text(), command)
    assert missing == [], f"not in README's first {COMMANDS_WITHIN_LINES} lines: {missing}"


def test_no_issue_number_and_no_machine_path_in_the_manual():
    for name in FREE_OF_NUMBERS_AND_PATHS:
        text = (ROOT / name).read_text()
        assert issue_numbers(text) == [], f"{name} cites the tracker: {issue_numbers(text)}"
        assert machine_paths(text) == [], f"{name} names paths only one machine has: {machine_paths(text)}"


def test_every_section_of_the_benchmarks_is_a_question():
    for name in UNDER_QUESTIONS:
        assert headings_not_questions((ROOT / name).read_text()) == []


def test_links_between_the_docs_land():
    for source in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        assert broken_links(source) == [], f"{source.relative_to(ROOT)}: {broken_links(source)}"


def test_the_checks_catch_what_they_are_for():
    """Each check fails on the kind of text it keeps out (README and benchmarks as they were)."""
    assert issue_numbers("issue 31's target; issues 16 and 17; see #31") == ["issue 31", "issues 16", "#31"]
    assert issue_numbers("[x](docs/b.md#one-ring-of-4) `# 12 cores` &#39;") == []
    assert machine_paths("--baseline /tmp/base31\nin /work/base-fat") == ["--baseline /tmp/base31", "in /work/base-fat"]
    assert machine_paths("~/.config/ringd/secret, /Library/LaunchDaemons/, ~/.ollama/models") == []
    assert headings_not_questions("## What does a hop cost?\n## The hop's last fat\n### A detail") == ["## The hop's last fat"]
    diary = "# ringd\n" + "timings\n" * COMMANDS_WITHIN_LINES + "uv run --group test pytest\n"
    assert commands_missing_at_top("uv run ringd demo\n" + diary, "uv run --group test pytest") == ["uv run --group test pytest"]
    assert slug("What does TLS cost a streamed token?") == "what-does-tls-cost-a-streamed-token"
    assert slug("`ollama:` models as Ollama runs them") == "ollama-models-as-ollama-runs-them"
