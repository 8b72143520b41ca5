"""``llmgw chat`` and llmgw.client against a real gateway (over a fake llama-server) on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from llmgw import client
from llmgw.cli import chat as chat_cli
from llmgw.control.gateway.app import build_gateway_app
from llmgw.errors import ApiError, ConfigError, UnreachableError
from llmgw.paths import ROOT_ENV, Paths
from llmgw.routing import Route, StaticRouter, Upstream
from tests.helpers.gateway import ServerThread, fake_llama
from tests.helpers.net import free_port

KEY = "sk-chat"


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    servers = ServerThread()
    up = servers.serve(fake_llama("replica-a", "key-a"))
    router = StaticRouter(
        routes={
            "alpha": Route("alpha", (Upstream("r-a", f"127.0.0.1:{up}", "key-a"),)),
            "zeta": Route("zeta", (), unavailable="no replica is ready"),
        },
        aliases={"a": "alpha"},
    )
    port = servers.serve(build_gateway_app(router, keys={KEY}, allow_loopback_without_key=False))
    yield f"http://127.0.0.1:{port}"
    servers.close()


@pytest.fixture(scope="module")
def empty_gateway() -> Iterator[str]:
    servers = ServerThread()
    port = servers.serve(build_gateway_app(StaticRouter(), keys=set(), allow_loopback_without_key=True))
    yield f"http://127.0.0.1:{port}"
    servers.close()


# -- client functions ------------------------------------------------------------------------------


def test_stream_chat_yields_deltas(gateway: str) -> None:
    assert list(client.stream_chat(gateway, KEY, "a", "hi")) == ["Hello", " from", " replica-a", "!"]


def test_list_and_default_model(gateway: str, empty_gateway: str) -> None:
    assert client.list_models(gateway + "/v1/", KEY) == ["alpha", "zeta"]
    assert client.default_model(gateway, KEY) == "alpha"
    with pytest.raises(ApiError, match="offers no chat model yet"):
        client.default_model(empty_gateway, None)


def test_gateway_errors_carry_the_servers_message(gateway: str) -> None:
    with pytest.raises(ApiError, match="known models: alpha, zeta") as e:
        list(client.stream_chat(gateway, KEY, "nope", "hi"))
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    with pytest.raises(ApiError, match="pass --key") as e:
        client.list_models(gateway, "wrong")
    assert e.value.status == 401
    with pytest.raises(ApiError, match="not available: no replica is ready"):
        list(client.stream_chat(gateway, KEY, "zeta", "hi"))


def test_error_event_mid_stream_raises(gateway: str) -> None:
    deltas: list[str] = []
    with pytest.raises(ApiError, match="closed the connection") as e:
        deltas.extend(client.stream_chat(gateway, KEY, "alpha", "cut-stream"))
    assert e.value.code == "upstream_failed"
    assert deltas == ["Hello"]  # what came before the break was printed


def test_gateway_down_says_what_to_run() -> None:
    with pytest.raises(UnreachableError, match="llmgw service status"):
        client.list_models(f"127.0.0.1:{free_port()}", None)


def test_stream_parsing_through_the_transport_seam() -> None:
    sse = (
        b": keep-alive\n\nevent: message\n"
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        b'data: {"choices":[]}\n\n'
        b'data: {"choices":[{"delta":{"content":"b"}}]}\n\ndata: [DONE]\n\n'
        b'data: {"choices":[{"delta":{"content":"after done"}}]}\n\n'
    )
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})

    out = list(client.stream_chat("gw:1", "k", "m", "q", transport=httpx.MockTransport(handler)))
    assert out == ["a", "b"]
    assert str(seen[0].url) == "http://gw:1/v1/chat/completions"
    assert seen[0].headers["authorization"] == "Bearer k"


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://h:1/", "http://h:1"),
        ("https://h/v1", "https://h"),
        ("http://h:1/v1/", "http://h:1"),
    ],
)
def test_normalize_url(given: str, url: str) -> None:
    assert client.normalize_url(given) == url


# -- this machine's config -------------------------------------------------------------------------


def _server_yaml(root: Path, gateway_block: str) -> Paths:
    paths = Paths.from_env(root)
    paths.etc.mkdir(parents=True)
    paths.server_config.write_text(
        f"tls:\n  ca: /x/ca.pem\n  cert: /x/cert.pem\n  key: /x/key.pem\ngateway:\n{gateway_block}"
    )
    return paths


def test_local_target_from_server_yaml(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# gateway keys\n\n  sk-first \nsk-second\n")
    paths = _server_yaml(tmp_path / "root", f"  listen: ':18080'\n  keys_file: {keys}\n")
    assert client.local_target(paths) == client.Target("http://127.0.0.1:18080", "sk-first")
    # this machine's key never goes to another server
    assert client.resolve_target(paths, server="http://other:1", key=None) == client.Target(
        "http://other:1", None
    )
    assert client.resolve_target(paths, server=None, key="sk-x").key == "sk-x"


@pytest.mark.parametrize(
    ("block", "target"),
    [
        ("  listen: '[::1]:9000'\n", client.Target("http://[::1]:9000", None)),  # keys file unreadable
        ("  listen: '10.1.2.3:8080'\n", client.Target("http://10.1.2.3:8080", None)),
    ],
)
def test_local_target_hosts(tmp_path: Path, block: str, target: client.Target) -> None:
    assert client.local_target(_server_yaml(tmp_path, block)) == target


def test_local_target_without_server_yaml(tmp_path: Path) -> None:
    assert client.local_target(Paths.from_env(tmp_path)) == client.Target("http://127.0.0.1:8080", None)


def test_a_server_yaml_this_user_may_not_read_says_to_pass_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sudo llmgw server init`` then ``llmgw chat`` as a user: server.yaml is root's (0600). The error
    says what to pass instead of only "Permission denied" (a new user's report). This suite runs as
    root, who may read anything: the refusal, os.access's answer, is patched."""
    paths = _server_yaml(tmp_path, "  listen: ':18080'\n")
    monkeypatch.setattr(client, "_may_read", lambda _path: False)
    with pytest.raises(ConfigError, match="cannot be read as uid") as e:
        client.local_target(paths)
    assert "--server URL" in str(e.value)
    assert client.resolve_target(paths, server="http://gw:8080", key="sk-x") == client.Target("http://gw:8080", "sk-x")


# -- the command -----------------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(chat_cli.chat)
    return app


def test_llmgw_chat_uses_this_machines_config(
    gateway: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = gateway.rpartition(":")[2]
    (tmp_path / "keys").write_text(f"{KEY}\n")
    _server_yaml(tmp_path / "root", f"  listen: ':{port}'\n  keys_file: {tmp_path / 'keys'}\n")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "root"))
    result = CliRunner().invoke(_app(), ["hello there"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hello from replica-a!\n"


def test_llmgw_chat_errors(gateway: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    result = CliRunner().invoke(_app(), ["--server", gateway, "--key", KEY, "--model", "nope", "hi"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: the gateway answered 404: model 'nope' does not exist")
    result = CliRunner().invoke(_app(), ["--server", f"127.0.0.1:{free_port()}", "hi"])
    assert result.exit_code == 3
    assert "llmgw service status" in result.stderr
