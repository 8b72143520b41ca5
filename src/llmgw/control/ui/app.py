"""The dashboard's routes (``/ui/``), mounted on the admin listener and, with ``ui.listen``, on a
TLS listener of its own.

Pages (full HTML; ``?part=live`` answers only the part that updates, polled by htmx every 2 s):
``/ui/`` overview, ``/ui/models/{name}``, ``/ui/nodes/{id}``, ``/ui/guard``, ``/ui/keys``.
Fragments: ``/ui/replicas/{id}/log`` (the engine log's last lines, through the agent as ``ctl
logs`` reads them), ``/ui/usage.json?days=N`` (the usage plot's data),
``/ui/models/{name}/autoscale.json`` (a model's autoscaling plot: wanted, ready, load). Actions (POST forms, CSRF
token, admin role; each is one admin API call, whose 400/409 message is shown on the page after the
redirect): ``/ui/models/{name}/scale``, ``/ui/replicas/{id}/restart``,
``/ui/nodes/{id}/cordon|uncordon|drain``. ``/ui/login`` (GET form, POST token; wrong tokens are
throttled, :mod:`.throttle`), ``/ui/logout``.

Not logged in (or the session expired): a page redirects to ``/ui/login``; an htmx poll gets 401
with ``HX-Redirect`` so the browser goes there too. Every answer carries a Content-Security-Policy
allowing scripts only from ``/ui/static`` (no inline script), ``X-Frame-Options: DENY`` and
``Cache-Control: no-store``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web

from llmgw.catalog import scale_to
from llmgw.control.ui import auth, pages
from llmgw.control.ui.adminapi import AdminApi
from llmgw.control.ui.throttle import GLOBAL, DeviceCookies, LoginThrottle, address_key, retry_after
from llmgw.errors import ApiError, UnreachableError
from llmgw.names import path_segment
from llmgw.views import AutoscaleView, ClusterView, ExplainView, KeyView, ModelView, NodeView, ReplicaView, UsageView

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
POLL_S = 2  # how often live parts refresh (the issue: at most 2 s)
LOG_LINES = 60
USAGE_DAYS = (7, 14, 30, 90)
API_KEY = web.AppKey("api", AdminApi)
TOKENS_KEY = web.AppKey("tokens", auth.Tokens)
ROLE_KEY = web.RequestKey("role", auth.Role)
TOKEN_FILE_KEY = web.AppKey("token_file", str)
THROTTLE_KEY = web.AppKey("throttle", LoginThrottle)
DEVICES_KEY = web.AppKey("devices", DeviceCookies)
SECURE_KEY = web.AppKey("secure", bool)
DEVICE_COOKIE = "llmgw_ui_device"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)
OPEN = ("/ui/login", "/ui/static/")

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"),
    autoescape=True,  # every {{ }} is escaped: model names, labels, log lines, API messages
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.globals.update(ago=pages.ago, until=pages.until, poll_s=POLL_S)
_ENV.filters["gb"] = lambda b: f"{(b or 0) / pages.GB:.1f} GB"  # the unit ctl nodes shows
_ENV.filters["urlpart"] = lambda s: quote(str(s), safe="")


def _page(name: str, status: int = 200, **context: Any) -> web.Response:
    html = _ENV.get_template(name).render(**context)
    return web.Response(text=html, status=status, content_type="text/html")


def build_ui_app(
    api: AdminApi,
    tokens: auth.Tokens,
    *,
    ttl_s: float,
    secure: bool,
    token_file: str,
    throttle: LoginThrottle | None = None,
) -> web.Application:
    """The dashboard as an aiohttp app to mount at ``/ui``.

    Args:
        api: the admin API client (with the admin token; :mod:`.adminapi`).
        tokens: what a login may give (the admin token; the viewer token or None).
        ttl_s: seconds a login lasts (``ui.session_ttl_s``).
        secure: mark the cookies ``Secure`` (the TLS listener).
        token_file: where the admin token is, as the login page names it.
        throttle: the wrong-token counts (:mod:`.throttle`); give every listener of one control
            plane the same, so a guesser gets no second budget on the other. Default: a new one.
    """
    app = web.Application(middlewares=[_headers])
    auth.install(app, ttl_s=ttl_s, secure=secure)
    app.middlewares.append(_errors)
    app[API_KEY] = api
    app[TOKENS_KEY] = tokens
    app[TOKEN_FILE_KEY] = token_file
    app[THROTTLE_KEY] = throttle if throttle is not None else LoginThrottle()
    app[DEVICES_KEY] = DeviceCookies.from_admin_token(tokens.admin)
    app[SECURE_KEY] = secure

    r = app.router
    r.add_get("/login", login_form)
    r.add_post("/login", login)
    r.add_post("/logout", logout)
    r.add_get("/", overview)
    r.add_get("/models/{name}", model)
    r.add_post("/models/{name}/scale", scale)
    r.add_post("/replicas/{id}/restart", restart)
    r.add_get("/replicas/{id}/log", replica_log)
    r.add_get("/nodes/{id}", node)
    r.add_post("/nodes/{id}/{action:cordon|uncordon|drain}", node_action)
    r.add_get("/guard", guard)
    r.add_get("/keys", keys)
    r.add_get("/usage.json", usage_json)
    r.add_get("/models/{name}/autoscale.json", autoscale_json)
    r.add_static("/static/", HERE / "static", follow_symlinks=False)
    return app


# --- middlewares ---


@web.middleware
async def _headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as e:
        response = e
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "same-origin")
    if not request.path.startswith("/ui/static/"):
        response.headers.setdefault("Cache-Control", "no-store")
    if isinstance(response, web.HTTPException):
        raise response
    return response


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Login check (inside the session middleware), then: an admin API error on a page is that page
    with the API's status and message; an action's error goes back to the page as a message; a 4xx
    raised here (a bad CSRF token) is a page too, answered rather than raised, so the admin app's
    JSON error middleware never turns it into JSON."""
    if not request.path.startswith(OPEN):
        role = await auth.role(request)
        if role is None:
            if request.headers.get("HX-Request"):
                return web.Response(status=401, text="log in again", headers={"HX-Redirect": "/ui/login"})
            target = "/ui/login"
            if request.method == "GET" and request.path != "/ui/":
                target += "?next=" + quote(request.path_qs, safe="")
            raise web.HTTPSeeOther(target)
        request[ROLE_KEY] = role
        if request.method == "POST" and request.path != "/ui/logout" and role is not auth.Role.ADMIN:
            return _page("error.html", 403, **await _base(request, "Read-only"),
                         message="this login is read-only (the viewer token); log in with the admin token to act")
    try:
        return await handler(request)
    except (ApiError, UnreachableError) as e:
        if request.method == "POST":
            await auth.flash(request, e.args[0], error=True)
            raise web.HTTPSeeOther(_back(request)) from e
        status = e.status if isinstance(e, ApiError) and 400 <= e.status < 600 else 502
        return _page("error.html", status, **await _base(request, "Error"), message=str(e))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        page = _page("error.html", e.status, **await _base(request, e.reason), message=e.text or e.reason)
        if "Allow" in e.headers:  # a 405 says which methods the page takes (RFC 9110)
            page.headers["Allow"] = e.headers["Allow"]
        return page


def _back(request: web.Request) -> str:
    """Where an action returns: the page it was posted from (same origin), else the overview."""
    ref = request.headers.get("Referer", "")
    host = f"//{request.host}/ui/"
    if host in ref:
        return "/ui/" + ref.split(host, 1)[1].split("#", 1)[0]
    return "/ui/"


async def _live_base(request: web.Request) -> dict[str, Any]:
    """What a live part's template needs of the page (not the one-time message: a poll must not
    take it)."""
    role = request.get(ROLE_KEY)
    return {"can_act": role is auth.Role.ADMIN, "csrf": await auth.csrf_token(request)}


def _navigation(request: web.Request) -> bool:
    """Whether ``request`` loads a whole page (what shows an action's message): not htmx's polls,
    and for a browser (``Sec-Fetch-Dest``, Fetch Metadata) a document, not an image or a fetch."""
    if "HX-Request" in request.headers:
        return False
    return request.headers.get("Sec-Fetch-Dest", "document") in ("document", "iframe")


async def _base(request: web.Request, title: str) -> dict[str, Any]:
    """What every whole page's template needs: the live part's, plus the title, the role, the
    message an action left, and the path (the navigation marks the current page)."""
    role = request.get(ROLE_KEY)
    return {
        **await _live_base(request),
        "title": title,
        "role": role.value if role else "",
        # only a page the browser navigates to shows the message, so only such a page takes it: an
        # htmx poll, a fragment or a subresource that fails renders the error page too, and took the
        # message its redirect was carrying to the page (a cordon's "cordoned" went missing under load)
        "flash": await auth.take_flash(request) if _navigation(request) else None,
        "path": request.path,
    }


async def _render(request: web.Request, page: str, title: str, context: dict[str, Any]) -> web.Response:
    """``<page>.html``, or only its live part ``<page>_live.html`` when htmx polls (``?part=live``);
    the page includes it through ``live.html`` (``live_part``), which polls it."""
    if request.query.get("part") == "live":
        return _page(f"{page}_live.html", **await _live_base(request), **context)
    return _page(f"{page}.html", **await _base(request, title), live_part=f"{page}_live.html", **context)


def _api(request: web.Request) -> AdminApi:
    return request.app[API_KEY]


# --- login ---


async def login_form(request: web.Request) -> web.Response:
    """The login page (a new CSRF token is made for its form)."""
    nxt = request.query.get("next", "")
    return _page("login.html", **await _base(request, "Log in"), next=nxt, error="",
                 token_file=request.app[TOKEN_FILE_KEY])


async def login(request: web.Request) -> web.Response:
    """Check the CSRF token, the throttle (:mod:`.throttle`), then the token given: a wrong one is
    the form again with a message (401), a login while its address (or browser) must wait is the
    form with 429 and ``Retry-After``, the token not looked at. A right one starts the session and
    gives an admin's browser its device cookie (path ``/ui/login``), which counts its later logins
    apart from its address; not a viewer's: each viewer login gave a cookie, and with one cookie a
    login, admin-token guesses escaped the throttle (1,000 in 1.4 s, a security tester's finding)."""
    await auth.check_csrf(request)
    form = await request.post()
    nxt = str(form.get("next", ""))
    throttle = request.app[THROTTLE_KEY]
    device = request.app[DEVICES_KEY].device(request.cookies.get(DEVICE_COOKIE))
    keys = [f"device:{device}"] if device else [address_key(request.remote), GLOBAL]
    # From here to the count, no await: two logins must not both pass one free slot.
    wait = throttle.closed_for(keys)
    if wait > 0:
        response = _login_page(request, 429, nxt, await _base(request, "Log in"),
                               f"too many wrong tokens; wait {retry_after(wait)} s and try again (after a few wrong "
                               "tokens each one makes the next wait longer, up to a minute)")
        response.headers["Retry-After"] = retry_after(wait)
        return response
    role = request.app[TOKENS_KEY].role_of(str(form.get("token", "")))
    if role is None:
        started = throttle.wrong(keys)
        if started > 0:
            log.warning("dashboard login: wrong token from %s (%s); logins from it wait %g s", request.remote,
                        "a known browser" if device else "no device cookie", started)
        await asyncio.sleep(0.2)  # a guesser's pace even before the throttle closes
        return _login_page(request, 401, nxt, await _base(request, "Log in"),
                           "that token is not the admin token (or the viewer token); it is in the admin-token "
                           "file beside server.yaml")
    throttle.right(keys)
    await auth.log_in(request, role)
    done = web.HTTPSeeOther(nxt if nxt.startswith("/ui/") and "//" not in nxt else "/ui/")
    if role == auth.Role.ADMIN:  # a viewer's cookie was a fresh throttle for admin-token guesses, one a login
        done.set_cookie(DEVICE_COOKIE, request.app[DEVICES_KEY].issue(), max_age=int(request.app[DEVICES_KEY].ttl_s),
                        path="/ui/login", httponly=True, samesite="Strict", secure=request.app[SECURE_KEY])
    raise done


def _login_page(request: web.Request, status: int, nxt: str, base: dict[str, Any], error: str) -> web.Response:
    return _page("login.html", status, **base, next=nxt, token_file=request.app[TOKEN_FILE_KEY], error=error)


async def logout(request: web.Request) -> web.Response:
    """End the session and go to the login page."""
    await auth.check_csrf(request)
    await auth.log_out(request)
    raise web.HTTPSeeOther("/ui/login")


# --- pages ---


async def overview(request: web.Request) -> web.Response:
    """Nodes with their bars, models ready/wanted, replicas by state, the leader and the database,
    and what needs looking at."""
    api = _api(request)
    nodes_j, models_j, replicas_j, cluster_j = await asyncio.gather(
        api.get("/api/v1/nodes"), api.get("/api/v1/models"), api.get("/api/v1/replicas"),
        api.get("/api/v1/cluster"),
    )
    nodes = [NodeView.model_validate(n) for n in nodes_j]
    models = [ModelView.model_validate(m) for m in models_j]
    replicas = [ReplicaView.model_validate(r) for r in replicas_j]
    cluster = ClusterView.model_validate(cluster_j)
    context: dict[str, Any] = {
        "nodes": [(n, pages.node_bars(n)) for n in nodes],
        "models": models,
        "counts": pages.replica_counts(replicas),
        "cluster": cluster,
        "ha": len(cluster.control_planes) > 1 or bool(cluster.patroni),
        "problems": pages.problems(nodes, replicas, models),
    }
    return await _render(request, "overview", "Overview", context)


async def model(request: web.Request) -> web.Response:
    """A model: its profiles, replicas, placement's explanation, autoscaling's last decisions, scale
    and restart, a log tail."""
    name = request.match_info["name"]
    api = _api(request)
    m = ModelView.model_validate(await api.get(f"/api/v1/models/{path_segment(name)}"))
    replicas_j, explain_j, scale_j = await asyncio.gather(
        api.get("/api/v1/replicas", model=m.name), api.get("/api/v1/explain-placement", model=m.name),
        api.get(f"/api/v1/models/{path_segment(m.name)}/autoscale"),
    )
    replicas = [ReplicaView.model_validate(r) for r in replicas_j]
    placed = [r for r in replicas if r.node]
    chosen = request.query.get("replica", "")
    if chosen not in {r.id for r in placed}:
        chosen = placed[0].id if placed else ""
    context: dict[str, Any] = {
        "model": m,
        "profiles": (m.spec or {}).get("profiles", []) if isinstance(m.spec, dict) else [],
        "replicas": replicas,
        "explain": ExplainView.model_validate(explain_j),
        "autoscale": AutoscaleView.model_validate(scale_j),
        "log_replica": chosen,
        "placed": placed,
    }
    return await _render(request, "model", m.name, context)


async def scale(request: web.Request) -> web.Response:
    """Keep the form's count of replicas (:func:`llmgw.catalog.scale_to`) through ``PATCH /api/v1/models``."""
    await auth.check_csrf(request)
    name = request.match_info["name"]
    form = await request.post()
    raw = str(form.get("min", "")).strip()
    if not (raw.isascii() and raw.isdigit()):
        await auth.flash(request, f"replicas: '{raw}' is not a whole number of replicas (0 or more)", error=True)
        raise web.HTTPSeeOther(f"/ui/models/{path_segment(name)}")
    want = int(raw)
    api = _api(request)
    m = ModelView.model_validate(await api.get(f"/api/v1/models/{path_segment(name)}"))
    patch = {"scaling": scale_to(want, cur_min=m.scaling_min, cur_max=m.scaling_max)}
    await api.call("PATCH", f"/api/v1/models/{path_segment(name)}", patch)
    await auth.flash(request, f"{m.name}: {want} replica(s) wanted")
    raise web.HTTPSeeOther(f"/ui/models/{path_segment(m.name)}")


async def restart(request: web.Request) -> web.Response:
    """Restart a replica (``POST /api/v1/replicas/{id}/restart``)."""
    await auth.check_csrf(request)
    rid = request.match_info["id"]
    new = ReplicaView.model_validate(await _api(request).post(f"/api/v1/replicas/{path_segment(rid)}/restart"))
    await auth.flash(request, f"{rid} replaced by {new.id} on {new.node}")
    raise web.HTTPSeeOther(f"/ui/models/{path_segment(new.model)}")


async def replica_log(request: web.Request) -> web.Response:
    """The last lines of a replica's engine log, as a fragment (an error is shown in its place)."""
    rid = request.match_info["id"]
    try:
        got = await _api(request).get(f"/api/v1/replicas/{path_segment(rid)}/logs", lines=str(LOG_LINES))
        text, error = str(got.get("text", "")), ""
    except (ApiError, UnreachableError) as e:
        text, error = "", str(e)
    return _page("log.html", replica=rid, text=text, error=error)


async def node(request: web.Request) -> web.Response:
    """A node: inventory, GPUs, replicas, engines, labels; cordon/uncordon/drain."""
    nid = request.match_info["id"]
    api = _api(request)
    nodes_j, replicas_j = await asyncio.gather(api.get("/api/v1/nodes"), api.get("/api/v1/replicas"))
    found = [NodeView.model_validate(n) for n in nodes_j if n.get("id") == nid]
    if not found:
        raise ApiError(f"no node '{nid}'; the overview lists the nodes", status=404, code="node_not_found")
    n = found[0]
    context: dict[str, Any] = {
        "node": n,
        "gauges": pages.node_bars(n),
        "replicas": [
            ReplicaView.model_validate(r) for r in replicas_j
            if r.get("node") == nid or any(m.get("node") == nid for m in r.get("members", []))  # group workers too
        ],
    }
    return await _render(request, "node", n.id, context)


async def node_action(request: web.Request) -> web.Response:
    """Cordon, uncordon or drain a node (``POST /api/v1/nodes/{id}/{action}``). A drain says which
    models no other node can take the replicas of now (placement's check of each, as ``ctl node
    drain`` does): it said "replicas moved" while they waited, pending, for room (a new user's finding)."""
    await auth.check_csrf(request)
    nid, action = request.match_info["id"], request.match_info["action"]
    api = _api(request)
    before = await api.get("/api/v1/replicas") if action == "drain" else []
    await api.post(f"/api/v1/nodes/{path_segment(nid)}/{action}")
    done = {"cordon": "cordoned", "uncordon": "uncordoned",
            "drain": "drained (cordoned; its replicas stopped, placed again where they fit)"}
    stuck = []
    for model in sorted({r.get("model", "") for r in before if r.get("node") == nid}):
        profiles = (await api.get(f"/api/v1/models/{path_segment(model)}/resources")).get("profiles") or []
        if not any(n.get("fits") for p in profiles for n in p.get("nodes", [])):
            stuck.append(model)
    nowhere = f"; no other node can take the replicas of {', '.join(stuck)} now: see their pages" if stuck else ""
    await auth.flash(request, f"node {nid} {done[action]}{nowhere}", error=bool(stuck))
    raise web.HTTPSeeOther(f"/ui/nodes/{path_segment(nid)}")


async def guard(request: web.Request) -> web.Response:
    """Policies and their judges (state, p50/p95), verdict counts by category, recent verdicts (no
    text: :class:`llmgw.control.gateway.guard.RecentVerdict`)."""
    status = await _api(request).get("/api/v1/guard/status")
    stats = status.get("stats") or {}
    stats = {k: stats.get(k) or {} for k in ("blocked", "unjudged", "refused_unavailable", "errors")} | stats
    context: dict[str, Any] = {
        "guard": status,
        "stats": stats,
        "verdicts": sorted((stats.get("verdicts") or {}).items()),
        "categories": sorted((stats.get("categories") or {}).items(), key=lambda kv: (-kv[1], kv[0])),
        "recent": list(reversed(stats.get("recent") or []))[:20],
    }
    return await _render(request, "guard", "Guard", context)


async def keys(request: web.Request) -> web.Response:
    """The keys (limits, usage today, last used) and the usage plot (drawn from ``usage.json``)."""
    days = _days(request)
    api = _api(request)
    keys_j, usage_j = await asyncio.gather(api.get("/api/v1/keys"), api.get("/api/v1/usage", since=f"{days - 1}d"))
    context: dict[str, Any] = {
        "keys": [KeyView.model_validate(k) for k in keys_j],
        "usage": sorted((UsageView.model_validate(u) for u in usage_j), key=lambda u: (u.day, u.key, u.model),
                        reverse=True),
        "days": days,
        "day_choices": USAGE_DAYS,
    }
    return await _render(request, "keys", "Keys and usage", context)


def _days(request: web.Request) -> int:
    raw = request.query.get("days", "14")
    return int(raw) if raw.isascii() and raw.isdigit() and int(raw) in USAGE_DAYS else 14


async def usage_json(request: web.Request) -> web.Response:
    """The plot's data (:func:`llmgw.control.ui.pages.usage_series`) over ``?days=`` (7/14/30/90)."""
    days = _days(request)
    rows = [UsageView.model_validate(u) for u in await _api(request).get("/api/v1/usage", since=f"{days - 1}d")]
    return web.json_response(text=json.dumps(pages.usage_series(rows, days)))


async def autoscale_json(request: web.Request) -> web.Response:
    """A model's autoscaling plot (:func:`llmgw.control.ui.pages.autoscale_series`): the last hour."""
    view = AutoscaleView.model_validate(
        await _api(request).get(f"/api/v1/models/{path_segment(request.match_info['name'])}/autoscale")
    )
    return web.json_response(text=json.dumps(pages.autoscale_series(view)))

