"""Requests refused for their key leave a trace: a real control plane (``serve`` in-process, SQLite)
answers 401s on its real gateway listener over HTTP, and each one gets an access-log line
(``key=invalid`` or ``key=missing``, never the presented secret) and a count in
``llmgw_gateway_refused_keys_total{reason}`` on ``GET /metrics``, whose label values are a fixed set
whatever the client sends."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest

from tests.helpers.control import make_install, serving
from tests.unit.test_metrics import _samples

WRONG = "sk-llmgw-guessed-0123456789abcdefghijklmnopqrstuvwxyzABCD"


async def test_refused_keys_are_logged_and_counted_without_the_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.access")
    inst = make_install(tmp_path)
    inst.write(gateway={"listen": f"127.0.0.1:{inst.ports['gateway']}", "allow_loopback_without_key": False})
    gw = f"http://127.0.0.1:{inst.ports['gateway']}"
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    async with serving(inst), aiohttp.ClientSession() as s:
        statuses = []
        for i in range(5):  # five different wrong keys: still one label value
            headers = {"Authorization": f"Bearer {WRONG}{i}", "x-request-id": f"guess-{i}"}
            async with s.post(gw + "/v1/chat/completions", json=body, headers=headers) as r:
                statuses.append(r.status)
        async with s.get(gw + "/v1/models", headers={"x-api-key": WRONG}) as r:
            statuses.append(r.status)
        async with s.post(gw + "/v1/embeddings", json={"model": "e", "input": "x"}) as r:  # no key
            statuses.append(r.status)
        async with s.get(inst.admin + "/metrics") as r:
            page = await r.text()
    assert statuses == [401] * 7
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.access"]
    assert len(lines) == 7, lines
    assert all("status=401" in ln and "code=invalid_api_key" in ln for ln in lines)
    assert sum("key=invalid kind=chat" in ln for ln in lines) == 5
    assert any("request_id=guess-3 key=invalid" in ln for ln in lines)
    assert sum("key=invalid kind=models" in ln for ln in lines) == 1
    assert sum("key=missing kind=embeddings" in ln for ln in lines) == 1
    assert WRONG[9:25] not in caplog.text  # no part of a presented key is logged
    got = _samples(page)
    assert got[("llmgw_gateway_refused_keys_total", frozenset({"reason": "invalid"}.items()))] == 6
    assert got[("llmgw_gateway_refused_keys_total", frozenset({"reason": "missing"}.items()))] == 1
    assert WRONG[9:25] not in page
    assert not any(name == "llmgw_gateway_requests_total" and dict(labels).get("status") == "401"
                   for name, labels in got)
