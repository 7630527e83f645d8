"""Sagas: several operations that go forward together, or are compensated in reverse order.

Every step and every compensation is an operation whose key follows from the saga's name, its
``ref`` and the step's name, so running the same saga again (after a crash, in another
process) finds them in the journal: what is settled there is not sent again. Like the clients,
the saga's logic is one generator of the protocol's effects; :class:`Saga` and
:class:`SyncSaga` run it on their client's interpreter (:meth:`IdempotentClient.perform`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeAlias, TypeVar, Unpack

import httpx

from idempotency_mw.client.async_client import IdempotentClient
from idempotency_mw.client.errors import (
    CredentialsMissing,
    IdempotencyCredentialMismatch,
    IdempotencyKeyMismatch,
    NeedsConfirmation,
    NotSent,
    OperationError,
    OutcomeUnknown,
    ResponseNotReplayable,
)
from idempotency_mw.client.protocol import Call, Protocol, Sleep, Steps, check_name
from idempotency_mw.client.sync_client import SyncIdempotentClient
from idempotency_mw.client.values import Operation, OperationState, RequestParts
from idempotency_mw.values.exceptions import ConfigurationError

R = TypeVar("R")
H = TypeVar("H")

_NAME = re.compile(r"[A-Za-z0-9_-]+")
DEFAULT_SAGA_DEADLINE = timedelta(minutes=5)


class SagaState(enum.StrEnum):
    """How a saga ended."""

    COMPLETED = "completed"  # every step took effect
    COMPENSATED = "compensated"  # a step failed; the steps before it were compensated
    NEEDS_INTERVENTION = "needs_intervention"  # stopped: see attention() and the CLI


class StepState(enum.StrEnum):
    """Where one step of a saga stands."""

    NOT_RUN = "not_run"
    COMPLETED = "completed"  # took effect (and was not compensated)
    FAILED = "failed"  # refused by a final 4xx (not compensated), or never sent
    UNKNOWN = "unknown"  # could not be settled by the deadline: a person has to look
    COMPENSATED = "compensated"  # took effect, then its compensation did
    COMPENSATION_FAILED = "compensation_failed"  # its compensation kept failing: a person


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """One step's state, its response and its compensation's (when they have one).

    A step that took effect without a response available (``ResponseNotReplayable``) has the
    server's problem answer as its response.
    """

    name: str
    state: StepState
    response: httpx.Response | None = None
    compensation: httpx.Response | None = None


@dataclass(frozen=True, slots=True)
class SagaOutcome:
    """How the saga ``name`` for ``ref`` ended, and each of its steps, in order."""

    name: str
    ref: str
    state: SagaState
    steps: tuple[StepOutcome, ...]

    def step(self, name: str) -> StepOutcome:
        """The outcome of the step ``name``."""
        for outcome in self.steps:
            if outcome.name == name:
                return outcome
        raise KeyError(name)


class StepClient(Generic[R, H]):
    """What a step or compensation sends its one request with: the client, bound to the
    step's operation (so the request goes under the step's key). ``http`` is for reads."""

    def __init__(self, send: Callable[..., R], operation: Operation, http: H) -> None:
        self._send = send
        self.operation = operation
        self.http = http

    @property
    def ref(self) -> str:
        """The saga's ref."""
        assert self.operation.ref is not None
        return self.operation.ref

    def send(
        self, method: str, url: str, *, keyless: bool = False, **parts: Unpack[RequestParts]
    ) -> R:
        """Send the step's request (see :meth:`IdempotentClient.send`)."""
        return self._send(self.operation, method, url, keyless=keyless, **parts)

    def post(self, url: str, *, keyless: bool = False, **parts: Unpack[RequestParts]) -> R:
        """Send the step's request as a POST."""
        return self.send("POST", url, keyless=keyless, **parts)

    def delete(self, url: str, *, keyless: bool = False, **parts: Unpack[RequestParts]) -> R:
        """Send the step's request as a DELETE."""
        return self.send("DELETE", url, keyless=keyless, **parts)


AsyncStepClient: TypeAlias = StepClient[Awaitable[httpx.Response], httpx.AsyncClient]
SyncStepClient: TypeAlias = StepClient[httpx.Response, httpx.Client]
AsyncAction: TypeAlias = Callable[[AsyncStepClient], Awaitable[httpx.Response]]
AsyncCompensation: TypeAlias = Callable[
    [AsyncStepClient, httpx.Response], Awaitable[httpx.Response]
]
SyncAction: TypeAlias = Callable[[SyncStepClient], httpx.Response]
SyncCompensation: TypeAlias = Callable[[SyncStepClient, httpx.Response], httpx.Response]


@dataclass(frozen=True, slots=True)
class _Step:
    name: str
    action: Callable[..., Any]
    compensate: Callable[..., Any] | None


_Result: TypeAlias = httpx.Response | OperationError


@dataclass(frozen=True, slots=True)
class _Plan:
    name: str
    ref: str
    steps: tuple[_Step, ...]
    deadline: float
    protocol: Protocol
    #: The step client of an operation, sending through the saga's client.
    step_client: Callable[[Operation], StepClient[Any, Any]]


def _saga(plan: _Plan) -> Steps[SagaOutcome]:
    """Run (or resume) the saga: forward while steps take effect, then, from the first step
    refused (or never sent), compensate the steps before it in reverse."""
    outcomes = [StepOutcome(step.name, StepState.NOT_RUN) for step in plan.steps]

    def ended(state: SagaState) -> SagaOutcome:
        return SagaOutcome(plan.name, plan.ref, state, tuple(outcomes))

    failed = False
    for index, step in enumerate(plan.steps):
        result = yield from _settle(plan, f"{plan.name}.{step.name}", step.action, (), forward=True)
        if isinstance(result, OutcomeUnknown):
            outcomes[index] = StepOutcome(step.name, StepState.UNKNOWN)
            return ended(SagaState.NEEDS_INTERVENTION)
        if _took_effect(result):
            outcomes[index] = StepOutcome(step.name, StepState.COMPLETED, _response(result))
            continue
        outcomes[index] = StepOutcome(step.name, StepState.FAILED, _response(result))
        failed = True
        break
    if not failed:
        return ended(SagaState.COMPLETED)
    for index in reversed(range(len(outcomes))):
        step, done = plan.steps[index], outcomes[index]
        if done.state is not StepState.COMPLETED or step.compensate is None:
            continue
        name = f"{plan.name}.{step.name}.undo"
        result = yield from _settle(plan, name, step.compensate, (done.response,), forward=False)
        if _took_effect(result):
            outcomes[index] = StepOutcome(
                step.name, StepState.COMPENSATED, done.response, _response(result)
            )
            continue
        outcomes[index] = StepOutcome(
            step.name, StepState.COMPENSATION_FAILED, done.response, _response(result)
        )
        yield from _hand_over(plan, name, result)
        return ended(SagaState.NEEDS_INTERVENTION)
    return ended(SagaState.COMPENSATED)


def _settle(
    plan: _Plan, name: str, call: Callable[..., Any], args: tuple[Any, ...], *, forward: bool
) -> Steps[_Result]:
    """The outcome of the operation ``name``, tried again with backoff until the saga's
    deadline while it is unknown (or, for a compensation, not sent). A step whose outcome is
    still unknown then is journaled ``needs_intervention``: it is never compensated unconfirmed.
    """
    protocol = plan.protocol
    until = protocol.clock() + plan.deadline
    tries = 0
    while True:
        stored = yield from protocol.derived(name, plan.ref)
        result: _Result
        if stored.state is OperationState.FAILED and stored.response_body is None:
            result = NotSent("it never left the caller", stored.key)
        elif stored.method is not None:  # its request is journaled: settle that one
            try:
                result = yield from protocol.exchange(stored)
            except OperationError as exc:
                result = exc
        else:
            result = yield Call(call, (plan.step_client(stored.operation), *args))
        # A caller's bug, or its credentials missing: nothing to compensate, a person fixes it.
        if isinstance(
            result, IdempotencyKeyMismatch | IdempotencyCredentialMismatch | CredentialsMissing
        ):
            raise result
        retry = isinstance(result, OutcomeUnknown) or (not forward and isinstance(result, NotSent))
        if not retry or isinstance(result, NeedsConfirmation) or protocol.clock() >= until:
            if forward and isinstance(result, OutcomeUnknown):
                yield from _hand_over(plan, name, result)
            return result
        tries += 1
        left = max(until - protocol.clock(), 0.0)
        yield Sleep(min(protocol.policy.backoff(tries, protocol.rng), left))


def _hand_over(plan: _Plan, name: str, result: _Result) -> Steps[None]:
    """Journal the operation ``name`` for a person, unless it waits for a probe already."""
    if not isinstance(result, NeedsConfirmation):
        stored = yield from plan.protocol.derived(name, plan.ref)
        yield from plan.protocol.mark(stored.key, OperationState.NEEDS_INTERVENTION)


def _took_effect(result: _Result) -> bool:
    if isinstance(result, httpx.Response):
        return result.status_code < 400
    return isinstance(result, ResponseNotReplayable)


def _response(result: _Result) -> httpx.Response | None:
    return result if isinstance(result, httpx.Response) else result.response


class _Builder:
    """Steps added in order; the plan they make."""

    def __init__(self, name: str, ref: str, deadline: timedelta) -> None:
        if not _NAME.fullmatch(name):
            raise ConfigurationError(f"saga names must match {_NAME.pattern}: {name!r}")
        if deadline <= timedelta(0):
            raise ConfigurationError("deadline must be positive")
        self.name = name
        self.ref = ref
        self.deadline = deadline.total_seconds()
        self._steps: list[_Step] = []

    def _add(self, name: str, action: Callable[..., Any], compensate: Any) -> None:
        if not _NAME.fullmatch(name):
            raise ConfigurationError(f"step names must match {_NAME.pattern}: {name!r}")
        if any(step.name == name for step in self._steps):
            raise ConfigurationError(f"the saga {self.name!r} has a step {name!r} already")
        check_name(f"{self.name}.{name}.undo")
        self._steps.append(_Step(name, action, compensate))

    def _plan(
        self, protocol: Protocol, step_client: Callable[[Operation], StepClient[Any, Any]]
    ) -> _Plan:
        if not self._steps:
            raise ConfigurationError(f"the saga {self.name!r} has no steps")
        return _Plan(self.name, self.ref, tuple(self._steps), self.deadline, protocol, step_client)


class Saga(_Builder):
    """Steps run in order through ``client``; when one fails, the ones before it are
    compensated in reverse order.

    ``saga.step(name, action, compensate=undo)``: ``action(step)`` sends the step's one request
    with ``step`` (an :class:`AsyncStepClient`) and returns its response; ``undo(step,
    response)`` sends the compensation's. :meth:`run` returns a :class:`SagaOutcome`:
    ``completed``, ``compensated``, or ``needs_intervention`` when a step's outcome stays
    unknown or a compensation keeps failing until ``deadline`` (default 5 minutes): that
    operation is then journaled ``needs_intervention`` and listed by ``client.attention()``.
    """

    def __init__(
        self,
        client: IdempotentClient,
        name: str,
        *,
        ref: str,
        deadline: timedelta = DEFAULT_SAGA_DEADLINE,
    ) -> None:
        super().__init__(name, ref, deadline)
        self._client = client

    def step(
        self, name: str, action: AsyncAction, *, compensate: AsyncCompensation | None = None
    ) -> Saga:
        """Add the step ``name`` (``[A-Za-z0-9_-]``) after the others."""
        self._add(name, action, compensate)
        return self

    async def run(self) -> SagaOutcome:
        """Run the saga, or resume it from the journal: settled operations are not sent
        again, and a step left unknown is settled before the saga goes on or back."""
        client = self._client

        def step_client(operation: Operation) -> AsyncStepClient:
            return StepClient(client.send, operation, client.http)

        return await client.perform(_saga(self._plan(client.protocol, step_client)))


class SyncSaga(_Builder):
    """The blocking twin of :class:`Saga`, on a :class:`SyncIdempotentClient`."""

    def __init__(
        self,
        client: SyncIdempotentClient,
        name: str,
        *,
        ref: str,
        deadline: timedelta = DEFAULT_SAGA_DEADLINE,
    ) -> None:
        super().__init__(name, ref, deadline)
        self._client = client

    def step(
        self, name: str, action: SyncAction, *, compensate: SyncCompensation | None = None
    ) -> SyncSaga:
        """See :meth:`Saga.step`."""
        self._add(name, action, compensate)
        return self

    def run(self) -> SagaOutcome:
        """See :meth:`Saga.run`."""
        client = self._client

        def step_client(operation: Operation) -> SyncStepClient:
            return StepClient(client.send, operation, client.http)

        return client.perform(_saga(self._plan(client.protocol, step_client)))
