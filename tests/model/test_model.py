"""The protocol's model, checked exhaustively by spin: the real protocol holds every property,
each deliberately broken variant is caught, and the docs' table of windows is the model's.

Without spin or gcc these tests skip, except in CI (``IDEMPOTENCY_REQUIRE_SERVERS=1`` or
``CI=true``), where they fail.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REQUIRE_SERVERS
from tests.model.check import CONFIGURATIONS, Report, check, missing_tools, window_rows

RecordProperty = Callable[[str, object], None]
DOCS = Path(__file__).parents[2] / "docs" / "verification.md"
#: Fewer states than this, and the model lost its behaviour (a step that can no longer run).
FLOOR = 500_000


@pytest.fixture(autouse=True)
def _spin() -> None:
    missing = missing_tools()
    if not missing:
        return
    message = f"the model needs {' and '.join(missing)} (Debian: apt-get install spin gcc)"
    if REQUIRE_SERVERS or os.environ.get("CI") == "true":
        pytest.fail(message + " (CI)")
    pytest.skip(message)


def _checked(report: Report, record_property: RecordProperty) -> None:
    """The search covered every state without an error; its figures go to the report."""
    for name in ("states", "transitions", "depth", "search_seconds"):
        record_property(name, getattr(report, name))
    print(report.summary())
    assert report.errors == 0, report.output
    assert report.complete, report.output
    assert report.states > FLOOR, report.output


@pytest.mark.parametrize("configuration", ["fenced", "same-db"])
def test_fenced_effects_commit_once_and_replays_carry_the_committed_answer(
    tmp_path: Path, record_property: RecordProperty, configuration: str
) -> None:
    report = check(tmp_path, *CONFIGURATIONS[configuration])
    _checked(report, record_property)
    assert report.windows == ()


def test_unfenced_effects_run_twice_only_in_the_documented_windows(
    tmp_path: Path, record_property: RecordProperty
) -> None:
    report = check(tmp_path)
    _checked(report, record_property)
    section = DOCS.read_text().partition("### The windows")[2].partition("\n#")[0]
    documented = re.findall(r"^\| `.+` \|.*\|$", section, re.MULTILINE)
    assert sorted(window_rows(report.windows)) == sorted(documented)


@pytest.mark.parametrize(
    ("defines", "violated"),
    [
        # complete without comparing the token: a late worker settles the live holder's record
        (("-DBROKEN_COMPLETE",), "e_lease_proven"),
        # a claim that reads, then writes: two workers both take the key
        (("-DBROKEN_CLAIM",), "e_lease_proven"),
        # renew without comparing the token: a gone holder's key is kept in progress
        (("-DBROKEN_RENEW",), "c_lease_ends"),
        # a claim delivered twice that does not recognise its own token
        (("-DBROKEN_REDELIVERY",), "f_same_outcome"),
        # a proof that takes over another run's live proof: the effect commits twice
        (("-DBROKEN_PROOF", "-DFENCED"), "a_one_fenced_effect"),
        # the store's own record as the proof, kept a TTL from its claim, not its commit (the
        # code before the model found it: tests/stores/test_committed_records.py)
        (("-DBROKEN_FENCE_TTL", "-DSAME_DB"), "a_one_fenced_effect"),
    ],
    ids=lambda value: value[0].removeprefix("-D") if isinstance(value, tuple) else value,
)
def test_a_broken_protocol_is_caught(
    tmp_path: Path, defines: tuple[str, ...], violated: str
) -> None:
    report = check(tmp_path, *defines, optimize=False)
    print(report.summary())
    assert report.errors == 1, report.output
    assert report.violated == violated, report.output
    assert (tmp_path / "lifecycle.pml.trail").exists()  # spin -t replays the interleaving
