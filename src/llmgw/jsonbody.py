"""Bounded JSON request bodies, for every llmgw API that parses JSON (gateway, admin API, agent API).

``json.loads`` recurses once per nesting level: ``[[[[…]]]]`` 100,000 deep raises
``RecursionError`` (not ``ValueError``), which handlers did not expect, so a 200 kB body answered
a plain-text 500 with a traceback. And ``1e400`` parses as ``inf``, which pydantic then stores as
``null``. :func:`loads` refuses, before or while parsing:

* a body nested deeper than :data:`MAX_DEPTH` (counted without recursion, before parsing:
  :func:`nesting_depth`);
* ``NaN``/``Infinity`` (not JSON) and numbers that overflow a float (``1e400``), the message led
  by the field that holds it (``scaling.target: NaN is not a JSON number; send a finite number``);
* integers of more than 4,300 digits (Python's own limit) and anything else ``json`` rejects.

:func:`read_json` also bounds the size (the app's ``client_max_size`` or ``max_bytes``). Both
raise :class:`~llmgw.errors.JsonBodyError` (an :class:`~llmgw.errors.HttpError`), carrying the HTTP
status (400 or 413), a short code and a message that says what was wrong; each API answers it in
its own error shape (:mod:`llmgw.httperrors`: OpenAI's at the gateway, ``{"error": {"code",
"message"}}`` at the admin and agent APIs).
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from aiohttp import web

from llmgw.errors import JsonBodyError

MAX_DEPTH = 64
"""Nesting levels a body may have. A chat request is about 6 deep (messages, content parts, image
URL objects), a tool's JSON schema rarely past 20; a catalog entry is 4."""

MAX_BYTES = 1024 * 1024
"""Body size :func:`read_json` accepts by default (1 MiB): a catalog entry or a heartbeat is a few kB."""

_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(rb"[^\[\]{}]+")
_STEP = [0] * 256
for _c in b"[{":
    _STEP[_c] = 1
for _c in b"]}":
    _STEP[_c] = -1


def nesting_depth(raw: bytes, *, limit: int = MAX_DEPTH) -> int:
    """How deeply the arrays and objects of ``raw`` nest; ``limit + 1`` as soon as it is known to
    be deeper than ``limit``.

    Strings are removed first (brackets inside them do not count), then the brackets left are
    summed as +1/-1 and the running maximum taken: every step runs in C (regex, ``map``,
    ``accumulate``), about 60 ms per million brackets and no recursion; a run of ``limit + 1``
    opening brackets (the shape of the attack) is found by one regex search first.
    """
    rest = _NOT_BRACKETS.sub(b"", _STRINGS.sub(b"", raw))
    if not rest:
        return 0
    if re.search(rb"[\[{]{%d}" % (limit + 1), rest):
        return limit + 1
    return max(accumulate(map(_STEP.__getitem__, rest), initial=0))


class _NotFinite(ValueError):
    """A number that is not a finite float: ``NaN``/``Infinity``, or one that overflows."""


def _constant(name: str) -> float:
    raise _NotFinite(f"{name} is not a JSON number; send a finite number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(f"the number {text[:40]} is too large for a 64-bit float; send a finite number")
    return value


class _Marked(str):
    """Stands in for a non-finite number in the second parse, to find where it was."""

    __slots__ = ()


def _mark(text: str) -> Any:
    try:
        return _finite(text) if text not in ("NaN", "Infinity", "-Infinity") else _Marked(text)
    except _NotFinite:
        return _Marked(text)


def _where(value: Any, path: str = "") -> str | None:
    """The path (``scaling.target``, ``messages[0].n``) of the first :class:`_Marked` in ``value``;
    iterative, so a deep body costs no recursion."""
    todo: list[tuple[Any, str]] = [(value, path)]
    while todo:
        v, at = todo.pop()
        if isinstance(v, _Marked):
            return at or "the body"
        if isinstance(v, dict):
            todo.extend((x, f"{at}.{k}" if at else str(k)) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            todo.extend((x, f"{at}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def _named(data: bytes, e: _NotFinite) -> str:
    """``e``'s message, led by the field that holds the number (a second parse finds it)."""
    try:
        where = _where(json.loads(data, parse_constant=_Marked, parse_float=_mark))
    except (ValueError, RecursionError):
        where = None
    return f"{where}: {e}" if where else str(e)


_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_finite)


def loads(raw: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``raw`` as JSON within the bounds above.

    Raises:
        JsonBodyError: 400 ``invalid_json`` (not JSON, not UTF-8, NaN/Infinity, a number out of
            range) or 400 ``json_too_deep`` (more than ``max_depth`` levels).
    """
    data = raw.encode() if isinstance(raw, str) else raw
    # Fewer opening brackets than the limit cannot nest deeper: skip the scan (a 60 MB image).
    openers = data.count(b"[") + data.count(b"{")
    if openers > max_depth and nesting_depth(data, limit=max_depth) > max_depth:
        raise JsonBodyError(
            400, "json_too_deep",
            f"the body nests arrays/objects more than {max_depth} levels deep; flatten it",
        )
    try:
        # json.loads' own steps for bytes, with one decoder made once (json.loads makes one per call
        # when given parse_* hooks: ~1.5 µs of a small body's ~4 µs)
        text = raw if isinstance(raw, str) else data.decode(json.detect_encoding(data), "surrogatepass")
        if text.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return _DECODER.decode(text)
    except RecursionError as e:  # the count above makes this unreachable; kept as a guard
        raise JsonBodyError(400, "json_too_deep", "the body nests too deeply; flatten it") from e
    except _NotFinite as e:
        raise JsonBodyError(400, "invalid_json", f"the body is not valid JSON: {_named(data, e)}") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise JsonBodyError(400, "invalid_json", f"the body is not valid JSON: {e}") from e


async def read_json(request: web.Request, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """Read and parse ``request``'s body within ``max_bytes`` and ``max_depth``.

    The app's ``client_max_size`` (aiohttp's default is also 1 MiB) bounds what aiohttp buffers;
    a larger one there does not raise ``max_bytes`` here.

    Raises:
        JsonBodyError: as :func:`loads`, or 413 ``body_too_large``.
    """
    limit = max_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise _too_large(limit) from e
    if len(raw) > limit:
        raise _too_large(limit)
    return loads(raw, max_depth=max_depth)


def _too_large(limit: int) -> JsonBodyError:
    return JsonBodyError(413, "body_too_large", f"the body is larger than {limit} bytes; send less")
