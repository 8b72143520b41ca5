"""The client edge: the one reading of an error answer (errors.error_fields) over the shapes
llmgw's own servers send and what else can stand between (a proxy's page, an empty body); and the
dashboard's admin API client over real HTTP (an error answer is an ApiError with its code, no answer
an UnreachableError as in every other client, not an ApiError of status 0)."""

from __future__ import annotations

import pytest
from aiohttp import web

from llmgw.control.ui.adminapi import AdminApi
from llmgw.errors import ApiError, UnreachableError, error_fields
from llmgw.httperrors import error_json
from tests.helpers.net import free_port


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ('{"error": {"code": "node_busy", "message": "2 replicas run there"}}', ("node_busy", "2 replicas run there")),
        (b'{"error": {"message": "no such model", "type": "invalid_request_error", "param": null, '
         b'"code": "model_not_found"}}', ("model_not_found", "no such model")),
        ({"error": {"message": "rate limited", "code": None}}, ("", "rate limited")),
        ('{"error": "plain text error"}', ("", "plain text error")),
        ("<html><body>502 Bad Gateway</body></html>\n", ("", "<html><body>502 Bad Gateway</body></html>")),
        ("", ("", "")),
        ('["not", "an", "envelope"]', ("", '["not", "an", "envelope"]')),
        (None, ("", "")),
    ],
)
def test_error_fields_reads_both_envelopes_and_anything_else(body: object, want: tuple[str, str]) -> None:
    assert error_fields(body) == want


def test_error_fields_cuts_a_long_page() -> None:
    assert error_fields("x" * 5000, limit=300) == ("", "x" * 300)


async def test_the_dashboards_client_raises_api_error_with_the_code_and_unreachable_when_down() -> None:
    async def refuse(_: web.Request) -> web.Response:
        return error_json(409, "node_busy", "2 replicas run on node-1; pass force")

    app = web.Application()
    app.router.add_get("/api/v1/nodes", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    api = AdminApi(lambda: f"http://127.0.0.1:{port}", "t")
    try:
        with pytest.raises(ApiError) as e:
            await api.get("/api/v1/nodes")
        want = (409, "node_busy", "2 replicas run on node-1; pass force")
        assert (e.value.status, e.value.code, str(e.value)) == want
        await runner.cleanup()
        with pytest.raises(UnreachableError, match="does not answer"):
            await api.get("/api/v1/nodes")
    finally:
        await api.close()
        await runner.cleanup()


def test_an_unreachable_admin_api_names_the_check_for_where_it_is() -> None:
    """``llmgw ctl --server https://other:9090`` that got no answer said to run ``llmgw service status``
    here (a new user's report, 2026-12-04): on loopback that is the check; elsewhere, that machine's."""
    from llmgw.adminclient import AdminClient  # noqa: PLC0415

    here = AdminClient(f"http://127.0.0.1:{free_port()}", "t", timeout_s=2)
    with pytest.raises(UnreachableError, match=r"; check it with 'llmgw service status'$"):
        here.get("/api/v1/models")
    there = AdminClient("http://192.0.2.1:9", "t", timeout_s=0.2)  # TEST-NET-1: never answers
    with pytest.raises(UnreachableError, match=r"check the URL, and 'llmgw service status' on that machine$"):
        there.get("/api/v1/models")


def test_an_answer_that_is_not_llmgws_says_the_url_may_be_wrong() -> None:
    """A new user's finding: ``llmgw ctl --server`` pointed at a server that is not llmgw's admin API
    printed a bare ``Error: GET /api/v1/models: 404 ``. Every answer of that API carries an error code:
    one without says the URL may not be a control plane's; llmgw's own errors read as before."""
    from llmgw.adminclient import AdminClient  # noqa: PLC0415
    from tests.helpers.gateway import ServerThread  # noqa: PLC0415

    async def llmgw_like(_: web.Request) -> web.Response:
        return error_json(409, "node_busy", "2 replicas run on node-1; pass force")

    other, ours = web.Application(), web.Application()  # aiohttp's own 404 page; llmgw's envelope
    ours.router.add_get("/api/v1/nodes", llmgw_like)
    servers = ServerThread()
    try:
        stranger = AdminClient(f"http://127.0.0.1:{servers.serve(other)}", "t", timeout_s=5)
        with pytest.raises(ApiError) as e:
            stranger.get("/api/v1/models")
        assert str(e.value) == (f"GET /api/v1/models: 404 404: Not Found; that is not an answer of llmgw's admin "
                                f"API: is {stranger.base_url} a control plane's admin_listen (server.yaml)?")
        admin = AdminClient(f"http://127.0.0.1:{servers.serve(ours)}", "t", timeout_s=5)
        with pytest.raises(ApiError) as e:
            admin.get("/api/v1/nodes")
        assert str(e.value) == "GET /api/v1/nodes: 409 2 replicas run on node-1; pass force"
    finally:
        servers.close()
