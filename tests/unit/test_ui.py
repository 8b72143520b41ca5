"""The dashboard over real HTTP on a control plane served in-process (no browser: tests/browser
drives Chromium): login and its cookie, CSRF, the pages' content, actions going through the admin
API's checks, escaping, the read-only role, an expired session, htmx's live parts."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from yarl import URL

from llmgw import tlsconf
from llmgw.protocol import GPU, EngineStatus, Heartbeat, Inventory, ProvisionState
from tests.helpers.control import TOKEN, Install, Served, heartbeat, make_install, serving
from tests.helpers.net import free_port

VIEWER = "viewer-token-for-tests"


@pytest.fixture
def install(tmp_path: Path) -> Install:
    inst = make_install(tmp_path, ui={"session_ttl_s": 600})
    (inst.paths.etc / "viewer-token").write_text(VIEWER + "\n")
    return inst


@pytest.fixture
async def served(install: Install) -> AsyncIterator[Served]:
    async with serving(install) as s:
        async with aiohttp.ClientSession() as c:
            ctx = install.agent_ctx("node-1")
            r = await c.post(install.agent_url + "/agent/v1/register", data=heartbeat(), ssl=ctx)
            assert r.status == 200, await r.text()
            model = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}]}
            big = {"name": "huge", "source": "http://m/huge.gguf",
                   "profiles": [{"name": "cpu", "min_memory_gb": 500}]}
            for m in (model, big):
                r = await c.post(install.admin + "/api/v1/models", json=m, headers={"Authorization": f"Bearer {TOKEN}"})
                assert r.status == 201, await r.text()
        yield s


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html[:500]
    return found.group(1)


async def _login(c: aiohttp.ClientSession, base: str, token: str = TOKEN) -> str:
    r = await c.get(base + "/ui/login")
    r = await c.post(base + "/ui/login", data={"csrf": _csrf(await r.text()), "token": token, "next": ""})
    assert r.status == 200, await r.text()
    return await r.text()


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))  # cookies for 127.0.0.1


async def test_login_cookie_and_the_overview(install: Install, served: Served) -> None:
    base = install.admin
    async with _session() as c:
        r = await c.get(base + "/ui/", allow_redirects=False)
        assert r.status == 303
        assert r.headers["Location"] == "/ui/login"
        r = await c.get(base + "/ui/login")
        csrf = _csrf(await r.text())
        r = await c.post(base + "/ui/login", data={"csrf": csrf, "token": "wrong", "next": ""})
        assert r.status == 401
        page = await r.text()
        assert "that token is not the admin token" in page
        assert "Traceback" not in page
        r = await c.post(base + "/ui/login", data={"csrf": csrf, "token": TOKEN, "next": ""}, allow_redirects=False)
        assert r.status == 303
        assert r.headers["Location"] == "/ui/"
        cookie = next(c for c in r.headers.getall("Set-Cookie") if c.startswith("llmgw_ui="))  # and the device's
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert "Path=/ui" in cookie
        assert "Max-Age=600" in cookie
        r = await c.get(base + "/ui/")
        page = await r.text()
        assert r.status == 200
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        assert r.headers["Cache-Control"] == "no-store"
        assert '<a href="/ui/nodes/node-1">node-1</a>' in page
        assert '<a href="/ui/models/chat">chat</a>' in page
        assert "huge</a>: not placed" in page  # "Needs a look"
        assert "4 cores" in page or "of 4 cores reserved" in page
        # The live part alone, as htmx polls it.
        r = await c.get(base + "/ui/?part=live", headers={"HX-Request": "true"})
        live = await r.text()
        assert "<html" not in live
        assert "node-1" in live


async def test_the_explanation_and_the_escaping(install: Install, served: Served) -> None:
    base = install.admin
    async with _session() as c:
        await _login(c, base)
        for _ in range(50):  # the leader evaluates new models within a pass
            page = await (await c.get(base + "/ui/models/huge")).text()
            if "NOT placed" in page and "would fit if" in page:
                break
            await asyncio.sleep(0.1)
        assert "huge: NOT placed</strong> (0/1 replicas)" in page
        assert "0/1 nodes can run it: 1 node with too little memory" in page
        assert "<td>cpu</td><td>node-1</td><td>filtered</td><td>needs 500.0 GB memory, the node has 8.0 GB" in page
        assert "would fit if: node-1 is too small (8.0 GB memory in all, needs 500.0)" in page
        r = await c.get(base + "/ui/models/%3Cscript%3Ealert(1)%3C%2Fscript%3E")
        page = await r.text()
        assert r.status == 404
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
        assert "<script>alert" not in page


async def test_actions_need_csrf_and_pass_the_api_checks(install: Install, served: Served) -> None:
    base = install.admin
    async with _session() as c:
        page = await _login(c, base)
        csrf = _csrf(page)
        r = await c.post(base + "/ui/nodes/node-1/cordon", data={"csrf": "forged"})
        assert r.status == 403
        assert "did not come from this dashboard" in await r.text()
        r = await c.post(base + "/ui/nodes/node-1/cordon", data={"csrf": csrf},
                         headers={"Referer": base + "/ui/nodes/node-1"})
        page = await r.text()
        assert r.status == 200
        assert "node node-1 cordoned" in page
        assert '<span class="state state-cordoned">cordoned</span>' in page
        r = await c.post(base + "/ui/nodes/node-1/uncordon", data={"csrf": csrf})
        assert "schedulable" in await r.text()
        # An action's message waits for the page: an htmx poll or a browser's image fetch that fails
        # in between (an error page) no longer takes it (a cordon's "cordoned" went missing so).
        async with c.post(base + "/ui/nodes/node-1/cordon", data={"csrf": csrf}, allow_redirects=False) as r:
            assert r.status == 303
        for headers in ({"HX-Request": "true"}, {"Sec-Fetch-Dest": "image"}):
            async with c.get(base + "/ui/nodes/no-such-node?part=live", headers=headers) as r:
                assert r.status == 404
                assert "cordoned" not in await r.text()
        r = await c.get(base + "/ui/nodes/node-1", headers={"Sec-Fetch-Dest": "document"})
        assert "node node-1 cordoned" in await r.text()
        r = await c.post(base + "/ui/nodes/node-1/uncordon", data={"csrf": csrf})
        assert "schedulable" in await r.text()
        # A drain of the only node: it said "replicas moved" while they waited for room (a new user's finding).
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for _ in range(100):  # chat placed on node-1 again since the uncordon (a leader pass)
            async with c.get(base + "/api/v1/replicas", headers=auth) as got:
                if any(x["model"] == "chat" and x["node"] == "node-1" for x in await got.json()):
                    break
            await asyncio.sleep(0.05)
        r = await c.post(base + "/ui/nodes/node-1/drain", data={"csrf": csrf})
        page = await r.text()
        assert "node node-1 drained (cordoned; its replicas stopped, placed again where they fit); no other " \
               "node can take the replicas of chat now: see their pages" in page, page
        assert 'class="flash error"' in page
        r = await c.post(base + "/ui/nodes/node-1/uncordon", data={"csrf": csrf})
        assert "schedulable" in await r.text()
        # The admin API's own 400 comes back as the page's message.
        r = await c.post(base + "/ui/models/chat/scale", data={"csrf": csrf, "min": "5000"},
                         headers={"Referer": base + "/ui/models/chat"})
        page = await r.text()
        assert 'class="flash error"' in page
        assert "more than this cluster&#39;s limit of 1000" in page
        r = await c.post(base + "/ui/models/chat/scale", data={"csrf": csrf, "min": "two"})
        assert "&#39;two&#39; is not a whole number" in await r.text()
        r = await c.post(base + "/ui/models/chat/scale", data={"csrf": csrf, "min": "2"})
        assert "chat: 2 replica(s) wanted" in await r.text()
        async with c.get(install.admin + "/api/v1/models/chat", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert (await r.json())["scaling_min"] == 2


async def test_viewer_is_read_only_and_sessions_expire(tmp_path: Path) -> None:
    install = make_install(tmp_path, ui={"session_ttl_s": 2})
    (install.paths.etc / "viewer-token").write_text(VIEWER + "\n")
    base = install.admin
    async with serving(install), _session() as c:
        r = await c.post(install.agent_url + "/agent/v1/register", data=heartbeat(), ssl=install.agent_ctx("node-1"))
        assert r.status == 200
        page = await _login(c, base, VIEWER)
        logged_in = time.time()  # the session's login time (its "at", by this same clock) is before this
        assert "viewer" in page
        assert "Cordon" not in (await (await c.get(base + "/ui/nodes/node-1")).text())
        r = await c.post(base + "/ui/nodes/node-1/cordon", data={"csrf": _csrf(page)})
        assert r.status == 403
        assert "read-only" in await r.text()
        # ui.session_ttl_s: 2, counted from the login by the server's time.time(); 0.1 s past it, not a
        # fixed 3.1 s from here (the cookie, re-issued by each request, carries the login time along).
        await asyncio.sleep(max(0.0, logged_in + 2 + 0.1 - time.time()))
        r = await c.get(base + "/ui/nodes/node-1", allow_redirects=False)
        assert r.status == 303
        assert r.headers["Location"].startswith("/ui/login?next=")
        r = await c.get(base + "/ui/?part=live", headers={"HX-Request": "true"})
        assert r.status == 401
        assert r.headers["HX-Redirect"] == "/ui/login"


async def test_the_guard_page_names_each_policys_judges_and_what_to_do(tmp_path: Path) -> None:
    inst = make_install(tmp_path, guard={"policies": [{"name": "strict", "judge": ["qwen3guard-0.6b"],
                                                       "check": ["in", "out"], "fail": "closed"}]})
    async with serving(inst), _session() as c:
        await _login(c, inst.admin)
        page = await (await c.get(inst.admin + "/ui/guard")).text()
    assert "Guardrails are off" not in page
    assert "<h3>Policy strict</h3>" in page
    assert "Checks in and out" in page
    assert "on judge failure: closed" in page
    assert "<td>qwen3guard-0.6b</td>" in page
    assert "<code>llmgw ctl guard judge enable qwen3guard-0.6b</code>" in page  # not in the catalog yet


async def test_guard_and_keys_pages(install: Install, served: Served) -> None:
    base = install.admin
    async with _session() as c:
        await _login(c, base)
        r = await c.post(install.admin + "/api/v1/keys", json={"name": "alice", "rpm": 60, "priority": 4},
                         headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status == 201
        page = await (await c.get(base + "/ui/keys")).text()
        assert "<td>alice</td>" in page
        assert "60 rpm </td><td>4</td>" in page  # limits, then priority
        data = await (await c.get(base + "/ui/usage.json?days=7")).json()
        assert len(data["days"]) == 7
        assert data["series"] == {}
        page = await (await c.get(base + "/ui/guard")).text()
        assert "Guardrails are off" in page


async def test_a_gpu_nodes_cards_each_get_a_bar_and_a_row(install: Install, served: Served) -> None:
    gb = 10**9  # the dashboard shows GB, as ctl nodes does (it showed GiB: a new user's finding)
    cards = [GPU(index=i, name="NVIDIA L4", klass="l4-24gb", memory_total_bytes=24 * gb,
                 memory_used_bytes=(6 if i else 12) * gb) for i in range(2)]
    beat = Heartbeat(
        inventory=Inventory(cores=16, memory_total_bytes=64 * gb, memory_available_bytes=60 * gb, gpus=cards),
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
    ).model_dump_json()
    async with _session() as c:
        r = await c.post(install.agent_url + "/agent/v1/register", data=beat, ssl=install.agent_ctx("gpu-1"))
        assert r.status == 200, await r.text()
        await _login(c, install.admin)
        page = await (await c.get(install.admin + "/ui/nodes/gpu-1")).text()
    assert 'aria-label="GPU 0 (NVIDIA L4): 12.0 of 24.0 GB in use"' in page
    assert 'aria-label="GPU 1 (NVIDIA L4): 6.0 of 24.0 GB in use"' in page
    assert "<td>1</td><td>NVIDIA L4</td><td>l4-24gb</td><td>6.0 GB</td><td>24.0 GB</td>" in page
    assert "16 cores, 64.0 GB memory (60.0 GB available)" in page


async def test_the_admin_api_still_wants_its_token(install: Install, served: Served) -> None:
    async with _session() as c:
        await _login(c, install.admin)
        r = await c.get(install.admin + "/api/v1/nodes")  # the UI cookie is not an admin token
        assert r.status == 401
    async with httpx.AsyncClient() as h:  # a token of bytes that are not UTF-8 is a wrong one, not a 500
        r2 = await h.get(install.admin + "/api/v1/nodes", headers=[(b"authorization", b"Bearer \xff\xfe")])
        assert r2.status_code == 401, r2.text
        assert r2.json()["error"]["code"] == "unauthorized"


async def test_ui_listen_serves_the_dashboard_alone_over_tls(tmp_path: Path) -> None:
    port = free_port()
    inst = make_install(tmp_path, ui={"listen": f"127.0.0.1:{port}"})
    base = f"https://127.0.0.1:{port}"
    ctx = tlsconf.client_context(inst.paths.pki / "ca.pem")  # the cluster CA signs the server certificate
    async with serving(inst), _session() as c:
        r = await c.get(base + "/", ssl=ctx)
        assert r.status == 200
        assert r.url.path == "/ui/login"
        r = await c.post(base + "/ui/login", data={"csrf": _csrf(await r.text()), "token": TOKEN, "next": ""},
                         ssl=ctx, allow_redirects=False)
        assert r.status == 303
        assert "Secure" in r.headers["Set-Cookie"]
        r = await c.get(base + "/ui/", ssl=ctx)
        assert r.status == 200
        assert "<h1>Overview</h1>" in await r.text()
        r = await c.get(base + "/api/v1/nodes", ssl=ctx)  # only the dashboard is on this listener
        assert r.status == 404
        with pytest.raises(aiohttp.ClientError):
            await c.get(f"http://127.0.0.1:{port}/ui/login")  # TLS only


async def test_every_live_part_answers_and_odd_input_is_no_500(install: Install, served: Served) -> None:
    base = install.admin
    async with _session() as c:
        await _login(c, base)
        for path in ("/ui/", "/ui/models/chat", "/ui/nodes/node-1", "/ui/guard", "/ui/keys"):
            r = await c.get(base + path + "?part=live", headers={"HX-Request": "true"})
            assert r.status == 200, (path, await r.text())
        live = await (await c.get(base + "/ui/models/chat?part=live")).text()
        assert '<th scope="col">Action</th>' in live  # the live part knows an admin looks at it
        # Unicode digits pass str.isdigit() but not int(): the default range, not a 500.
        r = await c.get(base + "/ui/usage.json?days=%C2%B2")
        assert r.status == 200
        assert len((await r.json())["days"]) == 14
        page = await _login(c, base)
        r = await c.post(base + "/ui/models/chat/scale", data={"csrf": _csrf(page), "min": "²"})
        assert "is not a whole number" in await r.text()
        # '.' and '..' would make another admin API path: they name nothing.
        for path in ("/ui/models/%2e%2e", "/ui/replicas/%2e%2e/log", "/ui/nodes/%2e"):
            r = await c.get(base + path)
            assert r.status in (200, 404), path  # the log fragment says so in place (200)
            assert "/api/v1/" not in await r.text(), path


async def test_a_cookie_copied_before_logout_is_refused_after_it(install: Install, served: Served) -> None:
    base = install.admin
    async with _session() as c:
        page = await _login(c, base)
        copied = {k: v.value for k, v in c.cookie_jar.filter_cookies(URL(base + "/ui/")).items()}
        r = await c.post(base + "/ui/logout", data={"csrf": _csrf(page)}, allow_redirects=False)
        assert r.status == 303
    async with aiohttp.ClientSession(cookies=copied) as replay:
        r = await replay.get(base + "/ui/keys", allow_redirects=False)
        assert r.status == 303
        assert r.headers["Location"].startswith("/ui/login")
        r = await replay.post(base + "/ui/nodes/node-1/cordon", data={"csrf": _csrf(page)}, allow_redirects=False)
        assert r.status == 303
    async with c_admin(install) as api:
        node = await (await api.get(base + "/api/v1/nodes")).json()
    assert node[0]["cordoned"] is False


def c_admin(install: Install) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"})
