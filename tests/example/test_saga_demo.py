"""The order-saga demo end to end, at a size CI can afford: service, proxy, agent processes
killed mid-run and restarted, and the invariants read from the service's tables."""

from __future__ import annotations

from typing import TextIO

import pytest

from example_app import saga_demo
from example_app.saga_demo import SagaDemoConfig, SagaDemoSummary


def test_the_saga_run_keeps_every_invariant_through_a_crash_and_the_naive_one_does_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    summaries: list[SagaDemoSummary] = []
    run = saga_demo.run_saga_demo

    async def recorded(config: SagaDemoConfig, progress: TextIO | None = None) -> SagaDemoSummary:
        summary = await run(config, progress)
        summaries.append(summary)
        return summary

    monkeypatch.setattr(saga_demo, "run_saga_demo", recorded)
    argv = ["--orders", "24", "--email-failures", "0.3", "--large-orders", "0.3"]
    assert saga_demo.main([*argv, "--drop-response", "0.15", "--seed", "4"]) == 0

    (summary,) = summaries
    naive, saga = summary.runs
    assert (naive.name, saga.name) == ("naive", "saga")
    assert saga.crashed_after is not None
    assert saga.in_flight is not None
    assert len(saga.outcomes) == 24
    assert all(count in (0, None) for count in saga.violations.values())
    assert saga.count("completed") > 0
    assert saga.count("compensated") > 0
    assert saga.count("needs_intervention") > 0
    assert sum(count or 0 for count in naive.violations.values()) > 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("OK:")
    assert "duplicate charge" in out


def test_bad_arguments_exit_2() -> None:
    with pytest.raises(SystemExit) as exited:
        saga_demo.main(["--email-failures", "1.5"])
    assert exited.value.code == 2
