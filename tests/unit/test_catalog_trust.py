"""What may enter the catalog, over the real admin API on 127.0.0.1.

Profile args that make an engine (root on a node) touch files anywhere; scaling values that make
one GET build millions of rows; numbers that are stored as null and poison every later read; and
a broken row written straight into SQLite, after which the admin API, the agent API (real mTLS)
and the gateway must go on serving everything else.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from llmgw import tlsconf
from llmgw.catalog import Model
from llmgw.cli.ctl import app as ctl_app
from llmgw.config import ServerConfig
from llmgw.control.api.admin import build_admin_app
from llmgw.control.api.agent import build_agent_app
from llmgw.control.gateway.app import build_gateway_app
from llmgw.control.gateway.table import StoreRouter
from llmgw.control.store import ReplicaRow, Store, open_store
from llmgw.engineargs import refused_args
from llmgw.protocol import (
    EngineStatus,
    Heartbeat,
    HeartbeatReply,
    Inventory,
    ProvisionState,
    ReplicaState,
    ReplicaStatus,
)
from tests.conftest import Assets
from tests.helpers.gateway import ServerThread, fake_llama

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GB = 1_000_000_000


def model(name: str = "chat", **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name,
        "source": f"http://mirror:8081/{name}/1/{name}.gguf",
        "scaling": {"min": 1, "max": 1},
        "profiles": [{"name": "cpu", "min_memory_gb": 1, "args": ["--ctx-size", "4096"]}],
    }
    doc.update(over)
    return doc


@dataclass
class Admin:
    url: str
    store: Store
    servers: ServerThread

    def post(self, path: str, body: Any) -> httpx.Response:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=raw, headers=AUTH, timeout=60)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=AUTH, timeout=60)


@pytest.fixture
def admin(store: Store) -> Iterator[Admin]:
    servers = ServerThread()
    port = servers.serve(build_admin_app(store, token=TOKEN, max_replicas_per_model=1000))
    yield Admin(f"http://127.0.0.1:{port}", store, servers)
    servers.close()


def error_of(resp: httpx.Response, status: int) -> dict[str, str]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    return body["error"]  # type: ignore[no-any-return]


# --- profile args ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "args", "flag", "why"),
    [
        ("llamacpp", ["--log-file", "/etc/cron.d/x"], "--log-file", "write files"),
        ("llamacpp", ["--log-file=/etc/cron.d/x"], "--log-file=/etc/cron.d/x", "write files"),
        ("llamacpp", ["--log_file", "/etc/x"], "--log_file", "write files"),
        ("llamacpp", ["--slot-save-path", "/"], "--slot-save-path", "write files"),
        ("llamacpp", ["--ctx-size", "4096", "--lora", "/root/.ssh/id_rsa"], "--lora", "read a file"),
        ("llamacpp", ["-m", "/etc/shadow"], "-m", "the agent sets it"),
        ("llamacpp", ["-mm", "/etc/shadow"], "-mm", "read a file"),
        ("llamacpp", ["--api-key-file", "/etc/shadow"], "--api-key-file", "the agent sets it"),
        ("llamacpp", ["--host", "0.0.0.0"], "--host", "the agent sets it"),
        ("llamacpp", ["--port=80"], "--port=80", "the agent sets it"),
        ("llamacpp", ["--grammar-file", "/etc/passwd"], "--grammar-file", "read a file"),
        ("llamacpp", ["-jf", "/etc/passwd"], "-jf", "read a file"),
        ("llamacpp", ["--chat-template-file", "/etc/passwd"], "--chat-template-file", "read a file"),
        ("llamacpp", ["--ssl-key-file", "/k"], "--ssl-key-file", "read a file"),
        ("llamacpp", ["--path", "/"], "--path", "read a file"),
        ("llamacpp", ["-hf", "x/y"], "-hf", "fetch weights"),
        ("llamacpp", ["--tools", "all"], "--tools", "run commands"),
        ("vllm", ["--download-dir", "/etc"], "--download-dir", "read a file"),
        ("vllm", ["--download_dir=/etc"], "--download_dir=/etc", "read a file"),
        ("vllm", ["--download=/etc"], "--download=/etc", "read a file"),  # argparse abbreviation
        ("vllm", ["--served-model-name", "x"], "--served-model-name", "the agent sets it"),
        ("vllm", ["--speculative-config.model=/x"], "--speculative-config.model=/x", "read a file"),
        ("vllm", ["--middleware", "os.system"], "--middleware", "import Python code"),
        # prompts and answers into the engine log that viewers read, other paths, code, traces
        ("llamacpp", ["-v"], "-v", "prompts or answers into its log"),
        ("llamacpp", ["--verbose"], "--verbose", "prompts or answers into its log"),
        ("llamacpp", ["--log-verbose"], "--log-verbose", "prompts or answers into its log"),
        ("llamacpp", ["--log-verbosity", "5"], "--log-verbosity", "prompts or answers into its log"),
        ("llamacpp", ["--log-verbosity=5"], "--log-verbosity=5", "prompts or answers into its log"),
        ("llamacpp", ["--log_verbosity", "5"], "--log_verbosity", "prompts or answers into its log"),
        ("llamacpp", ["-lv", "5"], "-lv", "prompts or answers into its log"),
        ("llamacpp", ["--verbose-prompt"], "--verbose-prompt", "prompts or answers into its log"),
        ("llamacpp", ["--api-prefix", "/x"], "--api-prefix", "under another path"),
        ("llamacpp", ["--api-prefix=/x"], "--api-prefix=/x", "under another path"),
        ("vllm", ["--trust-remote-code"], "--trust-remote-code", "code that comes with the model"),
        ("vllm", ["--trust_remote_code"], "--trust_remote_code", "code that comes with the model"),
        ("vllm", ["--trust-remote"], "--trust-remote", "code that comes with the model"),  # abbreviation
        ("vllm", ["--otlp-traces-endpoint=http://x:4317"], "--otlp-traces-endpoint=http://x:4317",
         "send request data"),
        ("vllm", ["--enable-log-outputs"], "--enable-log-outputs", "prompts or answers into its log"),
        ("vllm", ["--enable-log-requests"], "--enable-log-requests", "prompts or answers into its log"),
    ],
)
def test_path_and_owned_flags_are_refused_at_add_update_and_set_profiles(
    admin: Admin, engine: str, args: list[str], flag: str, why: str
) -> None:
    bad = [{"name": "p", "engine": engine, "args": args}]
    e = error_of(admin.post("/api/v1/models", model(profiles=bad)), 400)
    assert e["code"] == "invalid_model"
    assert f"'{flag}' is not allowed in a profile" in e["message"]
    assert why in e["message"]
    assert admin.store.list_models() == []

    assert admin.post("/api/v1/models", model()).status_code == 201
    e = error_of(httpx.patch(admin.url + "/api/v1/models/chat", json={"profiles": bad}, headers=AUTH), 400)
    assert f"'{flag}'" in e["message"]
    e = error_of(httpx.put(admin.url + "/api/v1/models/chat/profiles", json=bad, headers=AUTH), 400)
    assert f"'{flag}'" in e["message"]
    (row,) = admin.store.list_models()
    assert row.model.profiles[0].args == ["--ctx-size", "4096"]


@pytest.mark.parametrize(
    "args",
    [["--ctx-size", "8192"], ["-c", "2048", "-np", "2", "--cache-ram", "0"], ["-ngl", "99", "--jinja"],
     ["--log-timestamps", "--log-prefix"], ["--no-mmap", "--mlock"]],
)
def test_sizing_and_behaviour_flags_still_pass(admin: Admin, args: list[str]) -> None:
    prof = [{"name": "p", "args": args}]
    assert admin.post("/api/v1/models", model(profiles=prof)).status_code == 201


@pytest.mark.e2e
def test_every_path_taking_flag_of_the_real_llama_server_is_refused(assets: Assets) -> None:
    """Reads the real ``llama-server --help`` (scripts/assets): every option whose value is a file,
    path, directory, URL or repository must be in the deny-list."""
    out = subprocess.run([str(assets.llama_server), "--help"], capture_output=True, text=True, timeout=60,
                         check=False)
    text = out.stdout + out.stderr
    missing, checked = [], []
    for line in text.splitlines():
        m = re.match(r"^((?:-[\w-]+,?\s*)+)\s+(FNAME|FILE|PATH|DIR|URL|MODEL_URL|SERVERS|JINJA_TEMPLATE_FILE|"
                     r"FNAME:SCALE,\.\.\.|<user>/<model>\[:quant\]|\[<repo>/\]<model>\[:quant\])(\s|$)",
                     line.strip())
        if not m:
            continue
        for flag in re.findall(r"-[\w-]+", m.group(1)):
            checked.append(flag)
            if refused_args("llamacpp", [flag]) is None:
                missing.append(flag)
    assert len(checked) >= 40, f"--help was not read as expected: {checked}"
    assert {"--log-file", "--slot-save-path", "--lora", "-m", "--path", "--api-key-file"} <= set(checked)
    assert not missing, f"path-taking llama-server flags not refused: {missing}"
    # The flags refused for what they log or where they serve are real spellings of this build
    # (--verbose-prompt is refused too, though this build's server does not list it: others do).
    spelled = set(re.findall(r"(?<![\w-])-{1,2}[a-z][\w-]*", text))
    assert {"-v", "--verbose", "--log-verbose", "-lv", "--log-verbosity", "--api-prefix"} <= spelled


# --- scaling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scaling", "says"),
    [
        ({"min": 2.0, "max": 2}, "scaling.min: Input should be a valid integer"),
        ({"min": "2", "max": 2}, "scaling.min: Input should be a valid integer"),
        ({"min": 1, "max": 1.5}, "scaling.max: Input should be a valid integer"),
        ({"min": 1_000_000, "max": 1_000_000}, "scaling.min: Input should be less than or equal to 100000"),
        ({"min": 5_000_000_000, "max": 5_000_000_000}, "less than or equal to 100000"),
        ({"min": 1001, "max": 1001}, "1001 replicas is more than this cluster's limit of 1000"),
        ({"min": 1, "max": 5000}, "5000 replicas is more than this cluster's limit of 1000"),
        ({"min": True, "max": 1}, "scaling.min: Input should be a valid integer"),
    ],
)
def test_scaling_is_a_bounded_strict_integer(admin: Admin, scaling: dict[str, Any], says: str) -> None:
    e = error_of(admin.post("/api/v1/models", model(scaling=scaling)), 400)
    assert says in e["message"]
    assert admin.store.list_models() == []


def test_the_limit_comes_from_server_yaml(store: Store) -> None:
    assert ServerConfig.model_validate({"tls": {"ca": "a", "cert": "b", "key": "c"}}).max_replicas_per_model == 1000
    servers = ServerThread()
    url = f"http://127.0.0.1:{servers.serve(build_admin_app(store, token=TOKEN, max_replicas_per_model=5))}"
    try:
        r = httpx.post(url + "/api/v1/models", json=model(scaling={"min": 6, "max": 6}), headers=AUTH)
        assert "limit of 5 per model (max_replicas_per_model in server.yaml)" in error_of(r, 400)["message"]
        r = httpx.post(url + "/api/v1/models", json=model(scaling={"min": 5, "max": 5}), headers=AUTH)
        assert r.status_code == 201
        r = httpx.patch(url + "/api/v1/models/chat", json={"scaling": {"max": 7}}, headers=AUTH)
        assert "7 replicas" in error_of(r, 400)["message"]
    finally:
        servers.close()


def _write_spec(store: Store, name: str, spec: dict[str, Any]) -> None:
    """Write a model row straight into the database, as an older llmgw (or a hand edit) would have."""
    with store.engine.begin() as conn:  # type: ignore[attr-defined]  # the SQL backend's engine
        conn.execute(
            sa.text("INSERT INTO models (name, revision, spec, created_at, updated_at) VALUES (:n, 1, :s, 1.0, 1.0)"),
            {"n": name, "s": json.dumps(spec)},
        )


def test_pending_rows_are_bounded_by_the_limit_not_by_a_stored_number(admin: Admin) -> None:
    # scaling.min 50,000 was accepted before this limit existed: the view must not build 50,000 rows.
    _write_spec(admin.store, "wide", model("wide", scaling={"min": 50_000, "max": 50_000}))
    r = admin.get("/api/v1/replicas")
    assert r.status_code == 200, r.text
    rows = r.json()
    assert len(rows) == 1000
    assert {x["state"] for x in rows} == {"pending"}


# --- finite numbers, and one broken row ----------------------------------------------------


@pytest.mark.parametrize("number", [b"1e400", b"-1e400", b"Infinity", b"NaN", b"1e100"])
def test_non_finite_and_huge_numbers_never_enter_the_store(admin: Admin, number: bytes) -> None:
    raw = (
        b'{"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu", "min_memory_gb": '
        + number + b"}]}"
    )
    e = error_of(admin.post("/api/v1/models", raw), 400)
    assert e["code"] in ("invalid_json", "invalid_model")
    assert admin.store.list_models() == []
    assert admin.get("/api/v1/models").status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [("context_length", 10**12), ("max_output", 10**12), ("priority", 10**12), ("cpu_cores", 10**9),
     ("gpu_count", 10**6)],
)
def test_every_number_of_the_catalog_is_bounded(admin: Admin, field: str, value: int) -> None:
    doc = model()
    if field in ("priority", "cpu_cores", "gpu_count"):
        doc["profiles"][0][field] = value
    else:
        doc[field] = value
    assert "less than or equal to" in error_of(admin.post("/api/v1/models", doc), 400)["message"]


@dataclass
class World:
    admin: str
    agent: str
    gateway: str
    store: Store
    ctx: ssl.SSLContext


@pytest.fixture
def world(store: Store, tmp_path: Path) -> Iterator[World]:
    """Admin API, agent API (real mTLS), gateway (StoreRouter) and a fake llama-server, one store."""
    ca = tlsconf.CA.create()
    ca.write(tmp_path)
    cert, key = ca.issue_server(["127.0.0.1"]).write(tmp_path, "server")
    ccert, ckey = ca.issue_client("node-1").write(tmp_path, "agent")
    servers = ServerThread()
    engine = servers.serve(fake_llama("r-1", "key-1"))
    admin = servers.serve(build_admin_app(store, token=TOKEN))

    async def agent_site() -> int:
        from aiohttp import web  # noqa: PLC0415

        runner = web.AppRunner(build_agent_app(store))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tlsconf.server_context(tmp_path / "ca.pem", cert, key))
        await site.start()
        servers._runners.append(runner)
        port: int = runner.addresses[-1][1]
        return port

    agent = servers.run(agent_site())
    gateway = servers.serve(build_gateway_app(StoreRouter(store), keys={"k"}, allow_loopback_without_key=True))
    good = Model.model_validate(model("good"))
    store.add_model(good, now=1.0)
    store.add_replica(ReplicaRow(id="good-1", model="good", node="node-1", profile="cpu", key="key-1",
                                 state="ready", endpoint=f"127.0.0.1:{engine}"))
    yield World(f"http://127.0.0.1:{admin}", f"https://127.0.0.1:{agent}", f"http://127.0.0.1:{gateway}", store,
                tlsconf.client_context(tmp_path / "ca.pem", ccert, ckey))
    servers.close()


def _heartbeat(w: World) -> httpx.Response:
    """node-1's heartbeat, reporting its ready replica as its agent would (a replica a heartbeat
    leaves out is not running there: Store.apply_reports)."""
    ready = [ReplicaStatus(id=r.id, state=ReplicaState.READY, endpoint=r.endpoint)
             for r in w.store.list_replicas(node="node-1") if r.state == "ready"]
    hb = Heartbeat(
        inventory=Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB),
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
        replicas=ready,
    )
    with httpx.Client(verify=w.ctx) as c:
        return c.post(w.agent + "/agent/v1/heartbeat", content=hb.model_dump_json(), timeout=30)


def test_a_broken_row_takes_nothing_else_down(world: World) -> None:
    w = world
    # What 'min_memory_gb: 1e400' became before the fix: null, which no longer reads as a float.
    spec = model("poisoned")
    spec["profiles"][0]["min_memory_gb"] = None
    _write_spec(w.store, "poisoned", spec)

    r = httpx.get(w.admin + "/api/v1/models", headers=AUTH)
    assert r.status_code == 200, r.text
    by_name = {m["name"]: m for m in r.json()}
    assert by_name["good"]["broken"] == ""
    assert "profiles.0.min_memory_gb" in by_name["poisoned"]["broken"]
    for path in ("/api/v1/nodes", "/api/v1/replicas", "/api/v1/models/good", "/api/v1/models/poisoned"):
        assert httpx.get(w.admin + path, headers=AUTH).status_code == 200, path
    e = error_of(httpx.patch(w.admin + "/api/v1/models/poisoned", json={"version": "2"}, headers=AUTH), 409)
    assert e["code"] == "model_broken"
    assert "llmgw ctl model rm poisoned" in e["message"]
    # A new model still goes in, and the broken name stays taken until it is removed.
    assert httpx.post(w.admin + "/api/v1/models", json=model("other"), headers=AUTH).status_code == 201
    r = httpx.post(w.admin + "/api/v1/models", json=model("poisoned"), headers=AUTH)
    assert "its stored row is broken: remove it first" in error_of(r, 409)["message"]

    # Heartbeats (real mTLS) still get their desired replicas.
    r = _heartbeat(w)
    assert r.status_code == 200, r.text
    assert [s.model for s in HeartbeatReply.model_validate_json(r.content).desired] == ["good"]

    # The gateway still lists and serves the good model.
    models = httpx.get(w.gateway + "/v1/models", timeout=30).json()
    assert "good" in [m["id"] for m in models["data"]]
    chat = httpx.post(w.gateway + "/v1/chat/completions", timeout=30,
                      json={"model": "good", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text

    # ctl models names it; ctl model rm deletes it.
    out = CliRunner().invoke(ctl_app, ["models", "--server", w.admin, "--token", TOKEN])
    assert out.exit_code == 0, out.output
    assert "poisoned: broken, served nowhere: profiles.0.min_memory_gb" in out.output
    out = CliRunner().invoke(ctl_app, ["model", "rm", "poisoned", "--server", w.admin, "--token", TOKEN])
    assert out.exit_code == 0, out.output
    assert [b.name for b in w.store.list_broken_models()] == []
    assert [m.name for m in w.store.list_models()] == ["good", "other"]


def test_a_restart_with_a_broken_row_still_serves(world: World) -> None:
    _write_spec(world.store, "junk", {"name": "junk", "not": "a model"})
    again = open_store(world.store.engine.url.render_as_string(hide_password=False))  # a restarted control plane
    try:
        router = StoreRouter(again, clock=time.monotonic)
        assert [r.model for r in router.chat_models()] == ["good"]
        assert [b.name for b in again.list_broken_models()] == ["junk"]
    finally:
        again.close()
