"""The admin API's gateway keys and usage (bearer token, like every admin route).

- ``POST /api/v1/keys`` (:class:`~llmgw.apikeys.KeySpec`) → 201 :class:`~llmgw.views.NewKeyView`: the
  secret, shown this once; the store keeps its SHA-256. 409 when the name is taken, by a live key or
  by a revoked one: a revoked key's name stays taken, so its usage stays its own (usage and budgets
  are counted by name).
- ``GET /api/v1/keys`` → [:class:`~llmgw.views.KeyView`], with each key's usage today and this month;
  ``GET /api/v1/keys/{name}`` → one of them (404 ``key_not_found``). PATCH and revoke answer the same view.
- ``PATCH /api/v1/keys/{name}`` (:class:`~llmgw.apikeys.KeyPatch`, a JSON merge patch of its limits:
  ``rpm``, ``tpm``, ``budget_tokens``/``budget_period``, ``models``, ``expires``, ``priority``;
  ``null`` removes one) → KeyView; 409 ``key_revoked`` on a revoked key (it stays revoked: make a
  new key under another name). The secret, usage and rate windows stay: a request counted
  this minute still counts against a lowered ``rpm``.
- ``POST /api/v1/keys/{name}/revoke`` → KeyView (again on a revoked key: the same answer).
- ``POST /api/v1/keys/{name}/rotate`` → NewKeyView: a new secret; the old one stops working; 409
  ``key_revoked`` on a revoked key, as for a patch.
- ``GET /api/v1/usage?key=&model=&since=7d&until=`` → [:class:`~llmgw.views.UsageView`]: ``since`` and
  ``until`` are a duration back from now (``7d``, ``12h``) or a UTC day (``YYYY-MM-DD``); ``since``
  defaults to 7 days, ``until`` to today; at most 400 days. 404 ``key_not_found`` when ``key`` names
  no stored key (nor ``keys-file`` or ``loopback``, the usage names of the keys file's keys and of
  loopback clients without a key).

Every write is handed to this control plane's gateway (:meth:`~llmgw.control.gateway.callers.Callers.put`)
before it is answered: a key made here works here, and one revoked here is refused here, from the
answer on. Every other control plane reads the keys from the store every 0.5 s
(:mod:`llmgw.control.gateway.accounting`), so a change holds on all of them within about a second.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from llmgw import jsonbody
from llmgw.apikeys import (
    FILE_CALLER_NAME,
    LOOPBACK_CALLER_NAME,
    KeyPatch,
    KeySpec,
    key_digest,
    key_prefix,
    new_secret,
    parse_duration,
)
from llmgw.control.api.context import must_exist
from llmgw.control.gateway.callers import Callers
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.rows import ApiKeyRow
from llmgw.errors import HttpError
from llmgw.views import KeyView, NewKeyView, UsageView

#: The longest usage range a query may ask (days).
MAX_USAGE_DAYS = 400
_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
_Body = TypeVar("_Body", bound=BaseModel)


def _day(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t))


def key_view(row: ApiKeyRow, now: float, tokens: dict[tuple[str, str], int] | None = None,
             requests_today: int = 0) -> KeyView:
    """``row`` as the API shows it; ``tokens``: (key, day) → tokens this month, for its usage."""
    today = _day(now)
    mine = {d: n for (k, d), n in (tokens or {}).items() if k == row.name}
    state = "revoked" if row.revoked_at is not None else (
        "expired" if row.expires_at is not None and row.expires_at <= now else "active")
    return KeyView(
        name=row.name, prefix=row.prefix, models=list(row.models), rpm=row.rpm, tpm=row.tpm,
        budget_tokens=row.budget_tokens, budget_period=row.budget_period or None, expires_at=row.expires_at,
        created_at=row.created_at, revoked_at=row.revoked_at, last_used_at=row.last_used_at, state=state,
        priority=row.priority, id=row.digest[:12],
        requests_today=requests_today, tokens_today=mine.get(today, 0), tokens_this_month=sum(mine.values()),
    )


def usage_day(text: str, now: float, what: str) -> str:
    """A usage query's ``since``/``until``: a duration back from ``now`` or a ``YYYY-MM-DD`` day.

    Raises:
        HttpError: 400 naming ``what`` and the two forms.
    """
    if _DAY.fullmatch(text):
        try:
            time.strptime(text, "%Y-%m-%d")
        except ValueError:
            raise HttpError(400, "invalid_range", f"{what} {text!r} is not a date (YYYY-MM-DD)") from None
        return text
    try:
        return _day(now - parse_duration(text, what))
    except ValueError as e:
        raise HttpError(400, "invalid_range", f"{e}; or give a UTC day as YYYY-MM-DD") from None


def _backwards(since: str, until: str) -> bool:
    """Whether ``since`` and ``until`` are both durations (checked by :func:`usage_day`) and ``since``
    is the nearer: on one UTC day both name the same day, so the day's check cannot see it."""
    if not until or _DAY.fullmatch(since) or _DAY.fullmatch(until):
        return False
    return parse_duration(since, "since") < parse_duration(until, "until")


@dataclass(frozen=True)
class KeysContext:
    """What the key and usage handlers share, kept on the admin app under :data:`KEYS` by
    :func:`add_key_routes`: the store, the off-loop pool its calls go through, ``callers`` (this
    control plane's gateway's keys: every written row is put there before the answer), ``on_change``
    (called after every write) and the clock (unix seconds)."""

    store: Store
    db: OffLoop
    callers: Callers
    on_change: Callable[[], None]
    clock: Callable[[], float] = time.time

    def written(self, row: ApiKeyRow) -> None:
        """After a key was written: this control plane's gateway uses ``row`` from now on (before the
        API answers), then ``on_change``."""
        self.callers.put(row)
        self.on_change()


#: Where the admin app keeps its :class:`KeysContext`.
KEYS: web.AppKey[KeysContext] = web.AppKey("keys", KeysContext)


def _views(ctx: KeysContext, rows: list[ApiKeyRow]) -> list[KeyView]:
    """On a store thread: ``rows`` as views, with today's requests and this month's tokens."""
    store, clock = ctx.store, ctx.clock
    now = clock()
    tokens = store.key_tokens_by_day(since_day=_day(now)[:8] + "01")
    today = store.usage(since_day=_day(now))
    reqs: dict[str, int] = {}
    for u in today:
        reqs[u.key] = reqs.get(u.key, 0) + u.requests
    return [key_view(r, now, tokens, reqs.get(r.name, 0)) for r in rows]


async def must_key(ctx: KeysContext, name: str) -> ApiKeyRow:
    """The key ``name``.

    Raises:
        HttpError: 404 ``key_not_found``.
    """
    return await must_exist(ctx.db, ctx.store.get_key, name, what="key",
                            listing="'llmgw ctl key ls' (GET /api/v1/keys)")


async def must_active_key(ctx: KeysContext, name: str) -> ApiKeyRow:
    """The key ``name``, not revoked.

    Raises:
        HttpError: 404 ``key_not_found``; 409 ``key_revoked`` (a revoked key stays revoked, and its
            name stays taken: the message says to make a key under another name).
    """
    row = await must_key(ctx, name)
    if row.revoked_at is not None:
        raise HttpError(409, "key_revoked", revoked_message(row.name))
    return row


def revoked_message(name: str) -> str:
    """What a change to the revoked key ``name`` is told: it cannot be changed or rotated, and its
    name stays taken, so a replacement needs a new name."""
    return (f"key '{name}' is revoked, and a revoked key cannot be changed or rotated; make a new key "
            f"under another name ('llmgw ctl key create NEW-NAME'): '{name}' stays taken so its usage "
            "stays its own")


async def _read(request: web.Request, shape: type[_Body]) -> _Body:
    """The request's body as ``shape``; else 400 ``invalid_key`` naming the field (or what
    :func:`llmgw.jsonbody.read_json` refuses)."""
    try:
        return shape.model_validate(await jsonbody.read_json(request))
    except ValidationError as e:
        raise HttpError(400, "invalid_key", _describe(e)) from e


async def create(request: web.Request) -> web.Response:
    """``POST /api/v1/keys``: 201 with the new secret (shown this once)."""
    ctx = request.app[KEYS]
    spec = await _read(request, KeySpec)
    secret, now = new_secret(), ctx.clock()
    row = ApiKeyRow(
        name=spec.name, prefix=key_prefix(secret), digest=key_digest(secret), models=tuple(spec.models),
        rpm=spec.rpm, tpm=spec.tpm, budget_tokens=spec.budget_tokens, budget_period=spec.budget_period or "",
        expires_at=spec.expires_at(now), created_at=now, priority=spec.priority,
    )
    row = await ctx.db.run(ctx.store.add_key, row)
    ctx.written(row)
    return _json(NewKeyView(key=key_view(row, now), secret=secret).model_dump(mode="json"), 201)


async def list_keys(request: web.Request) -> web.Response:
    """``GET /api/v1/keys``: every key with its usage today and this month."""
    ctx = request.app[KEYS]
    views = await ctx.db.read(lambda: _views(ctx, ctx.store.list_keys()))
    return _json([v.model_dump(mode="json") for v in views])


async def set_limits(request: web.Request) -> web.Response:
    """``PATCH /api/v1/keys/{name}``: a merge patch of the key's limits; 409 on a revoked key."""
    ctx = request.app[KEYS]
    patch = await _read(request, KeyPatch)
    row = await must_active_key(ctx, request.match_info["name"])
    new = replace(row, **patch.changes(ctx.clock()))
    if (new.budget_tokens is None) != (not new.budget_period):
        have = f"budget_tokens {new.budget_tokens}, budget_period {new.budget_period or 'null'}"
        raise HttpError(
            400, "invalid_key",
            f"budget_tokens and budget_period go together (this change leaves {have}): set both, "
            "or null both to remove the budget",
        )
    if new != row:
        new = await ctx.db.run(lambda: ctx.store.update_key(new, revision=row.revision))
        ctx.written(new)
    return await _one_view(ctx, new)


async def _one_view(ctx: KeysContext, row: ApiKeyRow) -> web.Response:
    """``row``'s view with its usage, as ``GET /api/v1/keys`` lists it (a PATCH answered zeros)."""
    (view,) = await ctx.db.read(lambda: _views(ctx, [row]))
    return _json(view.model_dump(mode="json"))


async def get_key(request: web.Request) -> web.Response:
    """``GET /api/v1/keys/{name}``: one key's view, as the list gives it; 404 for an unknown name."""
    ctx = request.app[KEYS]
    return await _one_view(ctx, await must_key(ctx, request.match_info["name"]))


async def revoke(request: web.Request) -> web.Response:
    """``POST /api/v1/keys/{name}/revoke``: the key's view (the same again on a revoked key)."""
    ctx = request.app[KEYS]
    store, clock = ctx.store, ctx.clock
    row = await must_key(ctx, request.match_info["name"])
    if row.revoked_at is None:
        row = await ctx.db.run(lambda: store.update_key(replace(row, revoked_at=clock()), revision=row.revision))
        ctx.written(row)
    return await _one_view(ctx, row)


async def rotate(request: web.Request) -> web.Response:
    """``POST /api/v1/keys/{name}/rotate``: a new secret; the old one stops working."""
    ctx = request.app[KEYS]
    row = await must_active_key(ctx, request.match_info["name"])
    secret = new_secret()
    new = replace(row, prefix=key_prefix(secret), digest=key_digest(secret))
    new = await ctx.db.run(lambda: ctx.store.update_key(new, revision=row.revision))
    ctx.written(new)
    return _json(NewKeyView(key=key_view(new, ctx.clock()), secret=secret).model_dump(mode="json"))


async def usage(request: web.Request) -> web.Response:
    """``GET /api/v1/usage?key=&model=&since=7d&until=``: usage per key, model and day.

    Raises:
        HttpError: 400 ``invalid_range`` for a bad ``since``/``until``; 404 ``key_not_found`` when
            ``key`` names no stored key (``keys-file`` and ``loopback`` are usage names too).
    """
    ctx = request.app[KEYS]
    db, store = ctx.db, ctx.store
    q, now = request.query, ctx.clock()
    since = usage_day(q.get("since") or "7d", now, "since")
    until = usage_day(q["until"], now, "until") if q.get("until") else _day(now)
    if _backwards(q.get("since") or "7d", q.get("until") or ""):  # two durations on one day (30m..1h)
        raise HttpError(400, "invalid_range", f"since ({q.get('since')} ago) is after until ({q.get('until')} ago)")
    if since > until:
        raise HttpError(400, "invalid_range", f"since ({since}) is after until ({until})")
    span = (time.mktime(time.strptime(until, "%Y-%m-%d")) - time.mktime(time.strptime(since, "%Y-%m-%d"))) / 86400
    if span > MAX_USAGE_DAYS:
        raise HttpError(400, "invalid_range", f"since..until spans {span:.0f} days; at most {MAX_USAGE_DAYS}")
    key = q.get("key") or None
    if key is not None and key not in (FILE_CALLER_NAME, LOOPBACK_CALLER_NAME):
        await must_key(ctx, key)  # a typo is told, not answered "no usage"
    rows = await db.run(
        lambda: store.usage(key=key, model=q.get("model") or None, since_day=since,
                            until_day=until)
    )
    return _json([UsageView(**vars(u)).model_dump(mode="json") for u in rows])


#: The key and usage routes.
ROUTES = [
    web.post("/api/v1/keys", create),
    web.get("/api/v1/keys", list_keys),
    web.get("/api/v1/keys/{name}", get_key),
    web.patch("/api/v1/keys/{name}", set_limits),
    web.post("/api/v1/keys/{name}/revoke", revoke),
    web.post("/api/v1/keys/{name}/rotate", rotate),
    web.get("/api/v1/usage", usage),
]


def add_key_routes(app: web.Application, store: Store, db: OffLoop, *, callers: Callers,
                   on_change: Callable[[], None], clock: Callable[[], float] = time.time) -> None:
    """Add the key and usage routes (see the module docstring, :data:`ROUTES`) to the admin API
    ``app``, with a :class:`KeysContext` from the arguments under :data:`KEYS` (``callers``: this
    control plane's gateway's keys, which every write updates before it is answered)."""
    app[KEYS] = KeysContext(store=store, db=db, callers=callers, on_change=on_change, clock=clock)
    app.add_routes(ROUTES)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(text=json.dumps(data), status=status)


def _describe(err: ValidationError) -> str:
    """The first problem, the field named: ``rpm: Input should be greater than 0``."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = str(first["msg"]).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg
