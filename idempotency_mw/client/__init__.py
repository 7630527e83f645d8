"""The caller's half: httpx clients that send each operation under one ``Idempotency-Key``.

An operation gets its key when it is decided (:meth:`IdempotentClient.operation`); every
attempt, retry, restart and :meth:`~IdempotentClient.reconcile` re-sends it with that same key,
so the server runs it at most once. Operations, their states and final responses are journaled
(a local SQLite file by default; :class:`SQLJournal` and :class:`RedisJournal` keep them in a
database or Redis that several processes share) so that a caller that crashes resumes them
after a restart, and a settled operation is never sent again. :class:`Saga` runs several
operations forward together or compensates them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from idempotency_mw.client.async_client import AsyncProbe, IdempotentClient
from idempotency_mw.client.attention import AttentionRow, attention_rows
from idempotency_mw.client.classify import Verdict, classify, retry_after
from idempotency_mw.client.errors import (
    CommittedWithoutResponse,
    CredentialsMissing,
    IdempotencyCredentialMismatch,
    IdempotencyKeyMismatch,
    NeedsConfirmation,
    NotSent,
    OperationError,
    OutcomeUnknown,
    ResponseNotReplayable,
)
from idempotency_mw.client.events import ClientEvent, ClientEventHook, ClientMetrics
from idempotency_mw.client.journals import (
    DEFAULT_JOURNAL_PATH,
    Journal,
    SQLiteJournal,
    SQLJournal,
    journal_table,
    open_journal,
    sync_url,
)
from idempotency_mw.client.protocol import DEFAULT_LEASE, DEFAULT_RETENTION, Protocol
from idempotency_mw.client.saga import (
    AsyncAction,
    AsyncCompensation,
    AsyncStepClient,
    Saga,
    SagaOutcome,
    SagaState,
    StepClient,
    StepOutcome,
    StepState,
    SyncAction,
    SyncCompensation,
    SyncSaga,
    SyncStepClient,
)
from idempotency_mw.client.sync_client import SyncIdempotentClient, SyncProbe
from idempotency_mw.client.values import (
    JournalEntry,
    Operation,
    OperationState,
    RequestParts,
    RetryPolicy,
)
from idempotency_mw.wire.http import PROBLEM_TYPE_PREFIX

__all__ = [
    "DEFAULT_JOURNAL_PATH",
    "DEFAULT_LEASE",
    "DEFAULT_RETENTION",
    "PROBLEM_TYPE_PREFIX",
    "AsyncAction",
    "AsyncCompensation",
    "AsyncProbe",
    "AsyncStepClient",
    "AttentionRow",
    "ClientEvent",
    "ClientEventHook",
    "ClientMetrics",
    "CommittedWithoutResponse",
    "CredentialsMissing",
    "IdempotencyCredentialMismatch",
    "IdempotencyKeyMismatch",
    "IdempotentClient",
    "Journal",
    "JournalEntry",
    "NeedsConfirmation",
    "NotSent",
    "Operation",
    "OperationError",
    "OperationState",
    "OutcomeUnknown",
    "Protocol",
    "RedisJournal",
    "RequestParts",
    "ResponseNotReplayable",
    "RetryPolicy",
    "SQLJournal",
    "SQLiteJournal",
    "Saga",
    "SagaOutcome",
    "SagaState",
    "StepClient",
    "StepOutcome",
    "StepState",
    "SyncAction",
    "SyncCompensation",
    "SyncIdempotentClient",
    "SyncProbe",
    "SyncSaga",
    "SyncStepClient",
    "Verdict",
    "attention_rows",
    "classify",
    "journal_table",
    "open_journal",
    "retry_after",
    "sync_url",
]


if TYPE_CHECKING:
    from idempotency_mw.client.journals.redis import RedisJournal


def __getattr__(name: str) -> Any:
    # RedisJournal needs redis-py (the [redis] extra): imported only when asked for.
    if name == "RedisJournal":
        from idempotency_mw.client.journals.redis import RedisJournal

        return RedisJournal
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
