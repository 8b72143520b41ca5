"""Where the dashboard is served: on the admin app at ``/ui`` (always), and as an app of its own for
``ui.listen`` (over TLS with the server certificate).

``/ui`` and, on the dashboard's own listener, ``/`` redirect to ``/ui/``.
"""

from __future__ import annotations

from aiohttp import web

PREFIX = "/ui"


async def _to_ui(_: web.Request) -> web.StreamResponse:
    raise web.HTTPFound(PREFIX + "/")


def mount_ui(admin: web.Application, ui: web.Application) -> None:
    """Mount the dashboard ``ui`` (:func:`llmgw.control.ui.app.build_ui_app`) at ``/ui/`` on the
    admin app (whose token check lets ``/ui`` through: the dashboard checks its own session)."""
    admin.router.add_get(PREFIX, _to_ui)
    admin.add_subapp(PREFIX, ui)


def ui_site(ui: web.Application) -> web.Application:
    """An app holding only the dashboard (for ``ui.listen``): ``/`` and ``/ui`` go to ``/ui/``."""
    root = web.Application()
    root.router.add_get("/", _to_ui)
    mount_ui(root, ui)
    return root
