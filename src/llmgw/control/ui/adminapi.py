"""The admin API as the dashboard calls it: async, over loopback HTTP, with the admin token.

The dashboard never reads the store itself: every page is built from what ``llmgw ctl`` would see
and every action is the admin API's own route, so its checks (400s, 409s) hold for the UI too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp

from llmgw.errors import ApiError, UnreachableError, error_fields

TIMEOUT_S = 15.0  # the admin API's own slowest answers (a log read through an agent) end at 10 s


class AdminApi:
    """Calls ``base_url()`` + ``/api/v1/...`` with ``Authorization: Bearer <token>``.

    ``base_url`` is read at each call (the admin listener's port is known once it is bound:
    ``:0`` in tests). One aiohttp session, opened on first use; :meth:`close` it on shutdown.
    """

    def __init__(self, base_url: Callable[[], str], token: str) -> None:
        self._base = base_url
        self._token = token
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None) -> Any:
        """The decoded JSON of ``method path`` (None for an empty answer).

        Raises:
            ApiError: the API answered 4xx/5xx (its ``code`` and message).
            UnreachableError: it did not answer (the page shows a 502).
        """
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))
        url = self._base().rstrip("/") + path
        try:
            async with self._session.request(
                method, url, json=body, params=query, headers={"Authorization": f"Bearer {self._token}"}
            ) as r:
                text = await r.text()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise UnreachableError(f"the admin API at {url} does not answer ({e.__class__.__name__})") from e
        if status >= 400:
            code, message = error_fields(text)
            raise ApiError(message or f"HTTP {status}", status=status, code=code)
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return None

    async def get(self, path: str, **query: str) -> Any:
        """``GET path`` with ``query``; see :meth:`call`."""
        return await self.call("GET", path, query=query or None)

    async def post(self, path: str, body: Any = None) -> Any:
        """``POST path`` with a JSON body; see :meth:`call`."""
        return await self.call("POST", path, {} if body is None else body)
