"""The fault-injecting proxy and the duplicate-ticket demo, end to end on local sockets."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import TextIO

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from example_app import demo
from example_app.demo import DemoConfig, DemoSummary, Progress, serve
from example_app.proxy import HOST, Fault, FaultProxy, FaultRates


class Upstream:
    """A service that records the bodies it receives and echoes them back."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.app = Starlette(routes=[Route("/echo", self.echo, methods=["POST"])])
        self.port = 0

    async def echo(self, request: Request) -> Response:
        body = await request.body()
        self.seen.append(body)
        return Response(body, media_type="text/plain")

    def proxy(self, rates: FaultRates, delay: float = 5.0) -> FaultProxy:
        return FaultProxy(self.port, rates=rates, delay=delay, seed=0)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    service = Upstream()
    async with serve(service.app) as port:
        service.port = port
        yield service


@pytest.mark.anyio
async def test_forwards_when_no_fault_is_drawn(upstream: Upstream) -> None:
    async with (
        upstream.proxy(FaultRates()) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as http,
    ):
        first = await http.post("/echo", content=b"one")
        second = await http.post("/echo", content=b"two")
    assert (first.status_code, first.content, second.content) == (200, b"one", b"two")
    assert first.headers["connection"] == "close"
    assert upstream.seen == [b"one", b"two"]
    assert proxy.counts == {Fault.NONE: 2}


@pytest.mark.anyio
async def test_dropped_request_never_reaches_the_service(upstream: Upstream) -> None:
    async with (
        upstream.proxy(FaultRates(drop_request=1.0)) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as http,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post("/echo", content=b"lost")
    assert upstream.seen == []
    assert proxy.counts == {Fault.DROP_REQUEST: 1}


@pytest.mark.anyio
async def test_dropped_response_is_lost_after_the_service_acted(upstream: Upstream) -> None:
    async with (
        upstream.proxy(FaultRates(drop_response=1.0)) as proxy,
        httpx.AsyncClient(base_url=proxy.url) as http,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post("/echo", content=b"done")
    assert upstream.seen == [b"done"]
    assert proxy.counts == {Fault.DROP_RESPONSE: 1}


@pytest.mark.anyio
async def test_delayed_response_outlasts_the_client_timeout(upstream: Upstream) -> None:
    async with (
        upstream.proxy(FaultRates(delay=1.0), delay=5.0) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=0.2) as http,
    ):
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/echo", content=b"slow")
    assert upstream.seen == [b"slow"]
    assert proxy.counts == {Fault.DELAY: 1}


@pytest.mark.anyio
async def test_delayed_response_reaches_a_patient_client(upstream: Upstream) -> None:
    loop = asyncio.get_running_loop()
    async with (
        upstream.proxy(FaultRates(delay=1.0), delay=0.3) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=5.0) as http,
    ):
        started = loop.time()
        response = await http.post("/echo", content=b"late")
    assert loop.time() - started >= 0.3
    assert response.content == b"late"


@pytest.mark.anyio
async def test_requests_without_content_length_framing_are_refused(upstream: Upstream) -> None:
    async with upstream.proxy(FaultRates()) as proxy:
        reader, writer = await asyncio.open_connection(HOST, proxy.port)
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        )
        response = await reader.read()
        writer.close()
        await writer.wait_closed()
    assert response.startswith(b"HTTP/1.1 501 ")
    assert upstream.seen == []


def test_rates_must_be_probabilities() -> None:
    with pytest.raises(ValueError, match="sum to at most 1"):
        FaultRates(drop_request=0.6, delay=0.6)
    with pytest.raises(SystemExit) as exited:
        demo.main(["--drop-response", "-0.1"])
    assert exited.value.code == 2


def test_demo_exits_0_when_the_idempotent_run_has_no_duplicates(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    summaries: list[DemoSummary] = []
    run_demo = demo.run_demo

    async def recorded(config: DemoConfig, progress: TextIO | None = None) -> DemoSummary:
        summary = await run_demo(config, progress)
        summaries.append(summary)
        return summary

    monkeypatch.setattr(demo, "run_demo", recorded)
    assert demo.main(["--operations", "30", "--seed", "2", "--timeout", "0.5"]) == 0

    (summary,) = summaries
    naive, idempotent = summary.naive, summary.idempotent
    assert naive.duplicates > 0
    assert idempotent.duplicates == 0
    assert idempotent.tickets == idempotent.confirmed == idempotent.operations == 30
    assert sum(idempotent.faults.values()) > 0
    out, err = capsys.readouterr()
    # Captured stderr is no terminal: plain progress lines, no carriage returns.
    assert "\r" not in err
    assert err.splitlines()[-1] == "idempotent 30/30"
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:3]}
    assert rows["idempotent"][-2:] == ["0", "30"]
    assert out.rstrip().splitlines()[-1].startswith("OK:")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_line_on_a_terminal() -> None:
    stream = Terminal()
    bar = Progress("naive", 4, stream)
    for _ in range(4):
        bar.advance()
    assert stream.getvalue().count("\r") == 5
    assert stream.getvalue().endswith("\rnaive      [" + "#" * 30 + "] 4/4\n")


def test_progress_writes_plain_lines_elsewhere() -> None:
    stream = io.StringIO()
    bar = Progress("idempotent", 200, stream)
    for _ in range(200):
        bar.advance()
    assert stream.getvalue().splitlines() == [
        f"idempotent {done}/200" for done in (0, 50, 100, 150, 200)
    ]
