"""Who is logged in to the dashboard: the session cookie, the roles, the CSRF token.

- **Login** takes the admin token (role ``admin``) or, when one is configured, the viewer token
  (role ``viewer``: every page, no action). Tokens are compared in constant time.
- **The session** lives in one cookie (``llmgw_ui``, path ``/ui``), encrypted and signed with
  Fernet by ``aiohttp-session`` under a key made at startup (a restart logs everyone out), marked
  ``HttpOnly`` and ``SameSite=Strict`` (``Secure`` on the TLS listener). It carries the role, the
  login time and the CSRF token. A session ends ``ui.session_ttl_s`` after its login whatever
  happens in it: the login time inside the cookie is checked on every request (:func:`role`), and a
  cookie re-issued by a later answer carries only the time left as its ``Max-Age`` (before, every
  re-issued cookie was good for another full ttl, so a session in use never ended).
- **CSRF**: every form carries the session's random token in a hidden field; a POST without the
  right one is a 403 (the synchronizer-token pattern of OWASP's CSRF cheat sheet; SameSite=Strict
  is the second layer).
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum

from aiohttp import web
from aiohttp_session import Session, get_session, new_session
from aiohttp_session import setup as setup_session
from aiohttp_session.cookie_storage import EncryptedCookieStorage
from cryptography.fernet import Fernet

from llmgw.bearer import sent_bytes

COOKIE = "llmgw_ui"
CSRF_FIELD = "csrf"


class Role(StrEnum):
    """What a login may do: ``admin`` everything the admin API allows, ``viewer`` only look."""

    ADMIN = "admin"
    VIEWER = "viewer"


@dataclass(frozen=True)
class Tokens:
    """The tokens a login may give: the admin token, and the read-only one (None: no viewers)."""

    admin: str
    viewer: str | None = None

    def role_of(self, given: str) -> Role | None:
        """The role ``given`` logs in as, or None when it is neither token."""
        given_b = sent_bytes(given.strip())
        if given_b and hmac.compare_digest(given_b, self.admin.encode()):
            return Role.ADMIN
        if self.viewer and given_b and hmac.compare_digest(given_b, self.viewer.encode()):
            return Role.VIEWER
        return None


@dataclass
class Revoked:
    """Sessions logged out before their time: session id -> when its cookie would have expired
    anyway (unix seconds). A cookie copied before a logout is refused after it, though the cookie
    itself is still valid Fernet; entries go once past that time, so the table holds at most the
    logouts of one ``session_ttl_s``."""

    ttl_s: float
    ids: dict[str, float] = field(default_factory=dict)

    def add(self, sid: str, now: float) -> None:
        """Refuse ``sid`` from now on (until it would have expired)."""
        self.ids = {k: t for k, t in self.ids.items() if t > now}
        self.ids[sid] = now + self.ttl_s

    def __contains__(self, sid: object) -> bool:
        return sid in self.ids


REVOKED_KEY = web.AppKey("revoked", Revoked)


def install(app: web.Application, *, ttl_s: float, secure: bool) -> None:
    """Add the session middleware to ``app``: a fresh Fernet key, the cookie's flags, ``ttl_s``
    (seconds) as both the cookie's Max-Age and the token's accepted age; and the table of sessions
    logged out (:class:`Revoked`)."""
    app[REVOKED_KEY] = Revoked(ttl_s)
    storage = EncryptedCookieStorage(
        Fernet(Fernet.generate_key()),
        cookie_name=COOKIE,
        path="/ui",
        max_age=int(ttl_s),
        httponly=True,
        samesite="Strict",
        secure=secure,
    )
    setup_session(app, storage)


async def csrf_token(request: web.Request) -> str:
    """The session's CSRF token, made (and the session saved) on first use, logged in or not."""
    session = await get_session(request)
    token = session.get(CSRF_FIELD)
    if not isinstance(token, str):
        token = secrets.token_urlsafe(24)
        session[CSRF_FIELD] = token
    return token


async def check_csrf(request: web.Request) -> None:
    """Refuse a POST whose form does not carry this session's CSRF token.

    Raises:
        web.HTTPForbidden: the token is missing or wrong (an old tab, another site's form).
    """
    session = await get_session(request)
    form = await request.post()
    given = str(form.get(CSRF_FIELD, ""))
    want = session.get(CSRF_FIELD)
    if not isinstance(want, str) or not hmac.compare_digest(sent_bytes(given), want.encode()):
        raise web.HTTPForbidden(text="the form has expired or did not come from this dashboard; reload the page")


async def role(request: web.Request) -> Role | None:
    """The logged-in role, or None (not logged in, logged out, or the session's ttl is over).

    The ttl counts from the login (``session["at"]``, unix seconds), not from the cookie's last
    re-issue; a login time in the future (a clock stepped back more than a minute) also ends it.
    While the session lasts, any cookie this request re-issues gets the seconds left as Max-Age.
    """
    session = await get_session(request)
    value = session.get("role")
    if session.get("sid") in request.app[REVOKED_KEY]:
        return None
    at = session.get("at")
    ttl_s = request.app[REVOKED_KEY].ttl_s
    now = time.time()
    if not isinstance(at, (int, float)) or at > now + 60 or now >= at + ttl_s:
        if value is not None:
            session.invalidate()  # the cookie is cleared with this answer
        return None
    session.max_age = max(1, int(at + ttl_s - now))
    return Role(value) if value in (Role.ADMIN.value, Role.VIEWER.value) else None


async def log_in(request: web.Request, as_role: Role) -> None:
    """Start a new session (a new id and CSRF token: no fixation) with ``as_role``."""
    session: Session = await new_session(request)
    session["role"] = as_role.value
    session["sid"] = secrets.token_urlsafe(16)
    session["at"] = time.time()
    session[CSRF_FIELD] = secrets.token_urlsafe(24)


async def log_out(request: web.Request) -> None:
    """End the session: the cookie is cleared and its id refused from now on (:class:`Revoked`)."""
    session = await get_session(request)
    sid = session.get("sid")
    if isinstance(sid, str):
        request.app[REVOKED_KEY].add(sid, time.time())
    session.invalidate()


async def flash(request: web.Request, message: str, *, error: bool = False) -> None:
    """Keep ``message`` for the next page this session shows (after an action's redirect)."""
    session = await get_session(request)
    session["flash"] = {"text": message, "error": error}


async def take_flash(request: web.Request) -> dict[str, object] | None:
    """The message kept by :func:`flash`, once."""
    session = await get_session(request)
    got = session.pop("flash", None)
    return got if isinstance(got, dict) else None
