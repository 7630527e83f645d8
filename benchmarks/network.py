"""Throughput and latency under uvicorn on 127.0.0.1, loaded by wrk from a second process.

For 1 and 2 uvicorn workers, the bare app runs all along on one port and each variant in turn
on another; runs alternate bare, variant (fresh keys), variant (one primed key), bare, next
variant..., so drift hits all alike. A variant's ratio is against the mean of the bare runs on
either side of it. wrk's Lua script gives every request its own Idempotency-Key (or the fixed,
primed one for the replay run) and stops each run after ``--requests`` answers; ``--duration``
bounds a run that is slower than that.

    python -m benchmarks.network [--requests 10000] [--connections 16] [--workers 1,2]

Needs ``wrk``; installs Debian's package when it is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.apps import BODY, LABELS, PATH, VARIANTS, prepare, unavailable
from benchmarks.common import TREE_DIR, fmt, markdown_table, write_json

HOST = "127.0.0.1"
WRK_SCRIPT = r"""
-- Every request gets its own Idempotency-Key (prefix-thread-counter), or the fixed one.
local counter = 0
local threads = {}
local prefix = "k"
local fixed = nil
local limit = nil
local answered = 0

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

function init(args)
  prefix = (args[1] or "k") .. "-" .. tostring(tid or 0) .. "-"
  if args[2] and args[2] ~= "" then fixed = args[2] end
  if args[3] and args[3] ~= "" then limit = tonumber(args[3]) end
  wrk.method = "POST"
  wrk.path = "/tickets"
  wrk.body = '{"title": "printer on fire", "priority": 2}'
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = fixed or (prefix .. counter)
  return wrk.format()
end

statuses = {}
function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
  answered = answered + 1
  if limit and answered == limit then
    -- The runner interrupts wrk once every thread said so (wrk itself waits out -d).
    io.write("BENCHLIMIT\n")
    io.flush()
    wrk.thread:stop()
  end
end

function done(summary, latency, requests)
  local merged = {}
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses") or {}) do
      merged[status] = (merged[status] or 0) + count
    end
  end
  local parts = {}
  for status, count in pairs(merged) do
    table.insert(parts, string.format('"%d": %d', status, count))
  end
  io.write('BENCHSTATUS {' .. table.concat(parts, ", ") .. '}\n')
  local e = summary.errors
  io.write(string.format(
    'BENCHJSON {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, ' ..
    '"write": %d, "status": %d, "timeout": %d, "p50": %d, "p90": %d, "p99": %d, ' ..
    '"max": %d, "mean": %.1f}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean))
end
"""


@dataclass
class WrkResult:
    requests: int = 0
    duration_us: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    p50: float = 0.0
    p99: float = 0.0
    mean: float = 0.0
    #: CPU seconds the server's processes (uvicorn and its workers) spent during the run.
    server_cpu: float = 0.0

    @property
    def rps(self) -> float:
        return self.requests / (self.duration_us / 1e6) if self.duration_us else 0.0

    @property
    def cpu_us_per_request(self) -> float | None:
        return self.server_cpu / self.requests * 1e6 if self.requests else None


@dataclass
class Row:
    workers: int
    variant: str
    mode: str
    result: WrkResult | None = None
    bare: list[WrkResult] = field(default_factory=list)
    error: str | None = None

    @property
    def bare_rps(self) -> float | None:
        return sum(b.rps for b in self.bare) / len(self.bare) if self.bare else None

    @property
    def ratio(self) -> float | None:
        bare = self.bare_rps
        return self.result.rps / bare if self.result and bare else None


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def post(port: int, key: str | None, timeout: float = 5.0, body: bytes = BODY) -> int:
    """One POST /tickets to 127.0.0.1:``port``; returns the status."""
    request = urllib.request.Request(f"http://{HOST}:{port}{PATH}", data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Idempotency-Key", key)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            # The whole answer: the status line arrives before the record is complete.
            response.read()
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user and system) of process ``pid`` and its children, from /proc."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:  # ended meanwhile
            continue
        # Fields 14 and 15 of stat (utime, stime); the split dropped the first two.
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        pending += [int(child) for child in children]
    return total


@dataclass
class Server:
    """A uvicorn server under benchmark: its port and its supervisor's pid."""

    port: int
    pid: int


@contextmanager
def uvicorn_server(
    variant: str,
    workers: int,
    sqlite_dir: Path,
    *,
    env_extra: dict[str, str] | None = None,
    startup_timeout: float = 30.0,
) -> Iterator[Server]:
    """uvicorn serving ``variant`` on a free 127.0.0.1 port."""
    port = free_port()
    env = {
        **os.environ,
        "BENCH_VARIANT": variant,
        "BENCH_SQLITE_DIR": str(sqlite_dir),
        "PYTHONPATH": str(TREE_DIR),
        **(env_extra or {}),
    }
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "benchmarks.apps:create_app",
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    process = subprocess.Popen(command, env=env, cwd=TREE_DIR, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-800:]
                raise RuntimeError(f"uvicorn exited ({process.returncode}): {tail}")
            try:
                # Without a key the layer passes the request through: a readiness probe
                # that leaves no record.
                if post(port, None, timeout=2.0) == 201:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not answer on port {port}")
            time.sleep(0.2)
        if workers > 1:
            # Let every worker come up before timing (each one probes its store at startup).
            time.sleep(1.0 + 0.5 * workers)
        yield Server(port, process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        log.close()


def install_wrk() -> bool:
    """Install Debian's wrk package (as root, or through sudo); whether wrk is there now."""
    apt = ["apt-get", "install", "-y", "-q", "wrk"]
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    print("… installing wrk from Debian's packages", file=sys.stderr)
    for command in (apt, ["apt-get", "update", "-q"], apt):
        if shutil.which(sudo[0] if sudo else "apt-get") is None:
            return False
        done = subprocess.run([*sudo, *command], capture_output=True, check=False)
        if done.returncode == 0 and shutil.which("wrk"):
            return True
    return shutil.which("wrk") is not None


def run_wrk(
    server: Server,
    script: Path,
    requests: int,
    duration: float,
    connections: int,
    threads: int,
    fixed_key: str = "",
) -> WrkResult:
    """``requests`` answers (each thread stops at its share), or ``duration`` seconds at most."""
    command = [
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "5s",
        "-s",
        str(script),
        f"http://{HOST}:{server.port}{PATH}",
        "--",
        f"r{uuid.uuid4().hex[:10]}",
        fixed_key,
        str(-(-requests // threads)),
    ]
    cpu_before = process_tree_cpu(server.pid)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    lines: list[str] = []
    stopped = 0
    for line in process.stdout:
        lines.append(line)
        stopped += line.startswith("BENCHLIMIT")
        if stopped == threads:
            # Every thread has its answers: SIGINT makes wrk report now, with its real runtime.
            process.send_signal(signal.SIGINT)
            break
    rest, stderr = process.communicate(timeout=duration + 60)
    server_cpu = process_tree_cpu(server.pid) - cpu_before
    output = "".join(lines) + rest
    statuses: dict[int, int] = {}
    for line in output.splitlines():
        if line.startswith("BENCHSTATUS "):
            statuses = {int(k): v for k, v in json.loads(line.split(" ", 1)[1]).items()}
        if line.startswith("BENCHJSON "):
            data = json.loads(line.removeprefix("BENCHJSON "))
            return WrkResult(
                requests=data["requests"],
                duration_us=data["duration_us"],
                errors={
                    k: data[k] for k in ("connect", "read", "write", "status", "timeout") if data[k]
                },
                statuses=statuses,
                p50=data["p50"],
                p99=data["p99"],
                mean=data["mean"],
                server_cpu=server_cpu,
            )
    raise RuntimeError(f"wrk failed: {stderr.strip() or output[-400:]}")


def measure(args: argparse.Namespace) -> list[Row]:
    variants = [v for v in args.variants.split(",") if v] if args.variants else list(VARIANTS)
    variants = [v for v in variants if v != "bare"]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="idem-bench-net-") as directory:
        sqlite_dir = Path(directory)
        script = sqlite_dir / "keys.lua"
        script.write_text(WRK_SCRIPT)

        def wrk(server: Server, fixed: str = "", requests: int = args.requests) -> WrkResult:
            return run_wrk(
                server, script, requests, args.duration, args.connections, args.threads, fixed
            )

        def warm_up(server: Server) -> None:
            """Untimed fresh-key requests on a new server: first connections, caches, imports."""
            if args.warmup:
                wrk(server, requests=args.warmup)

        for workers in args.workers:
            with uvicorn_server("bare", workers, sqlite_dir) as bare:
                print(f"… {workers} worker(s): bare", file=sys.stderr, flush=True)
                warm_up(bare)
                previous_bare = wrk(bare)
                rows.append(Row(workers, "bare", "any", previous_bare, [previous_bare]))
                for variant in variants:
                    first, replay = Row(workers, variant, "first"), Row(workers, variant, "replay")
                    rows += [first, replay]
                    reason = unavailable(variant)
                    if reason:
                        first.error = replay.error = reason
                        continue
                    print(f"… {workers} worker(s): {variant}", file=sys.stderr, flush=True)
                    try:
                        asyncio.run(prepare(variant, sqlite_dir))
                        with uvicorn_server(variant, workers, sqlite_dir) as server:
                            warm_up(server)
                            first.result = wrk(server)
                            key = f"replay-{uuid.uuid4().hex[:12]}"
                            primed = post(server.port, key)
                            if primed != 201:
                                replay.error = f"priming the replay key answered {primed}"
                            replay.result = wrk(server, key)
                    except Exception as exc:
                        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                        for row in (first, replay):
                            if row.result is None:
                                row.error = message
                    next_bare = wrk(bare)
                    rows.append(Row(workers, "bare", "any", next_bare, [next_bare]))
                    for row in (first, replay):
                        row.bare = [previous_bare, next_bare]
                    previous_bare = next_bare
    return rows


def table(rows: list[Row]) -> str:
    headers = [
        "workers",
        "variant",
        "mode",
        "req/s",
        "p50 ms",
        "p99 ms",
        "server CPU µs/req",
        "bare req/s",
        "ratio to bare",
        "errors / non-2xx",
        "notes",
    ]
    out = []
    for row in rows:
        if row.variant == "bare":
            continue
        r = row.result
        errors = ", ".join(
            [f"{k} {v}" for k, v in (r.errors if r else {}).items() if k != "status"]
            + [f"{s}x{n}" for s, n in sorted((r.statuses if r else {}).items()) if s != 201]
        )
        out.append(
            [
                row.workers,
                LABELS[row.variant],
                row.mode,
                fmt(r.rps if r else None),
                fmt(r.p50 / 1000 if r else None, 2),
                fmt(r.p99 / 1000 if r else None, 2),
                fmt(r.cpu_us_per_request if r else None),
                fmt(row.bare_rps),
                fmt(row.ratio, 2),
                f"**{errors}**" if errors else "0",
                row.error or "",
            ]
        )
    return markdown_table(headers, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="answers per wrk run")
    parser.add_argument(
        "--warmup", type=int, default=1_000, help="untimed answers on each new server first"
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds a wrk run may take at most"
    )
    parser.add_argument("--connections", type=int, default=32, help="wrk connections")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2],
        help="uvicorn worker counts, comma-separated",
    )
    parser.add_argument("--variants", default="", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the Markdown table here")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None and not install_wrk():
        print("wrk is not installed and could not be (apt-get install wrk)", file=sys.stderr)
        return 2
    rows = measure(args)
    text = table(rows)
    bare = [row.result.rps for row in rows if row.variant == "bare" and row.result]
    if bare:
        text += f"\n\nBare FastAPI runs: {', '.join(fmt(b) for b in bare)} req/s.\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    write_json(
        args.json,
        [
            {
                "workers": row.workers,
                "variant": row.variant,
                "mode": row.mode,
                "rps": row.result.rps if row.result else None,
                "p50_us": row.result.p50 if row.result else None,
                "p99_us": row.result.p99 if row.result else None,
                "cpu_us": row.result.cpu_us_per_request if row.result else None,
                "errors": row.result.errors if row.result else None,
                "statuses": row.result.statuses if row.result else None,
                "bare_rps": row.bare_rps,
                "ratio": row.ratio,
                "error": row.error,
            }
            for row in rows
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
