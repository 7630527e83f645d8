"""Fault injection for the reliability tests: a cuttable TCP proxy and uvicorn subprocesses.

:class:`TcpProxy` relays 127.0.0.1 connections to a real server (PostgreSQL, MariaDB, Redis)
from an event loop of its own, in a thread, so that it keeps relaying while a test blocks. A
test cuts it (every connection closed, new ones refused, reset or left hanging) and restores
it; the real server is never touched.

:class:`ServerProcess` runs an ASGI app under uvicorn in a child process, on a socket the test
opened (no port race), so that the test can kill it with SIGKILL mid-request.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
import uvicorn

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


class Cut(enum.Enum):
    """How a cut proxy treats connections after closing the ones it had."""

    #: Stop listening: connecting fails at once with "connection refused".
    REFUSE = "refuse"
    #: Accept, then close at once: the server "went away" during the handshake.
    RESET = "reset"
    #: Accept and never answer: only timeouts end the wait.
    HANG = "hang"


class TcpProxy:
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

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

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
    """

    def __init__(self, factory: str, env: Mapping[str, str], *, ready_path: str = "/health"):
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
            ],
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            pass_fds=(fd,),
            stdout=self._log,
            stderr=subprocess.STDOUT,
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
        """SIGKILL: the worker dies on the spot, mid-request."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> str:
        """Stop the server (SIGTERM, then SIGKILL) and return what it printed."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
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
        timeout_graceful_shutdown=graceful,
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
