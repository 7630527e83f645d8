"""Fault injection for the reliability tests: a cuttable TCP proxy and uvicorn subprocesses.

:class:`TcpProxy` relays 127.0.0.1 connections to a real server (PostgreSQL, MariaDB, Redis)
from an event loop of its own, in a thread, so that it keeps relaying while a test blocks. A
test cuts it (every connection closed, new ones refused, reset or left hanging) and restores
it; the real server is never touched.

:class:`ServerProcess` runs an ASGI app under uvicorn in a child process, on a socket the test
opened (no port race), so that the test can kill it (or one of its workers) with SIGKILL
mid-request.

:class:`PostgreSQLServer` and :class:`RedisServer` are store servers of the test's own, on free
ports and in temporary folders, which a test pauses (SIGSTOP: the server hangs, connections
stay open), resumes, stops and starts again; the shared servers are never touched.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
import uvicorn

from tests.support.ports import free_ports

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class Cut(enum.Enum):
    """How a cut proxy treats connections after closing the ones it had."""

    #: Stop listening: connecting fails at once with "connection refused".
    REFUSE = "refuse"
    #: Accept, then close at once: the server "went away" during the handshake.
    RESET = "reset"
    #: Accept and never answer: only timeouts end the wait.
    HANG = "hang"


class Started(abc.ABC):
    """Started when a ``with`` block begins, closed when it ends (or when starting fails)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class TcpProxy(Started):
    """A TCP relay from ``127.0.0.1:<port>`` to ``upstream``, which can be cut and restored.

    Use ``with TcpProxy(port) as proxy:``; :meth:`url` rewrites a server URL to go through it.
    ``connections`` counts the connections accepted so far (cut or not).
    """

    def __init__(self, upstream_port: int, upstream_host: str = HOST) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.connections = 0
        self._cut: Cut | None = None
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- control, from the test's thread

    def start(self) -> None:
        self._thread.start()
        self._call(self._listen())

    def cut(self, how: Cut = Cut.REFUSE) -> None:
        """Close every relayed connection; from now on, treat new ones as ``how`` says."""
        self._call(self._do_cut(how))

    def restore(self) -> None:
        """Relay again, on the same port."""
        self._call(self._do_restore())

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._do_cut(Cut.REFUSE))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()

    def url(self, url: str) -> str:
        """``url`` (a database or Redis URL on 127.0.0.1) pointed at this proxy."""
        parts = urlsplit(url)
        credentials = parts.netloc.rpartition("@")[0]
        netloc = f"{credentials}@{HOST}:{self.port}" if credentials else f"{HOST}:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    # -- the relay, in the proxy's own loop

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, HOST, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _do_cut(self, how: Cut) -> None:
        self._cut = how
        if how is Cut.REFUSE and self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _do_restore(self) -> None:
        await self._do_cut(Cut.RESET)  # the hanging connections go too
        self._cut = None
        if self._server is None:
            await self._listen()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self._cut is Cut.RESET:
            writer.transport.abort()
            return
        self._open.add(writer)
        if self._cut is Cut.HANG:
            return
        task = asyncio.ensure_future(self._relay(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._open.add(up_writer)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for end in (writer, up_writer):
                end.transport.abort()
                self._open.discard(end)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()


def upstream_port(url: str, default: int) -> int:
    """The port in a server URL."""
    return urlsplit(url).port or default


# ---------------------------------------------------------------- uvicorn in a child process


class ServerProcess:
    """``uvicorn --factory <factory>`` in a child process, listening on a socket we opened.

    ``env`` is added to this process's environment. :meth:`wait_ready` polls ``ready_path``
    until the app answers; :meth:`kill` sends SIGKILL: no shutdown, no cleanup, no lifespan.
    With ``workers`` above 1, uvicorn's supervisor runs that many worker processes
    (:meth:`worker_pids`), and replaces a worker that dies.
    """

    def __init__(
        self,
        factory: str,
        env: Mapping[str, str],
        *,
        ready_path: str = "/health",
        workers: int = 1,
    ):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((HOST, 0))
        self._socket.listen(128)
        self.port: int = self._socket.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self.ready_path = ready_path
        fd = self._socket.fileno()
        # O_APPEND, so that reading it never moves where the server writes.
        self._log = tempfile.TemporaryFile(mode="a+b")  # noqa: SIM115  (closed in stop())
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                factory,
                "--fd",
                str(fd),
                "--lifespan",
                "on",
                "--log-level",
                "warning",
                "--no-access-log",
                "--timeout-graceful-shutdown",
                "2",
                *(["--workers", str(workers)] if workers > 1 else []),
            ],
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            pass_fds=(fd,),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # A group of its own: SIGKILL reaches the supervisor's workers too.
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"the server exited ({code}):\n{self.output()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the server on port {self.port} did not start in {timeout} s")

    def kill(self) -> None:
        """SIGKILL: the server (every worker) dies on the spot, mid-request."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def client(self) -> httpx.AsyncClient:
        """A client of the server that opens a connection per request, so that its requests
        spread over the workers."""
        return httpx.AsyncClient(
            base_url=self.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def worker_pids(self) -> set[int]:
        """The worker processes of a server run with ``workers`` above 1."""
        return {pid for pid in child_pids(self.process.pid) if _is_spawned_worker(pid)}

    def kill_worker(self) -> int:
        """SIGKILL one worker (the supervisor lives on); its pid."""
        pid = min(self.worker_pids())
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> str:
        """Stop the server (SIGTERM, then SIGKILL) and return what it printed."""
        end_process(self.process)
        self._socket.close()
        output = self.output()
        self._log.close()
        return output

    def output(self) -> str:
        """What the server printed so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


# ---------------------------------------------------------------- uvicorn in this process


@contextlib.asynccontextmanager
async def serve(app: Any, *, graceful: float = 5.0) -> AsyncIterator[str]:
    """Run ``app`` under uvicorn in this event loop on a free port; yields its base URL.

    ``graceful``: how long shutdown waits for requests in flight before cancelling them.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_config=None,
        log_level="warning",
        access_log=False,
        # Annotated int, but uvicorn passes it to asyncio.wait_for: fractions work.
        timeout_graceful_shutdown=graceful,  # type: ignore[arg-type]
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                await task
                raise RuntimeError("the server stopped while starting")
            await asyncio.sleep(0.01)
        yield f"http://{HOST}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
        # Requests cancelled at shutdown are still unwinding (releasing their claims).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                while server.server_state.tasks:  # noqa: ASYNC110  (uvicorn's own set)
                    await asyncio.sleep(0.01)


def end_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``process``; after 10 s, SIGKILL its process group (a session of its own)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux: from ``/proc``)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(child) for child in (task / "children").read_text().split()]
    return children


def _is_spawned_worker(pid: int) -> bool:
    # Not multiprocessing's resource tracker, the supervisor's other child.
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def free_port() -> int:
    """A TCP port that nothing listens on now (a server of the test's own will take it)."""
    return free_ports(1)[0]


# ---------------------------------------------------------------- store servers of our own


class StoreServer(Started):
    """A store server of the test's own, in a temporary folder, on a free port.

    :meth:`pause` stops every process of the server with SIGSTOP: it neither answers nor
    closes a connection, and new connections wait in the kernel's backlog, as with a server
    that hangs. :meth:`resume` sends SIGCONT. :meth:`stop` and :meth:`start` stop it and start
    it again on the same port (with the same data, where the server keeps any).
    """

    def __init__(self, name: str) -> None:
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix=f"idempotency-{name}-"))
        self._paused: list[int] = []

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The store's URL, for the app."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start the server; returns once it accepts connections."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the server (nothing when it is stopped); returns once it is gone."""

    @abc.abstractmethod
    def _processes(self) -> list[int]:
        """The server's processes, the one that accepts connections first."""

    def pause(self) -> None:
        """SIGSTOP every process of the server."""
        first = self._processes()[0]
        os.kill(first, signal.SIGSTOP)
        self._paused = [first]
        # Stopped, the first starts no new process: the others are all there now.
        for pid in self._processes()[1:]:
            os.kill(pid, signal.SIGSTOP)
            self._paused.append(pid)

    def resume(self) -> None:
        """SIGCONT what :meth:`pause` stopped."""
        for pid in reversed(self._paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._paused = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Paused within the block; resumed at its end, whatever happens."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def close(self) -> None:
        self.resume()
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def _as_owner(user: str) -> dict[str, Any]:
    """Popen arguments that run a server as ``user`` when we are root (PostgreSQL refuses root)."""
    return {"user": user, "group": user} if os.geteuid() == 0 else {}


class PostgreSQLServer(StoreServer):
    """A PostgreSQL cluster of the test's own (``initdb``, ``pg_ctl``), user ``postgres``, trust.

    With ``template`` (the ``data`` folder of another, stopped, server of this class), the
    cluster starts as a copy of that one, which is faster than ``initdb``.
    """

    USER = "postgres"

    def __init__(self, template: Path | None = None) -> None:
        versions = sorted(
            Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
            key=lambda path: int(path.parent.parent.name),
        )
        if not versions:
            raise FileNotFoundError("no PostgreSQL server binaries in /usr/lib/postgresql")
        super().__init__("postgresql")
        self.bin = versions[-1].parent
        self.data = self.folder / "data"
        try:
            if os.geteuid() == 0:
                shutil.chown(self.folder, self.USER, self.USER)
            if template is None:
                self._run(
                    *("initdb", "-D", self.data, "-U", self.USER),
                    *("-A", "trust", "-E", "UTF8", "--no-sync"),
                )
            else:
                subprocess.run(
                    ["cp", "-a", str(template), str(self.data)],
                    check=True,
                    capture_output=True,
                    **_as_owner(self.USER),
                )
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    def database_url(self, database: str) -> str:
        return f"postgresql://{self.USER}@{HOST}:{self.port}/{database}"

    @property
    def url(self) -> str:
        return self.database_url("postgres")

    def create_database(self, name: str) -> str:
        """A new, empty database on this server; its URL."""
        self._run("createdb", "-h", HOST, "-p", str(self.port), "-U", self.USER, name)
        return self.database_url(name)

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.folder} -c listen_addresses={HOST}"
            " -c fsync=off -c full_page_writes=off"
        )
        self._run(
            "pg_ctl", "-D", self.data, "-o", options, "-l", self.folder / "log", "-w", "start"
        )

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")

    def _processes(self) -> list[int]:
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        return [postmaster, *child_pids(postmaster)]

    def _run(self, program: str, *args: str | Path) -> None:
        subprocess.run(
            [str(self.bin / program), *map(str, args)],
            check=True,
            capture_output=True,
            timeout=60,
            **_as_owner(self.USER),
        )


class ProcessServer(StoreServer):
    """A store server that is one process of ours: :meth:`command` started, ready once
    :meth:`answers`."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.process: subprocess.Popen[bytes] | None = None

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The server's command line."""

    @abc.abstractmethod
    def answers(self) -> bool:
        """Whether the server answers a new connection."""

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.command(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.command()[0]} did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            end_process(self.process)
        self.process = None

    def _processes(self) -> list[int]:
        assert self.process is not None, "the server is not running"
        return [self.process.pid]


class MariaDBServer(ProcessServer):
    """A MariaDB server of the test's own (``mariadb-install-db``, ``mariadbd``), user ``root``
    without a password; ``options`` are given to ``mariadbd``."""

    def __init__(self, *options: str) -> None:
        self.program = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
        if not Path(self.program).exists() or shutil.which("mariadb-install-db") is None:
            raise FileNotFoundError("no mariadbd and mariadb-install-db programs")
        super().__init__("mariadb")
        self.data = self.folder / "data"
        # mariadbd runs as root only when told to.
        self._user = ["--user=root"] if os.geteuid() == 0 else []
        self.options = options
        subprocess.run(
            [
                *("mariadb-install-db", "--no-defaults", f"--datadir={self.data}", *self._user),
                *("--auth-root-authentication-method=normal", "--skip-test-db"),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )

    @property
    def url(self) -> str:
        return f"mysql://root@{HOST}:{self.port}/mysql"

    def command(self) -> list[str]:
        return [
            *(self.program, "--no-defaults", f"--datadir={self.data}", *self._user),
            *(f"--port={self.port}", f"--bind-address={HOST}", "--skip-log-bin"),
            *(f"--socket={self.folder / 'sock'}", f"--pid-file={self.folder / 'pid'}"),
            *self.options,
        ]

    def answers(self) -> bool:
        """Whether the server sends its handshake to a new connection."""
        try:
            with socket.create_connection((HOST, self.port), timeout=1) as conn:
                return bool(conn.recv(16))
        except OSError:
            return False


class RedisServer(ProcessServer):
    """A ``redis-server`` of the test's own, keeping nothing on disk (data ends with it)."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            raise FileNotFoundError("no redis-server program")
        super().__init__("redis")

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def command(self) -> list[str]:
        return [
            *("redis-server", "--port", str(self.port), "--bind", HOST),
            *("--save", "", "--appendonly", "no", "--dir", str(self.folder)),
        ]

    def answers(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False
