"""Gateway API keys as the admin API takes them: secrets, digests, the create request, durations.

Limits (``rpm``, ``tpm``, ``budget_tokens``) and ``priority`` are strict JSON integers, as counts are everywhere in
llmgw: ``5.0``, ``"5"`` and ``true`` are refused with a 400 naming the field, never rounded or parsed.
:class:`KeySpec` makes a key; :class:`KeyPatch` changes an existing key's limits.

A secret is ``sk-llmgw-`` + 43 URL-safe characters (32 random bytes, :func:`secrets.token_urlsafe`);
the store keeps only its SHA-256 (hex) and its first 16 characters (:func:`key_prefix`), enough to
tell keys apart in ``llmgw ctl key ls`` and never enough to use one. A secret is shown once, when it
is made (``ctl key create``, ``ctl key rotate``).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from llmgw.names import check_name, valid_name

SECRET_PREFIX = "sk-llmgw-"  # noqa: S105 - the public prefix of every key, not a secret
PREFIX_CHARS = 16
#: The highest key priority (0 is the default and the lowest): ten bands, as llm-d's flow control
#: offers a handful of priority levels; more would only be told apart by their order.
MAX_PRIORITY = 9
#: The longest ``expires`` or usage range: ten years (s).
MAX_DURATION_S = 10 * 366 * 86400

_DURATION = re.compile(r"(\d{1,15})([smhdw])")  # past ten years is refused as such, not as no duration
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def new_secret() -> str:
    """A new key: ``sk-llmgw-`` and 43 URL-safe characters (256 random bits)."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def key_digest(secret: str) -> str:
    """The SHA-256 of ``secret`` (UTF-8) as 64 hex digits: what the store keeps."""
    return hashlib.sha256(secret.encode()).hexdigest()


def key_prefix(secret: str) -> str:
    """The first 16 characters of ``secret`` (``sk-llmgw-`` and 7 more): shown, never usable."""
    return secret[:PREFIX_CHARS]


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds in ``text``: a number and a unit, ``90s``, ``30m``, ``12h``, ``30d`` or ``2w``.

    Raises:
        ValueError: not that shape, zero, or longer than ten years; the message names ``what``.
    """
    m = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{what} {text!r} is not a duration: a number and a unit, e.g. 90s, 30m, 12h, 30d or 2w")
    seconds = float(int(m.group(1)) * _UNIT_S[m.group(2)])
    if not 0 < seconds <= MAX_DURATION_S:
        raise ValueError(f"{what} {text!r} must be more than 0 and at most ten years")
    return seconds


def _duration(text: str) -> str:
    """``text`` when :func:`parse_duration` reads it (as ``expires``); else its ValueError."""
    parse_duration(text, "expires")
    return text


Duration = Annotated[str, AfterValidator(_duration)]
"""A key's ``expires`` as the API takes it: a duration from now (``30d``), checked, kept as text."""

#: The usage name of a key from the gateway's keys file, and of a loopback client without a key: no
#: stored key may take them, or its usage would merge with theirs (a new user's finding, 2026-12-05).
FILE_CALLER_NAME = "keys-file"
LOOPBACK_CALLER_NAME = "loopback"


def _not_a_usage_name(name: str) -> str:
    if name in (FILE_CALLER_NAME, LOOPBACK_CALLER_NAME):
        raise ValueError(
            f"'{name}' is the name usage, metrics and the access log give "
            + ("the keys file's keys" if name == FILE_CALLER_NAME else "loopback clients without a key")
            + "; choose another name"
        )
    return name


class KeySpec(BaseModel):
    """``POST /api/v1/keys``: a new key's name and limits (``llmgw ctl key create``).

    ``models`` lists the model names or aliases the key may use ([] = every model); ``rpm`` and ``tpm``
    are requests and tokens (prompt + completion) per minute; ``budget_tokens`` is tokens per
    ``budget_period`` (``day`` or ``month``, UTC); ``expires`` a duration from now (``30d``). Absent
    limits are no limits. ``priority`` (0-9, default 0) is the key's band in the gateway's queue
    (:mod:`llmgw.control.gateway.queue`): when a model's slots are all busy, a waiting request of a
    higher priority is served before any of a lower one; keys of one priority share fairly.
    """

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, valid_name("key name"), AfterValidator(_not_a_usage_name)] = Field(
        description="1-63 characters: lower-case letters, digits and '-', as model names"
    )
    models: list[str] = Field(default_factory=list, max_length=100)
    rpm: StrictInt | None = Field(None, gt=0, le=10**9, description="requests per minute")
    tpm: StrictInt | None = Field(None, gt=0, le=10**12, description="tokens per minute")
    budget_tokens: StrictInt | None = Field(None, gt=0, le=10**15, description="tokens per budget_period")
    budget_period: Literal["day", "month"] | None = None
    expires: Duration | None = Field(None, description="a duration from now: 90m, 12h, 30d, 2w")
    priority: StrictInt = Field(0, ge=0, le=MAX_PRIORITY, description="0-9: queue band, higher served first")

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[str]) -> list[str]:
        return sorted({check_name(m, "model name") for m in v})

    @model_validator(mode="after")
    def _budget(self) -> KeySpec:
        if (self.budget_tokens is None) != (self.budget_period is None):
            raise ValueError(
                "budget_tokens and budget_period go together: e.g. budget_tokens 1000000, budget_period day"
            )
        return self

    def expires_at(self, now: float) -> float | None:
        """Unix seconds the key expires at, made at ``now``; None when it does not."""
        return now + parse_duration(self.expires, "expires") if self.expires else None


class KeyPatch(BaseModel):
    """``PATCH /api/v1/keys/{name}``: a JSON merge patch of a key's limits (``llmgw ctl key set``).

    A field left out keeps its value; ``null`` removes that limit (``models: null`` or ``[]``: every
    model; ``expires: null``: never expires); a value replaces it, with :class:`KeySpec`'s rules
    (strict integers, the same bounds). ``expires`` is a duration from the time of the change.
    ``budget_tokens`` and ``budget_period`` must still go together after the change: set or remove
    both, or change one of a key that has both. ``priority`` 0-9 (``null``: back to 0). The name and
    the secret are not limits: rotate the secret with ``POST /api/v1/keys/{name}/rotate``.
    """

    model_config = ConfigDict(extra="forbid")

    models: list[str] | None = Field(None, max_length=100)
    rpm: StrictInt | None = Field(None, gt=0, le=10**9, description="requests per minute; null: no limit")
    tpm: StrictInt | None = Field(None, gt=0, le=10**12, description="tokens per minute; null: no limit")
    budget_tokens: StrictInt | None = Field(
        None, gt=0, le=10**15, description="tokens per budget_period; null (with budget_period): no budget"
    )
    budget_period: Literal["day", "month"] | None = None
    expires: Duration | None = Field(None, description="a duration from now: 90m, 12h, 30d, 2w; null: never")
    priority: StrictInt | None = Field(None, ge=0, le=MAX_PRIORITY, description="0-9; null: 0")

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else sorted({check_name(m, "model name") for m in v})

    def changes(self, now: float) -> dict[str, Any]:
        """The fields given, as an :class:`~llmgw.control.store.rows.ApiKeyRow`'s: ``models`` a
        tuple, ``budget_period`` "" for none, ``expires_at`` unix seconds (made at ``now``) or None."""
        out: dict[str, Any] = {}
        for field in sorted(self.model_fields_set):
            value = getattr(self, field)
            if field == "models":
                out["models"] = tuple(value or ())
            elif field == "budget_period":
                out["budget_period"] = value or ""
            elif field == "expires":
                out["expires_at"] = None if value is None else now + parse_duration(value, "expires")
            elif field == "priority":
                out["priority"] = value or 0
            else:
                out[field] = value
        return out
