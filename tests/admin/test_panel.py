"""The operator's panel: in process for its rules, and in a real browser against
`idempotency-mw panel` served by uvicorn, on a store and a journal with real records."""

from __future__ import annotations

import asyncio
import html
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.routing import Mount

from idempotency_mw import RedisStore, SQLStore, StoredResponse
from idempotency_mw.client import IdempotentClient, JournalEntry, OperationState, SQLiteJournal
from idempotency_mw.client.journals import NOTE_HEADER
from idempotency_mw.operator.panel import panel
from idempotency_mw.stores.sql import async_url
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.records import ClaimOutcome, RecordStatus
from tests.conftest import _missing, require_redis_server
from tests.support.client_support import BASE_URL, Server, sqlite_store_at
from tests.support.faults import free_port
from tests.support.redis_servers import start_server, stop_servers

pytestmark = pytest.mark.anyio

HOUR = 3600.0
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id": 1}')
#: Where the browser test also leaves its screenshots, when set (the docs' images).
SCREENSHOTS = os.environ.get("IDEMPOTENCY_PANEL_SCREENSHOTS")
#: The operator's secret of the panels with actions, the same in every worker.
SECRET = "the operators' panel secret"


async def stuck(store: Any, key: str, *, scope: str = "") -> None:
    """A claim whose worker died: its lease lapses, its TTL does not."""
    made = await store.claim(scope, key, f"hash-{key}", ttl=HOUR, lease=0.05)
    assert made.outcome is ClaimOutcome.ACQUIRED
    await asyncio.sleep(0.1)


async def completed(store: Any, key: str, *, scope: str = "") -> None:
    made = await store.claim(scope, key, f"hash-{key}", ttl=HOUR, lease=HOUR)
    assert made.token is not None
    assert await store.complete(scope, key, made.token, RESPONSE, ttl=HOUR)


def needing_a_person(journal: SQLiteJournal, key: str, name: str, *, url: str) -> JournalEntry:
    """An operation a saga gave up on, as an older version journaled it: with its
    credential in clear (read back, it is withheld)."""
    entry = JournalEntry(key=key, name=name, ref=f"ref-{name}", state=OperationState.PENDING)
    journal.add(entry)
    held = JournalEntry(
        key=key,
        name=name,
        ref=f"ref-{name}",
        state=OperationState.NEEDS_INTERVENTION,
        method="POST",
        url=url,
        headers=(("authorization", "Bearer s3cret"), ("content-type", "application/json")),
        body=b'{"title": "refund order 9"}',
        status=503,
        first_sent_at=time.time() - 60,
        response_headers=(("content-type", "text/plain"),),
        response_body=b"upstream unavailable",
    )
    journal.save(held)
    return held


def links(page: str, pattern: str) -> list[str]:
    return [html.unescape(found) for found in re.findall(rf'href="([^"]*{pattern}[^"]*)"', page)]


def form_of(page: str) -> dict[str, str]:
    """The hidden fields of the page's confirmation form."""
    fields = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', page)
    return {name: html.unescape(value) for name, value in fields}


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[SQLiteJournal]:
    made = SQLiteJournal(tmp_path / "journal.sqlite3")
    yield made
    made.close()


def http_on(app: Any) -> httpx.AsyncClient:
    """The panel mounted under /ops of a service, as a user would mount it."""
    service = Starlette(routes=[Mount("/ops", app)])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=service), base_url="http://ops.test")


# --- the rules, in process ----------------------------------------------------------------------


async def test_what_a_caller_chose_is_shown_as_text_never_as_markup() -> None:
    store = MemoryStore()
    hostile = "<script>alert(1)</script>"
    await stuck(store, hostile, scope="<b>scope</b>")
    async with http_on(panel(store, actions=True, secret=SECRET)) as http:
        page = (await http.get("/ops/")).text
    assert hostile not in page
    assert "<b>scope</b>" not in page
    assert html.escape(hostile) in page
    assert html.escape("<b>scope</b>") in page


async def test_the_overview_shows_the_store_and_the_journal(journal: SQLiteJournal) -> None:
    store = MemoryStore()
    await stuck(store, "order-17", scope="alice")
    await store.claim("", "order-18", "hash", ttl=HOUR, lease=HOUR)  # held, not stuck
    await completed(store, "order-19")
    needing_a_person(journal, "k-refund", "refund", url="http://api.test/refunds")
    async with http_on(panel(store, journal=journal)) as http:
        answer = await http.get("/ops/")
        page = answer.text
        assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
        assert answer.headers["x-frame-options"] == "DENY"
        (stuck_part,) = re.findall(r"Stuck in progress.*?</section>", page, re.S)
        assert "order-17" in stuck_part
        assert "order-18" not in stuck_part
        assert "read-only" in page
        assert "Release" not in page  # no action without actions=True
        assert ">refund<" in page
        done = (await http.get("/ops/", params={"status": "completed"})).text
        assert "order-19" in done
        assert "201, 9 bytes" in done
        (operation,) = links(page, "/operations/")
        shown = (await http.get(operation)).text
        assert "refund order 9" in shown  # its request
        assert "upstream unavailable" in shown  # its last answer
        assert "HTTP 503" in shown
        assert "s3cret" not in shown  # credentials are never shown
        assert "Sent with authorization from the client" in shown
        assert "Mark failed" not in shown


async def test_each_tile_says_what_it_counts_in_words_no_other_tile_uses() -> None:
    store = MemoryStore()
    await completed(store, "order-19")
    async with http_on(panel(store)) as http:
        page = (await http.get("/ops/")).text
    labels = re.findall(r'<div class="tile"><b>[^<]*</b><span>([^<]*)</span>', page)
    assert labels == [
        "in progress",
        "completed, answer recorded",
        "ran, answer too large to record",
        "took effect, no answer recorded",
        "of these, proved by fence()",
        "expired, awaiting the purge",
    ]
    assert [label for label in labels if "committed" in label] == []
    # Why the fence() tile may count more than "completed": it counts across the statuses.
    assert "is counted under\nits status too" in page


async def test_an_operation_says_why_it_waits_and_what_it_was_answered(
    journal: SQLiteJournal,
) -> None:
    journal.add(JournalEntry(key="k-lost", name="lost", ref="L-1", state=OperationState.PENDING))
    journal.save(
        JournalEntry(
            key="k-lost",
            name="lost",
            ref="L-1",
            state=OperationState.NEEDS_CONFIRMATION,
            method="POST",
            url="http://api.test/payments",
            body=b"{}",
            keyless=True,
            first_sent_at=time.time() - 60,
        )
    )
    needing_a_person(journal, "k-refund", "refund", url="http://api.test/refunds")
    async with http_on(panel(MemoryStore(), journal=journal)) as http:
        pages = {}
        for operation in links((await http.get("/ops/")).text, "/operations/"):
            page = (await http.get(operation)).text
            pages[re.findall(r"<h1>Operation (\w+)</h1>", page)[0]] = page
    lost, refund = pages["lost"], pages["refund"]
    assert (
        "Why a person: its outcome is unknown and the server does not understand keys, so the "
        "client will not send it again blindly" in lost
    )
    assert "None: no attempt was answered." in lost
    assert ">none<" not in lost.split("Last answer")[1]
    assert "Why a person: a saga gave up on it" in refund
    assert "HTTP 503" in refund
    assert "upstream unavailable" in refund


async def test_what_the_store_and_the_journal_hold_is_shown_as_text(
    journal: SQLiteJournal,
) -> None:
    markup = "<script>alert(1)</script>"
    store = MemoryStore()
    await stuck(store, markup, scope=f'"{markup}')
    needing_a_person(journal, "k-markup", markup, url=f"http://api.test/{markup}")
    async with http_on(panel(store, journal=journal, actions=True, secret=SECRET)) as http:
        pages = [(await http.get("/ops/")).text]
        (operation,) = links(pages[0], "/operations/")
        pages.append((await http.get(operation)).text)
        (confirm,) = links(pages[0], "/release")
        pages.append((await http.get(confirm)).text)
    for page in pages:
        assert "<script" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


async def test_a_release_runs_only_once_confirmed_on_its_page() -> None:
    store = MemoryStore()
    await stuck(store, "order-17")
    async with http_on(panel(store, actions=True, secret=SECRET)) as http:
        (confirm,) = links((await http.get("/ops/")).text, "/release")
        page = (await http.get(confirm)).text
        assert "Release this key?" in page
        fields = form_of(page)
        # Without the page's proof (another site's form, a hand-made request): refused.
        forged = {**fields, "proof": "0" * 64, "decision": "yes"}
        refused = await http.post("/ops/release", data=forged)
        assert refused.status_code == 403
        assert "nothing changed" in refused.text
        # Declined on the page: nothing changed.
        declined = await http.post("/ops/release", data={**fields, "decision": "no"})
        assert (declined.status_code, "Cancelled" in declined.text) == (200, True)
        record = await store.find_record(store.record_ref("", "order-17"))
        assert record is not None
        assert record.stuck
        done = await http.post("/ops/release", data={**fields, "decision": "yes"})
        assert done.status_code == 200
        assert "Released" in done.text
    assert await store.find_record(store.record_ref("", "order-17")) is None
    again = await store.claim("", "order-17", "hash-order-17", ttl=HOUR, lease=HOUR)
    assert again.outcome is ClaimOutcome.ACQUIRED


async def test_a_page_one_worker_served_is_accepted_by_another(tmp_path: Path) -> None:
    # Two workers: a store of each over one database, a panel of each, the operator's secret.
    first, second = [await sqlite_store_at(tmp_path / "idempotency.db") for _ in range(2)]
    await stuck(first, "order-17")
    async with http_on(panel(first, actions=True, secret=SECRET)) as http:
        (confirm,) = links((await http.get("/ops/")).text, "/release")
        fields = form_of((await http.get(confirm)).text)
    async with http_on(panel(second, actions=True, secret="another panel's secret")) as http:
        other = await http.post("/ops/release", data={**fields, "decision": "yes"})
    async with http_on(panel(second, actions=True, secret=SECRET.encode())) as http:
        done = await http.post("/ops/release", data={**fields, "decision": "yes"})
    gone = await second.find_record(second.record_ref("", "order-17"))
    for store in (first, second):
        await store.aclose()
    assert other.status_code == 403  # a proof made with another secret proves nothing
    assert (done.status_code, "Released" in done.text) == (200, True)
    assert gone is None


async def test_a_key_whose_effect_was_committed_is_never_offered_for_release(
    tmp_path: Path,
) -> None:
    # As the CLI refuses it up front: a release would let a retry run the effect again.
    url = f"sqlite:///{tmp_path / 'idempotency.db'}"
    store = await sqlite_store_at(tmp_path / "idempotency.db")
    fenced = await store.claim("", "order-17", "hash-order-17", ttl=HOUR, lease=0.05)
    assert fenced.token is not None
    statement, params = store.fence_statement("", "order-17", fenced.token, HOUR)
    engine = create_async_engine(async_url(url))
    async with engine.begin() as conn:
        await conn.execute(statement, params)
    await engine.dispose()
    await stuck(store, "order-23")
    record = await store.find_record(store.record_ref("", "order-17"))
    assert record is not None
    assert (record.stuck, record.fenced) == (True, True)
    async with http_on(panel(store, actions=True, secret=SECRET)) as http:
        page = (await http.get("/ops/")).text
        (stuck_part,) = re.findall(r'id="stuck">.*?</section>', page, re.S)
        (committed,) = [
            row for row in re.findall(r"<tr>.*?</tr>", stuck_part, re.S) if "order-17" in row
        ]
        assert "/release" not in committed
        # Where the button would be, what the operator can do instead.
        assert "Nothing to do: its effect committed, and retries are told so (409)" in committed
        assert "idempotency-mw release --force" in committed
        assert len(links(page, "/release")) == 1  # order-23's, stuck before its effect
        query = urlencode({"ref": record.ref, "version": record.version})
        refused = await http.get(f"/ops/release?{query}")
    await store.aclose()
    assert refused.status_code == 409
    assert "effect was committed" in refused.text
    assert "Release this key?" not in refused.text


async def test_a_release_of_a_record_that_changed_meanwhile_changes_nothing() -> None:
    store = MemoryStore()
    await stuck(store, "order-17")
    async with http_on(panel(store, actions=True, secret=SECRET)) as http:
        (confirm,) = links((await http.get("/ops/")).text, "/release")
        fields = form_of((await http.get(confirm)).text)
        retry = await store.claim("", "order-17", "hash-order-17", ttl=HOUR, lease=HOUR)
        assert retry.token is not None  # a retry took the key over meanwhile
        answer = await http.post("/ops/release", data={**fields, "decision": "yes"})
        assert answer.status_code == 409
        assert "changed since" in answer.text
    record = await store.find_record(store.record_ref("", "order-17"))
    assert record is not None
    assert (record.status, record.stuck) == (RecordStatus.IN_PROGRESS, False)


async def test_a_read_only_panel_refuses_every_action(journal: SQLiteJournal) -> None:
    store = MemoryStore()
    await stuck(store, "order-17")
    needing_a_person(journal, "k-refund", "refund", url="http://api.test/refunds")
    # A read-only panel refuses even a form that a panel with actions proved.
    async with http_on(panel(store, actions=True, secret=SECRET)) as http:
        (confirm,) = links((await http.get("/ops/")).text, "/release")
        fields = form_of((await http.get(confirm)).text)
    async with http_on(panel(store, journal=journal)) as http:
        page = (await http.get(confirm)).text
        assert "read-only" in page
        assert "<form" not in page
        answer = await http.post("/ops/release", data={**fields, "decision": "yes"})
        assert answer.status_code == 403
        (operation,) = links((await http.get("/ops/")).text, "/operations/")
        marked = await http.post(f"{operation}/failed", data={"decision": "yes", "note": "x"})
        assert marked.status_code == 403
    record = await store.find_record(store.record_ref("", "order-17"))
    assert record is not None
    entry = journal.get("k-refund")
    assert entry is not None
    assert entry.state is OperationState.NEEDS_INTERVENTION


async def test_marking_an_operation_journals_the_note(journal: SQLiteJournal) -> None:
    needing_a_person(journal, "k-refund", "refund", url="http://api.test/refunds")
    async with http_on(panel(MemoryStore(), journal=journal, actions=True, secret=SECRET)) as http:
        (operation,) = links((await http.get("/ops/")).text, "/operations/")
        page = (await http.get(operation)).text
        assert "Retry now" not in page  # no client to send with
        (mark,) = links(page, "/failed")
        fields = form_of((await http.get(mark)).text)
        no_note = await http.post(mark, data={**fields, "decision": "yes", "note": " "})
        assert (no_note.status_code, "A note is required" in no_note.text) == (400, True)
        assert journal.get("k-refund").state is OperationState.NEEDS_INTERVENTION  # type: ignore[union-attr]
        note = "refunded by hand in the\nbilling console, ticket 4411"
        done = await http.post(mark, data={**fields, "decision": "yes", "note": note})
        assert done.status_code == 200
        assert "Marked failed" in done.text
        assert "No operation needs attention" in (await http.get("/ops/")).text
    entry = journal.get("k-refund")
    assert entry is not None
    assert entry.state is OperationState.FAILED
    assert (NOTE_HEADER, "refunded by hand in the billing console, ticket 4411") in (
        entry.response_headers
    )
    assert entry.body == b'{"title": "refund order 9"}'  # the request stays as it was


async def test_retry_now_sends_the_operation_with_the_client(
    journal: SQLiteJournal, server: Server
) -> None:
    needing_a_person(journal, "k-ticket", "ticket", url=f"{BASE_URL}/tickets")
    transport = httpx.ASGITransport(app=server.app)
    async with (
        httpx.AsyncClient(
            transport=transport, base_url=BASE_URL, headers={"Authorization": "Bearer s3cret"}
        ) as to_api,
        IdempotentClient(http=to_api, journal=journal) as client,
        http_on(
            panel(MemoryStore(), journal=journal, client=client, actions=True, secret=SECRET)
        ) as http,
    ):
        (operation,) = links((await http.get("/ops/")).text, "/operations/")
        (retry,) = links((await http.get(operation)).text, "/retry")
        fields = form_of((await http.get(retry)).text)
        done = await http.post(retry, data={**fields, "decision": "yes"})
        assert done.status_code == 200
        assert "HTTP 201" in done.text
    assert server.calls["tickets"] == 1
    entry = journal.get("k-ticket")
    assert entry is not None
    assert (entry.state, entry.status) == (OperationState.CONFIRMED, 201)


@pytest.mark.parametrize(
    ("method", "path", "data", "status"),
    [
        ("GET", "/ops/?status=nonsense", None, 400),
        ("GET", "/ops/release?ref=nonsense&version=1", None, 400),
        ("GET", "/ops/release", None, 400),
        ("GET", "/ops/operations/abc", None, 404),
        ("GET", "/ops/operations/abc/explode", None, 404),
        ("POST", "/ops/release", {"ref": "x"}, 400),
        ("POST", "/ops/release", {"ref": "x", "version": "v", "note": "n" * 20000}, 413),
        ("POST", "/ops/release", b"\xff\xfe", 400),
    ],
)
async def test_bad_input_is_a_clear_page_never_a_500(
    method: str, path: str, data: Any, status: int
) -> None:
    async with http_on(panel(MemoryStore(), actions=True, secret=SECRET)) as http:
        if isinstance(data, bytes):
            answer = await http.request(method, path, content=data)
        else:
            answer = await http.request(method, path, data=data)
    assert answer.status_code == status
    assert "Nothing changed" in answer.text or "nothing changed" in answer.text.lower()


def test_a_store_it_cannot_inspect_a_bad_limit_or_no_secret_is_refused_at_once() -> None:
    from idempotency_mw.values.exceptions import ConfigurationError

    class Opaque(MemoryStore):
        find_record = None  # type: ignore[assignment]

    with pytest.raises(ConfigurationError, match="a store it can inspect"):
        panel(Opaque())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="limit"):
        panel(MemoryStore(), limit=0)
    for secret in (None, "", "too short"):
        with pytest.raises(ConfigurationError, match=r"actions=True\) needs secret="):
            panel(MemoryStore(), actions=True, secret=secret)


def test_without_jinja2_the_panel_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "jinja2", None)  # as if it were not installed
    with pytest.raises(ModuleNotFoundError, match=r"needs jinja2: install the \[panel\] extra"):
        panel(MemoryStore())


async def test_the_overview_shows_the_settings_that_can_lose_records(tmp_path: Path) -> None:
    require_redis_server()
    node = start_server(tmp_path / "redis", free_port(), "--maxmemory-policy", "volatile-lru")
    store = RedisStore(f"redis://127.0.0.1:{node.port}/0")
    try:
        async with http_on(panel(store)) as http:
            page = (await http.get("/ops/")).text
    finally:
        await store.aclose()
        stop_servers([node], tmp_path / "redis")
    (part,) = re.findall(r"Settings that can lose records.*?</section>", page, re.S)
    assert "<code>maxmemory-policy</code> is volatile-lru" in part
    assert "appendonly" in part  # the server was started without persistence too
    async with http_on(panel(MemoryStore())) as http:
        assert "Settings that can lose records" not in (await http.get("/ops/")).text


async def test_a_store_that_fails_is_a_503_page() -> None:
    store = RedisStore("redis://127.0.0.1:1/0", socket_timeout=1)
    async with http_on(panel(store)) as http:
        answer = await http.get("/ops/")
    await store.aclose()
    assert answer.status_code == 503
    assert "The store failed" in answer.text


async def test_a_journal_that_fails_is_a_503_page() -> None:
    from idempotency_mw.client import SQLJournal

    journal = SQLJournal("postgresql://app@127.0.0.1:1/app")  # nothing listens there
    try:
        async with http_on(panel(MemoryStore(), journal=journal)) as http:
            answer = await http.get("/ops/")
    finally:
        journal.close()
    assert answer.status_code == 503
    assert "The journal failed" in answer.text


# --- in a real browser --------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Headless Chromium driven by selenium, with a profile of its own."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        _missing("the panel's browser test needs Debian's chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
async def records(tmp_path: Path) -> AsyncIterator[tuple[str, SQLStore]]:
    """A SQLite store with real records: two stuck keys, one held, two completed."""
    store = await sqlite_store_at(tmp_path / "idem.db")
    await stuck(store, "order-17", scope="tenant-a")
    await stuck(store, "order-23")
    await store.claim("", "order-31", "hash", ttl=HOUR, lease=HOUR)
    await completed(store, "order-5")
    await completed(store, "order-6", scope="tenant-a")
    yield f"sqlite:///{tmp_path / 'idem.db'}", store
    await store.aclose()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Any]:
    """`idempotency-mw panel` in processes of their own; each call serves one, on a free port."""
    running: list[subprocess.Popen[bytes]] = []

    def serve(*args: str) -> str:
        port = free_port()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "idempotency_mw.operator.cli",
                "panel",
                *args,
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        running.append(process)
        base = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                if httpx.get(base, timeout=2).status_code == 200:
                    return base
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError("the panel did not answer within 30 s")

    yield serve
    for process in running:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout:
            process.stdout.close()


def click_and_see(browser: Any, element: Any, text: str) -> None:
    """Click ``element`` and wait for the page that shows ``text``."""
    from selenium.webdriver.support.ui import WebDriverWait

    element.click()
    WebDriverWait(browser, 15).until(lambda driver: text in driver.page_source)


def shot(browser: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    browser.save_screenshot(str(path))
    if SCREENSHOTS:
        shutil.copy(path, Path(SCREENSHOTS) / f"{name}.png")


async def test_the_panel_in_a_browser(
    browser: Any,
    records: tuple[str, SQLStore],
    served: Any,
    journal: SQLiteJournal,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    url, store = records
    needing_a_person(journal, "k-refund", "refund", url="http://api.test/refunds")
    journal_path = str(tmp_path / "journal.sqlite3")

    async def held(key: str, scope: str = "") -> bool:
        return await store.find_record(store.record_ref(scope, key)) is not None

    # Read-only: the lists show what the store holds, and no action is offered.
    read_only = await asyncio.to_thread(served, "--store", url, "--journal", journal_path)
    browser.get(read_only)
    stuck_rows = browser.find_element(By.ID, "stuck").text
    assert "order-17" in stuck_rows
    assert "order-23" in stuck_rows
    assert "order-31" not in stuck_rows  # held within its lease
    assert "read-only" in browser.find_element(By.TAG_NAME, "header").text
    assert not browser.find_elements(By.LINK_TEXT, "Release…")
    click_and_see(browser, browser.find_element(By.LINK_TEXT, "completed"), "Records: completed")
    listed = browser.find_element(By.ID, "records").text
    assert "order-5" in listed
    assert "order-6" in listed
    assert "refund" in browser.find_element(By.ID, "attention").text

    # With actions: declining the confirmation changes nothing; confirming releases the key.
    actions = await asyncio.to_thread(
        served, "--store", url, "--journal", journal_path, "--actions"
    )
    browser.get(actions)
    browser.set_window_size(1280, 1500)  # the whole overview in one picture
    shot(browser, tmp_path, "panel-overview")
    browser.set_window_size(1280, 900)
    row = browser.find_element(By.XPATH, "//section[@id='stuck']//tr[contains(., 'order-23')]")
    click_and_see(browser, row.find_element(By.LINK_TEXT, "Release…"), "Release this key?")
    shot(browser, tmp_path, "panel-confirm-release")
    no = browser.find_element(By.XPATH, "//button[@value='no']")
    click_and_see(browser, no, "Cancelled: nothing changed.")
    assert await held("order-23")
    browser.get(actions)
    row = browser.find_element(By.XPATH, "//section[@id='stuck']//tr[contains(., 'order-23')]")
    click_and_see(browser, row.find_element(By.LINK_TEXT, "Release…"), "Release this key?")
    yes = browser.find_element(By.XPATH, "//button[@value='yes']")
    click_and_see(browser, yes, "Released: the key")
    assert not await held("order-23")
    assert await held("order-17", "tenant-a")
    browser.get(actions)
    assert "order-23" not in browser.find_element(By.ID, "stuck").text

    # An operation that needs a person: its request and last answer; marked with a note.
    opened = browser.find_element(By.XPATH, "//section[@id='attention']//a[text()='open']")
    click_and_see(browser, opened, "refund order 9")
    assert "upstream unavailable" in browser.page_source
    shot(browser, tmp_path, "panel-operation")
    click_and_see(browser, browser.find_element(By.LINK_TEXT, "Mark confirmed"), 'id="note"')
    browser.find_element(By.ID, "note").send_keys("refunded by hand, ticket 4411")
    shot(browser, tmp_path, "panel-confirm-mark")
    click_and_see(browser, browser.find_element(By.XPATH, "//button[@value='yes']"), "Marked")
    assert "Marked confirmed" in browser.page_source
    entry = journal.get("k-refund")
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED
    assert (NOTE_HEADER, "refunded by hand, ticket 4411") in entry.response_headers
