"""Every benchmark at a reduced size, one after the other; writes ``benchmarks/RESULTS.md``.

    python -m benchmarks.run_all [--skip network,profiling] [--output benchmarks/RESULTS.md]

Each benchmark runs as its own process (a fresh interpreter and event loop). Figures depend on
what else the machine is doing: the load average is recorded before and after each step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BENCH_DIR, fmt, loadavg, machine_info, markdown_table, wait_for_quiet

#: Added µs over bare FastAPI, in process, that the project set as targets (first, replay).
TARGETS = {
    "ours-redis": (250, 60),
    "ours-sqlite": (350, 60),
    "ours-postgresql": (800, 170),
}

STEPS: dict[str, tuple[str, list[str]]] = {
    "inprocess": ("In process: µs per request", ["-n", "2000", "--warmup", "300"]),
    "correctness": ("Correctness: 50 concurrent requests, one key, 100 ms handler", []),
    "scale": (
        "Scale: claim latency against table size; fingerprint cost",
        ["--full", "-n", "300"],
    ),
    "network": (
        "Under uvicorn, loaded by wrk (32 connections, 1 thread)",
        ["--duration", "1", "--workers", "1,2"],
    ),
    "profiling": (
        "Profile: where the time goes",
        ["-n", "200", "--profile-n", "200", "--py-spy", "--profile-dir", "benchmarks/profiles"],
    ),
}


def library_digest() -> str:
    """A digest of the library's sources: the tree is not committed, so name what was run."""
    digest = hashlib.sha256()
    for path in sorted((BENCH_DIR.parent / "idempotency_mw").rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def targets_table(inprocess: list[dict[str, Any]]) -> str:
    rows = []
    for run in inprocess:
        target = TARGETS.get(run["variant"])
        if target is None:
            continue
        wanted = target[0] if run["mode"] == "first" else target[1]
        added = run["added_p50"]
        verdict = "-" if added is None else ("met" if added <= wanted else "**missed**")
        rows.append(
            [
                run["variant"],
                run["mode"],
                fmt(added),
                fmt(run["added_p99"]),
                fmt(run.get("added_to_response_p50")),
                wanted,
                verdict,
                "-" if added is None else f"{added / wanted:.1f}x",
            ]
        )
    return markdown_table(
        [
            "store",
            "mode",
            "added p50 µs",
            "added p99 µs",
            "added p50 to response µs",
            "target µs",
            "verdict (p50)",
            "vs target",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", default="", help=f"comma-separated steps of {list(STEPS)}")
    parser.add_argument("--output", default=str(BENCH_DIR / "RESULTS.md"))
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each step, wait up to this many seconds for the 1-minute load to drop "
        "under 1.5 (default: don't wait)",
    )
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    info = machine_info()
    info["idempotency_mw sources sha256"] = library_digest()
    started = time.monotonic()
    sections: list[str] = []
    load_notes: list[str] = []
    inprocess: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="idem-bench-all-") as name:
        for step, (title, extra) in STEPS.items():
            if step in skip:
                continue
            load = wait_for_quiet(args.wait_quiet, 1.5) if args.wait_quiet else loadavg()
            json_path = Path(name) / f"{step}.json"
            md_path = Path(name) / f"{step}.md"
            command = [
                sys.executable,
                "-m",
                f"benchmarks.{step}",
                *extra,
                "--json",
                str(json_path),
                "--markdown",
                str(md_path),
            ]
            print(f"== {step}: {' '.join(command[2:])}", file=sys.stderr, flush=True)
            began = time.monotonic()
            done = subprocess.run(command, cwd=BENCH_DIR.parent, check=False, timeout=1800)
            seconds = time.monotonic() - began
            digest = library_digest()
            changed = "" if digest == info["idempotency_mw sources sha256"] else (
                f"; **library sources changed during the run: now {digest}**"
            )  # fmt: skip
            load_notes.append(
                f"{step}: load {load} before, {loadavg()} after, {seconds:.0f} s{changed}"
            )
            body = md_path.read_text() if md_path.exists() else f"(failed: exit {done.returncode})"
            sections.append(
                f"## {title}\n\n`python -m benchmarks.{step} {' '.join(extra)}`\n\n{body}"
            )
            if step == "inprocess" and json_path.exists():
                inprocess = json.loads(json_path.read_text())
    header = [
        "# idempotency-mw benchmarks",
        "",
        f"Written by `python -m benchmarks.run_all` in {time.monotonic() - started:.0f} s "
        "(reduced sizes; run each script with `--help` for full ones).",
        "",
        markdown_table(["", ""], [[k, v] for k, v in info.items()]),
        "",
        "Load average (1/5/15 min) per step: the machine is shared, and other work running at "
        "the same time inflates every figure; compare rows of one run, not runs.",
        "",
        *[f"- {note}" for note in load_notes],
        "",
    ]
    if inprocess:
        header += [
            "## Targets: added µs over bare FastAPI, in process (p50)",
            "",
            targets_table(inprocess),
            "",
        ]
    Path(args.output).write_text("\n".join(header) + "\n" + "\n\n".join(sections))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
