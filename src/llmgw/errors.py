"""The one exception tree of llmgw.

Every error llmgw raises on purpose is an :class:`LlmgwError`; library errors (httpx, aiohttp,
sqlite3, subprocess, yaml) are translated where they enter our code, with the cause chained. The
CLI turns an ``LlmgwError`` into ``Error: <message>`` and its ``exit_code``, never a traceback.

::

    LlmgwError                     exit 1
    ├── ConfigError                exit 2   a config file or flag is invalid (names file, field, rule)
    ├── PkiError                   exit 2   the cluster CA or a certificate is missing or unusable
    │   └── NodeRemoved            exit 0   the control plane revoked this agent's certificate (node removed)
    ├── SourceError                exit 2   a model source cannot become a download (sourcecheck)
    │   └── SourceRefused          exit 2   the mirror's policy refuses a source (names the flag allowing it)
    ├── ApiError                   exit 1   an llmgw HTTP API answered with an error (status, code): client side
    ├── HttpError                  exit 1   a handler refuses a request (status, code, message): server side
    │   ├── WaitedOut              exit 1   the gateway queue's 429 for a request refused after waiting
    │   └── JsonBodyError          exit 1   a request body is not bounded JSON (400/413); also a ValueError
    ├── UnreachableError           exit 3   an llmgw service does not answer at its address
    ├── GroupError                 exit 1   a node's part in a replica over several nodes cannot run
    │   └── GroupNetError          exit 1   a group's RPC network (tunnel, namespace) failed or refused a peer
    ├── MirrorError                exit 1   the mirror could not fetch or serve a file
    │   ├── SourceConflict         exit 1   a model/version already holds (or fetches) another source
    │   └── NoSpaceError           exit 1   too little disk for a file (bytes needed and free named)
    ├── EngineError                exit 1   an engine is missing, failed to start, or exited
    ├── EstimateError              exit 1   a GGUF header cannot be read for placement's estimate
    ├── JudgeError                 exit 1   a guard judge gave no verdict (``kind`` says why)
    ├── StoreError                 exit 1   the state database cannot be opened, migrated or reached
    │   ├── StoreUnavailable       exit 1   the database did not answer in time (HTTP 503)
    │   └── Fenced                 exit 1   a leader's write carried a term no longer current
    ├── Conflict                   exit 1   a store write lost a race or breaks uniqueness (HTTP 409)
    │   └── Revoked                exit 1   a heartbeat's certificate serial is on the deny-list
    ├── PortInUseError             exit 2   a listen port is already taken by another program
    ├── LockedError                exit 4   another process holds a lock (two inits at once)
    ├── ServiceError               exit 1   a service could not be started, stopped or read
    └── WaitTimeout                exit 5   a wait gave up at its deadline (run again to keep waiting)

Client and server side: :class:`ApiError` is what a client of an llmgw API (the CLI, the agent,
the mirror client) raises on an error answer; :class:`HttpError` is what a server's handler raises
to refuse a request. :mod:`llmgw.httperrors` turns it into the wire shape of its listener (OpenAI's
at the gateway, ``{"error": {"code", "message"}}`` at the admin, agent and mirror APIs).

Not in the tree, on purpose: exceptions private to one module's control flow
(``agent.replicas.runner._Failed``, ``mirror.download._Retry`` and ``_Busy``), and two that must be a
library's own type to work and are translated where they leave llmgw's code:
``mirror.download.RefusedConnection`` (an ``OSError``, so aiohttp reports a refused connect:
``mirror.refusing``'s connector raises it) and
``yamlsafe.DuplicateKeyError`` (a PyYAML ``ConstructorError``; its callers raise
:class:`ConfigError`).

Messages name the thing, the bad value, the rule, and the next step.
"""

from __future__ import annotations

import json
from typing import Any


class LlmgwError(Exception):
    """Base of every llmgw error; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ConfigError(LlmgwError):
    """A config file or flag is invalid; the message names the file, the field and what is allowed."""

    exit_code = 2


class PkiError(LlmgwError):
    """The cluster CA, a certificate or a key is missing or unusable."""

    exit_code = 2


class NodeRemoved(PkiError):
    """The control plane revoked this agent's certificate: the node was removed (``ctl node rm``).
    The message says how to re-join. The CLI exits 0 on it, so ``Restart=on-failure`` does not
    start a removed node's agent again and again."""

    exit_code = 0


class SourceError(LlmgwError):
    """A model source (``hf:``, ``https://``, ``file:``) cannot become a download."""

    exit_code = 2


class SourceRefused(SourceError):
    """The mirror's policy refuses a source (a file outside the import directories, a special
    file, a private address); the message says which flag would allow it."""


class ApiError(LlmgwError):
    """An llmgw API answered with an error.

    Attributes:
        status: the HTTP status (int).
        code: the error code from the ``{"error": {"code", "message"}}`` body, or ``""``.
    """

    def __init__(self, message: str, *, status: int, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class HttpError(LlmgwError):
    """Raised inside a server's request handler to refuse the request; the listener's middleware
    (:func:`llmgw.httperrors.error_middleware`) or handler answers it in its wire shape.

    Args:
        status: the HTTP status (4xx/5xx).
        code: a short ``snake_case`` reason, stable for clients (``model_not_found``).
        message: what was wrong and what to do, for the client.
        headers: extra response headers (``Retry-After``), or None.
    """

    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers


class WaitedOut(HttpError):
    """The gateway queue's 429 ``model_busy`` for a request refused after it waited for a slot (its
    wait reached the bound, or a request that ranks above it took its place), as opposed to one
    refused at once: its wait counts in ``llmgw_gateway_queue_wait_seconds`` like a served one's."""


class JsonBodyError(HttpError, ValueError):
    """A request body that is not acceptable JSON (:mod:`llmgw.jsonbody`); a ``ValueError`` too, so
    a handler that treats any unreadable body alike catches it with the rest.

    Attributes:
        status: 400 (not JSON, too deep, a number out of range) or 413 (too large).
        code: ``invalid_json``, ``json_too_deep`` or ``body_too_large``.
        message: what was wrong and the rule, for the client.
    """


class UnreachableError(LlmgwError):
    """An llmgw service does not answer at its address (connection refused, timeout, TLS failure)."""

    exit_code = 3


class GroupError(LlmgwError):
    """A node's part in a replica spread over several nodes cannot run: no ``rpc-server`` in the
    node's llama.cpp build, a GGUF header without a block count, a worker that does not answer."""


class GroupNetError(GroupError):
    """A group's network (:mod:`llmgw.agent.groups.groupnet`) could not be set up, or a peer was refused;
    the message says which and why."""


class MirrorError(LlmgwError):
    """The mirror could not fetch, verify or serve a file."""


class SourceConflict(MirrorError):
    """A ``model/version`` already holds (or is fetching) a different source."""


class NoSpaceError(MirrorError):
    """Too little disk for a file: checked before the bytes move, or the disk filled meanwhile."""


class EngineError(LlmgwError):
    """An engine binary is missing, does not start, or exited; the message carries its last log lines."""


class EstimateError(LlmgwError):
    """The GGUF header cannot be read or is not a GGUF; the message names the source."""


class JudgeError(LlmgwError):
    """No verdict: the judge is missing, down, over budget, gave an answer that cannot be read, or
    renders the wrong template.

    Attributes:
        kind: ``absent`` | ``missing`` | ``down`` | ``timeout`` | ``busy`` | ``unparseable`` | ``template`` |
            ``too_long`` | ``error``. ``absent``: no judge of the policy is in the catalog as a guard
            model (a retry cannot help); ``missing``: none has a usable replica now. ``busy``: refused
            at once because the judge's queue would not reach it within the budget. ``too_long``: the
            text does not fit in the judge's context (the judge's engine said so); the guard refuses the
            request whatever the policy's ``fail``.
        raw: the judge's own text, when it answered (kept for logs, never shown to clients).
        retry_after_s: for ``busy``, the seconds after which the queue should have room (else None).
    """

    def __init__(self, message: str, *, kind: str, raw: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.raw = raw
        self.retry_after_s = retry_after_s


class StoreError(LlmgwError):
    """The database cannot be opened, migrated or reached; the driver's error is chained."""


class StoreUnavailable(StoreError):
    """The database did not answer a call within its deadline, or refused the connection; the
    message names the database and what to check. The APIs answer 503 ``store_unavailable``."""


class Fenced(StoreError):
    """A leader's write was refused because the leadership term in the database is no longer the
    term it was granted (another control plane leads now); the write was rolled back."""


class Conflict(LlmgwError):
    """A write lost a race or would break uniqueness: the row changed since it was read (revision
    mismatch), or a model name/alias is taken. The admin API answers 409; re-read and try again."""


class Revoked(Conflict):
    """A heartbeat came with a certificate serial on the deny-list (its node was removed with
    ``llmgw ctl node rm``); ``node`` and ``revoked_at`` (unix seconds) say when."""

    def __init__(self, serial: str, node: str, revoked_at: float) -> None:
        super().__init__(f"certificate serial {serial} of node '{node}' is revoked")
        self.serial = serial
        self.node = node
        self.revoked_at = revoked_at


class PortInUseError(LlmgwError):
    """A listen address is already taken by another program; the message names the port and the flag."""

    exit_code = 2


class LockedError(LlmgwError):
    """Another process holds a lock this one needs (for example two ``server init`` at once)."""

    exit_code = 4


class ServiceError(LlmgwError):
    """A service (control plane, agent, mirror) could not be started, stopped or inspected."""


class WaitTimeout(LlmgwError):
    """A wait reached its deadline; the message says what was awaited and that init can be rerun."""

    exit_code = 5


def error_fields(body: Any, *, limit: int = 300) -> tuple[str, str]:
    """``(code, message)`` of an error answer, as a client reads it back.

    Args:
        body: the answer's body: its text or bytes (decoded here when it is JSON), or JSON already
            decoded. Either of llmgw's error envelopes (``{"error": {"code", "message", ...}}``:
            :mod:`llmgw.httperrors`), a bare ``{"error": "text"}``, or anything else (a proxy's HTML
            page, an empty body).
        limit: characters kept of a body that is not an envelope (the message then).

    Returns:
        ``code`` (``""`` when the body gives none) and ``message`` (the envelope's, else the body's
        text cut to ``limit``, else ``""``). Never raises.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    data = text
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except ValueError:
            return "", text.strip()[:limit]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("code") or ""), str(err.get("message") or "")
    if isinstance(err, str):
        return "", err[:limit]
    return "", ("" if data is None else (text if isinstance(text, str) else json.dumps(data)))[:limit].strip()
