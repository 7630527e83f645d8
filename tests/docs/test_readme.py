"""The README stays short and points into the docs; its commands are the ones CI runs.

Its Python blocks run with the docs' (tests/docs/test_docs.py), from an installed wheel.
"""

from __future__ import annotations

import re

from tests.support.readme import README, ROOT, blocks, commands

TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/pytest"
_LINK = re.compile(r"\]\((?P<target>[^)#]+)(?:#[^)]*)?\)")


def test_the_readme_fits_in_250_lines() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_the_test_command_is_the_one_ci_runs_word_for_word() -> None:
    shell = [line for block in blocks() if block.language == "sh" for line in commands(block)]
    assert TEST_COMMAND in shell
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_quick_start_installs_from_a_checkout_or_a_wheel_and_names_the_registry_line() -> None:
    text = README.read_text()
    assert "pip install -e '/path/to/idempotency-mw[sql]'" in text
    assert "dist/idempotency_mw-*.whl" in text
    assert "pip install 'idempotency-mw[sql]'" in text


def test_every_link_of_the_readme_leads_to_a_file_of_the_checkout() -> None:
    targets = [m["target"] for m in _LINK.finditer(README.read_text())]
    local = [target for target in targets if "://" not in target]
    assert len(local) >= 10
    missing = [target for target in local if not (ROOT / target).is_file()]
    assert not missing, f"links to nothing: {missing}"
