"""The admin API's guard routes over real HTTP, with a real SQLite store and the fake judge."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import httpx
import pytest
from aiohttp import web

from llmgw.control.api.admin import build_admin_app
from llmgw.control.api.guard import add_guard_routes, guard_status
from llmgw.control.gateway.guard import GuardInspector
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.guard.config import GuardConfig, Policy
from llmgw.guard.judge import JudgeClient, JudgeRoute
from llmgw.routing import Upstream
from llmgw.serverinit import plan
from tests.helpers.gateway import JUDGE_KEY, FakeJudge, ServerThread


@dataclass
class Env:
    url: str
    store: Store


@pytest.fixture
def env(store: Store) -> Iterator[Env]:
    servers = ServerThread()
    store.add_model(plan.guard_model("http://m/q.gguf", 1, 2), now=1.0)
    jport = servers.serve(FakeJudge().app())
    judge = JudgeRoute("qwen3guard-0.6b", "qwen3guard", (Upstream("j-1", f"127.0.0.1:{jport}", JUDGE_KEY),))
    config = GuardConfig(policies=[Policy(name="default", judge=["qwen3guard-0.6b", "qwen3guard-4b", "mine"])])
    guard = GuardInspector(config, JudgeClient({"qwen3guard-0.6b": judge}.get))
    app = web.Application()
    add_guard_routes(app, inspector=guard, config=config, store=store, serve=None, db=OffLoop())
    port = servers.serve(app)
    yield Env(f"http://127.0.0.1:{port}", store)
    servers.run(guard.client.close())
    servers.close()


def test_status_says_what_to_do_for_each_judge(env: Env) -> None:
    data = httpx.get(f"{env.url}/api/v1/guard/status").json()
    assert data["on"] is True
    (p,) = data["policies"]
    by = {j["name"]: j for j in p["judges"]}
    assert by["qwen3guard-0.6b"]["in_catalog"] is True
    assert by["qwen3guard-0.6b"]["format"] == "qwen3guard"
    assert by["qwen3guard-0.6b"]["hint"] == "llmgw ctl explain-placement qwen3guard-0.6b"
    assert by["qwen3guard-4b"]["hint"] == "llmgw ctl guard judge enable qwen3guard-4b"
    assert "--repo" in by["mine"]["hint"]


def test_guard_test_gives_verdict_categories_and_time(env: Env) -> None:
    r = httpx.post(f"{env.url}/api/v1/guard/test", json={"text": "a bomb", "direction": "in"}).json()
    want = ("unsafe", ["Violent"], "block", "qwen3guard-0.6b")
    assert (r["verdict"], r["categories"], r["decision"], r["judge"]) == want
    assert r["ms"] >= 0
    r = httpx.post(f"{env.url}/api/v1/guard/test", json={"text": "garbage"}).json()
    assert r["kind"] == "unparseable"
    assert r["decision"] == "fail closed"
    assert r["raw"] == "I am not sure about this one."
    r = httpx.post(f"{env.url}/api/v1/guard/test", json={"text": "fine", "direction": "out", "prompt": "q"}).json()
    assert (r["verdict"], r["refusal"]) == ("safe", False)
    (judge, *_) = httpx.get(f"{env.url}/api/v1/guard/status").json()["policies"][0]["judges"]
    assert judge["queue"]["in_flight"] == 0
    assert judge["queue"]["waiting"] == 0
    assert judge["queue"]["mean_ms"] > 0  # the running judgment time admission estimates with
    assert httpx.post(f"{env.url}/api/v1/guard/test", json={"nope": 1}).status_code == 400
    assert httpx.post(f"{env.url}/api/v1/guard/test", json={"text": "x", "policy": "zz"}).status_code == 404


def test_enable_without_a_mirror_is_refused(env: Env) -> None:
    r = httpx.post(f"{env.url}/api/v1/guard/judges/qwen3guard-4b/enable", json={})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "no_mirror"


def test_status_when_off(env: Env) -> None:
    assert guard_status(None, GuardConfig(), env.store) == {"on": False, "policies": [], "stats": {}}


def test_guard_status_answers_503_when_the_store_does_not(store: Store) -> None:
    """The guard routes' store calls go through the admin API's off-loop pool and its deadline: a
    store that does not answer (a write stuck behind an orphaned primary, say) makes
    ``GET /api/v1/guard/status`` a 503 ``store_unavailable`` within the deadline, as every other
    admin route. It ran on ``asyncio.to_thread`` before, with no deadline, and waited as long as the
    store did. (The stuck store is the real SQLite store with one call held on an event.)"""
    release = threading.Event()

    class Stuck:
        def __getattr__(self, name: str) -> object:
            return getattr(store, name)

        def list_models(self) -> object:
            release.wait(10)
            return store.list_models()

    stuck = cast(Store, Stuck())
    db = OffLoop(deadline_s=0.3)
    app = build_admin_app(stuck, token="t0ken", db=db)
    add_guard_routes(app, inspector=None, config=GuardConfig(), store=stuck, serve=None, db=db)
    servers = ServerThread()
    try:
        port = servers.serve(app)
        t0 = time.monotonic()
        r = httpx.get(f"http://127.0.0.1:{port}/api/v1/guard/status", headers={"Authorization": "Bearer t0ken"})
        took = time.monotonic() - t0
        assert (r.status_code, r.json()["error"]["code"]) == (503, "store_unavailable")
        assert took < 3
    finally:
        release.set()
        servers.close()
        db.close()  # waits for the held call, so the store is not closed under it


def test_enable_with_a_source_the_mirror_would_refuse_is_a_400_before_any_job(store: Store) -> None:
    """A new user's finding: ``ctl guard judge enable x --repo ../../etc --file passwd`` printed
    'fetching hf:../../etc/passwd as x (job serve-1)' while the mirror had refused it at once, and
    'judge status' never showed it. The source is checked first: a 400 naming what is wrong, no job.
    (The job starter here is a stand-in that fails the test if it is called: nothing reaches it.)"""

    class NoJob:
        def start(self, *_: object, **__: object) -> object:
            raise AssertionError("a job was started for a source the mirror refuses")

    servers = ServerThread()
    try:
        app = web.Application()
        add_guard_routes(app, inspector=None, config=GuardConfig(), store=store, serve=NoJob(),  # type: ignore[arg-type]
                         db=OffLoop())
        url = f"http://127.0.0.1:{servers.serve(app)}/api/v1/guard/judges/x/enable"
        r = httpx.post(url, json={"repo": "../../etc", "file": "passwd"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_source"
        assert "'.' and '..' are not allowed in an hf: path" in r.json()["error"]["message"]
    finally:
        servers.close()


def test_judge_status_through_the_cli_prints_counts_not_python_dicts(env: Env) -> None:
    """A new user's finding: the status footer printed ``blocked {'in': 2}, ... judge errors {'timeout': 2}``."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from llmgw.cli.main import app  # noqa: PLC0415

    r = CliRunner().invoke(app, ["ctl", "guard", "judge", "status", "--server", env.url, "--token", "t" * 32])
    assert r.exit_code == 0, r.output
    assert "blocked 0, unjudged (fail open) 0, refused for no verdict 0, judge errors 0" in r.output
    assert "{" not in r.output


def test_status_of_a_policy_naming_a_chat_model_says_it_is_not_a_guard_model(store: Store) -> None:
    """A new user's finding: ``judge: gemma`` (the starter's alias) showed ``CATALOG no`` and 'llmgw ctl
    guard judge enable gemma --repo ORG/REPO --file FILE.gguf', which then answered "llmgw does not know
    'gemma'"; the model was in the catalog, as a chat model. Now it says what it is."""
    from llmgw.catalog import Model  # noqa: PLC0415

    store.add_model(Model(name="chat-m", aliases=["cm"], source="http://m/c.gguf", profiles=[{"name": "cpu"}]),
                    now=1.0)
    data = guard_status(None, GuardConfig(policies=[Policy(name="p", judge=["cm", "chat-m"])]), store)
    by = {j["name"]: j for j in data["policies"][0]["judges"]}
    assert by["cm"]["in_catalog"] is True
    assert by["cm"]["hint"] == ("'cm' is an alias of the chat model 'chat-m', not a guard model: name one in the "
                                "policy (llmgw ctl guard judge enable)")
    assert by["chat-m"]["hint"].startswith("'chat-m' is a chat model, not a guard model")


@pytest.mark.parametrize(("args", "says"), [
    (["some answer", "--prompt", "p"], "--prompt is the prompt an answer answers: give it with --out"),
    (["  "], "the text to judge is empty"),
])
def test_guard_test_refuses_what_it_would_drop_or_judge_as_nothing(args: list[str], says: str) -> None:
    """A new user's findings: ``guard test --prompt p x`` (no ``--out``) dropped the prompt without a
    word, and ``guard test ""`` was judged safe. Refused before any call (exit 2)."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from llmgw.cli.main import app  # noqa: PLC0415

    r = CliRunner().invoke(app, ["ctl", "guard", "test", *args, "--server", "http://127.0.0.1:9", "--token", "t" * 32])
    assert r.exit_code == 2, r.output
    assert says in " ".join(r.output.replace("│", " ").split())
