"""Check the protocol's model (``lifecycle.pml``) with spin: generate the verifier, compile it,
search the whole state space, and read what pan reports.

``python -m tests.model.check`` checks every configuration and prints, for each, the states,
depth and time of the search, then the windows of the unfenced one as the docs' table rows;
``python -m tests.model.check -DBROKEN_COMPLETE`` checks a variant (any ``-D`` of the model).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = Path(__file__).with_name("lifecycle.pml")
#: The model's configurations: the effect fenced with the proof table, fenced with a store on
#: the app's own database, or not fenced.
CONFIGURATIONS = {"fenced": ("-DFENCED",), "same-db": ("-DSAME_DB",), "unfenced": ()}
#: pan's search depth limit (the model's longest path is a few hundred steps) and memory cap.
DEPTH_LIMIT = 10_000
MEMORY_MB = 1024


@dataclass(frozen=True)
class Report:
    """What one search found."""

    defines: tuple[str, ...]
    errors: int
    states: int
    transitions: int
    depth: int
    #: The search alone, as pan measured it; ``seconds`` also counts generating and compiling.
    search_seconds: float
    seconds: float
    #: The property whose assertion failed (pan stops at the first), if one did.
    violated: str | None
    #: The windows of unfenced double runs reached, as "name: what happened", in the order found.
    windows: tuple[str, ...]
    #: Whether the search covered the whole state space (not cut short by depth or memory).
    complete: bool
    output: str

    def summary(self) -> str:
        name = " ".join(self.defines) or "(unfenced)"
        outcome = f"violates {self.violated}" if self.violated else f"{self.errors} errors"
        return (
            f"{name}: {outcome}; {self.states:,} states, {self.transitions:,} transitions, "
            f"depth {self.depth}, search {self.search_seconds:.1f} s, "
            f"{self.seconds:.1f} s with compiling"
        )


def missing_tools() -> list[str]:
    """The programs the check needs that this machine lacks."""
    return [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]


def check(workdir: Path, *defines: str, optimize: bool = True) -> Report:
    """Check the model with ``defines`` in ``workdir`` (pan and its trail are written there);
    ``optimize=False`` compiles faster, for a variant expected to fail within a few steps."""
    started = time.perf_counter()
    shutil.copyfile(MODEL, workdir / MODEL.name)
    _run(["spin", "-a", *defines, MODEL.name], workdir)
    flags = ["-O2" if optimize else "-O0", "-DSAFETY", f"-DMEMLIM={MEMORY_MB}"]
    _run(["gcc", *flags, "-o", "pan", "pan.c"], workdir)
    output = _run(["./pan", f"-m{DEPTH_LIMIT}", "-w23"], workdir)
    return _report(defines, output, time.perf_counter() - started)


def _run(command: list[str], workdir: Path) -> str:
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def _number(pattern: str, output: str) -> float:
    found = re.search(pattern, output)
    if found is None:
        raise RuntimeError(f"pan's report has no {pattern!r}:\n{output}")
    return float(found.group(1))


def _report(defines: tuple[str, ...], output: str, seconds: float) -> Report:
    violated = re.search(r"assertion violated (\w+)", output)
    return Report(
        defines=defines,
        errors=int(_number(r"errors: (\d+)", output)),
        states=int(_number(r"(\d+) states, stored", output)),
        transitions=int(_number(r"(\d+) transitions", output)),
        depth=int(_number(r"depth reached (\d+)", output)),
        search_seconds=_number(r"elapsed time ([\d.e+]+) seconds", output),
        seconds=seconds,
        violated=violated.group(1) if violated else None,
        windows=tuple(re.findall(r"^WINDOW (.+)$", output, re.MULTILINE)),
        complete="max search depth too small" not in output and "out of memory" not in output,
        output=output,
    )


def window_rows(windows: tuple[str, ...]) -> list[str]:
    """The windows as the rows of the docs' table (``| `name` | what happened |``)."""
    return [f"| `{name}` | {what} |" for name, _, what in (w.partition(": ") for w in windows)]


def main(defines: list[str]) -> int:
    runs = [tuple(defines)] if defines else list(CONFIGURATIONS.values())
    failed = False
    for run in runs:
        with tempfile.TemporaryDirectory() as workdir:
            report = check(Path(workdir), *run)
        print(report.summary())
        failed = failed or report.errors > 0 or not report.complete
        for row in window_rows(report.windows):
            print(row)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
