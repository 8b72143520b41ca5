"""The one exception tree of llmgw.

Every error llmgw raises on purpose is an :class:`LlmgwError`; library errors (httpx, aiohttp,
sqlite3, subprocess, yaml) are translated where they enter our code, with the cause chained. The
CLI turns an ``LlmgwError`` into ``Error: <message>`` and its ``exit_code``, never a traceback.

::

    LlmgwError                     exit 1
    ├── ConfigError                exit 2   a config file or flag is invalid (names file, field, rule)
    ├── PkiError                   exit 2   the cluster CA or a certificate is missing or unusable
    ├── SourceError                exit 2   a model source cannot become a download (sourcecheck)
    ├── ApiError                   exit 1   an llmgw HTTP API answered with an error (status, code)
    ├── UnreachableError           exit 3   an llmgw service does not answer at its address
    ├── MirrorError                exit 1   the mirror could not fetch or serve a file
    ├── EngineError                exit 1   an engine is missing, failed to start, or exited
    ├── PortInUseError             exit 2   a listen port is already taken by another program
    ├── LockedError                exit 4   another process holds a lock (two inits at once)
    ├── ServiceError               exit 1   a service could not be started, stopped or read
    └── WaitTimeout                exit 5   a wait gave up at its deadline (run again to keep waiting)

Messages name the thing, the bad value, the rule, and the next step.
"""

from __future__ import annotations


class LlmgwError(Exception):
    """Base of every llmgw error; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ConfigError(LlmgwError):
    """A config file or flag is invalid; the message names the file, the field and what is allowed."""

    exit_code = 2


class PkiError(LlmgwError):
    """The cluster CA, a certificate or a key is missing or unusable."""

    exit_code = 2


class SourceError(LlmgwError):
    """A model source (``hf:``, ``https://``, ``file:``) cannot become a download."""

    exit_code = 2


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


class UnreachableError(LlmgwError):
    """An llmgw service does not answer at its address (connection refused, timeout, TLS failure)."""

    exit_code = 3


class MirrorError(LlmgwError):
    """The mirror could not fetch, verify or serve a file."""


class EngineError(LlmgwError):
    """An engine binary is missing, does not start, or exited; the message carries its last log lines."""


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
