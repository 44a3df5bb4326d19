"""CHANGELOG.md keeps the Keep a Changelog form (https://keepachangelog.com/en/1.1.0/), one line
per change, and its newest release is the version that is installed and that `tandem --version`
prints: a release cut in one place and not the others fails here, not in a user's bug report.

The parser is run on broken copies too, so each rule is shown to be able to fail."""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
RELEASE = re.compile(r"## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})")


def released_versions(text: str) -> list[tuple[int, int, int]]:
    """The released versions, newest first, once every rule holds; a broken rule raises ValueError."""
    sections = text.split("\n## ")
    if len(sections) < 2 or not sections[1].startswith("[Unreleased]\n"):
        raise ValueError("the first section is not `## [Unreleased]`")
    versions: list[tuple[int, int, int]] = []
    for index, section in enumerate(sections[1:]):
        heading, *body = ("## " + section).splitlines()
        if index > 0:  # a released section
            match = RELEASE.fullmatch(heading)
            if match is None:
                raise ValueError(f"not `## [X.Y.Z] - YYYY-MM-DD`: {heading!r}")
            datetime.date.fromisoformat(match[4])  # a ValueError for a date that does not exist
            versions.append((int(match[1]), int(match[2]), int(match[3])))
        kinds = [line[4:] for line in body if line.startswith("### ")]
        if set(kinds) - KINDS or len(kinds) != len(set(kinds)):
            raise ValueError(f"{heading}: subsections {kinds}, each of {sorted(KINDS)} at most once")
        for line in body:
            if line.strip() and not line.startswith(("### ", "- ")):
                raise ValueError(f"{heading}: not a heading nor a one-line entry: {line!r}")
    if versions != sorted(set(versions), reverse=True):
        raise ValueError(f"releases not in descending order: {versions}")
    return versions


def test_the_changelog_keeps_the_form_and_has_a_release():
    assert released_versions(CHANGELOG.read_text()), "no released section"


def test_the_newest_release_is_the_installed_version_and_what_tandem_version_prints():
    newest = ".".join(map(str, released_versions(CHANGELOG.read_text())[0]))
    assert metadata.version("tandem-serve") == newest
    printed = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    assert printed == f"tandem {newest}"


GOOD = """\
# Changelog

Intro.

## [Unreleased]

## [0.2.0] - 2026-12-07

### Added
- B.

## [0.1.0] - 2026-12-06

### Fixed
- A.
"""


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("## [Unreleased]\n\n", ""),  # no Unreleased section
        ("## [Unreleased]\n\n## [0.2.0] - 2026-12-07\n", "## [0.2.0] - 2026-12-07\n\n## [Unreleased]\n"),  # not first
        ("[0.2.0] - 2026-12-07", "[0.0.9] - 2026-12-07"),  # ascending
        ("[0.2.0] - 2026-12-07", "[0.1.0] - 2026-12-07"),  # a version twice
        ("[0.2.0] - 2026-12-07", "[0.2.0]"),  # no date
        ("2026-12-07", "2026-13-07"),  # a date that does not exist
        ("[0.2.0]", "[0.2]"),  # not X.Y.Z
        ("## [0.1.0] - 2026-12-06", "## [Unreleased]"),  # Unreleased twice
        ("### Added", "### New"),  # not a Keep a Changelog kind
        ("- B.\n", "- B.\n\n### Added\n- C.\n"),  # a kind twice in one release
        ("- A.\n", "- A, wrapped\n  onto a second line.\n"),  # an entry on two lines
        ("- B.\n", "- B.\n\nA paragraph.\n"),  # prose inside a section
    ],
)
def test_a_broken_copy_is_refused(old: str, new: str):
    assert released_versions(GOOD) == [(0, 2, 0), (0, 1, 0)]
    assert old in GOOD
    with pytest.raises(ValueError):
        released_versions(GOOD.replace(old, new, 1))
