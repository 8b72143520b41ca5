"""``GET /v1/models`` leaves a trace like any other request (it left none: a new user's finding,
carried since): a real control plane (``serve`` in-process, SQLite) answers the list and a model not
found on its real gateway listener; each gets an access-log line ``kind=models`` and a count in
``llmgw_gateway_requests_total`` (model ``-`` for the list), and neither is usage, which counts model
calls: a chat to an unknown model, sent alongside, is."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest

from tests.helpers.control import TOKEN, make_keyed_install, serving
from tests.helpers.waits import until
from tests.unit.test_metrics import _samples

AUTH = {"Authorization": f"Bearer {TOKEN}"}
SECRET = "sk-llmgw-models-0123456789abcdefghijklmnopqrstuvwxyzABCDEF"


async def test_model_listings_are_logged_and_counted_but_are_not_usage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.access")
    inst = make_keyed_install(tmp_path, SECRET)
    gw = f"http://127.0.0.1:{inst.ports['gateway']}"
    key = {"Authorization": f"Bearer {SECRET}"}
    async with serving(inst), aiohttp.ClientSession() as s:
        async with s.get(gw + "/v1/models", headers={**key, "x-request-id": "list-1"}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["object"] == "list"
        async with s.get(gw + "/v1/models/nope", headers=key) as r:
            assert r.status == 404
        body = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
        async with s.post(gw + "/v1/chat/completions", json=body, headers=key) as r:
            assert r.status == 404

        async def usage() -> list[dict[str, int]]:
            async with s.get(inst.admin + "/api/v1/usage?key=keys-file", headers=AUTH) as r:
                return await r.json()

        rows = await until("the chat's usage is written (every 0.5 s)", usage, within_s=5)
        async with s.get(inst.admin + "/metrics") as r:
            page = await r.text()
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.access"]
    listed = [ln for ln in lines if "kind=models" in ln]
    assert len(listed) == 2, lines
    assert "request_id=list-1 key=keys-file kind=models model=- replica=- status=200" in listed[0]
    assert "status=404" in listed[1]
    assert "code=model_not_found" in listed[1]
    got = _samples(page)
    requests = {(dict(labels)["kind"], dict(labels)["status"]): value for (name, labels), value in got.items()
                if name == "llmgw_gateway_requests_total" and dict(labels)["model"] == "-"}
    assert requests == {("models", "200"): 1, ("models", "404"): 1}, requests
    assert sum(row["requests"] for row in rows) == 1, rows  # the chat only
