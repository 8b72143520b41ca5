"""Each of server init's steps run alone over an :class:`InitContext`: the
PKI, server.yaml and the "how to ask" ending, on a temporary root with real files and real
certificates; no services are started. And the typed admin client the steps read the control
plane with, over an in-process transport."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.adminclient import AdminClient
from llmgw.config import load_server_config
from llmgw.errors import ApiError, PkiError
from llmgw.paths import Paths
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps import howto, judge, pki, serveryaml
from llmgw.serverinit.steps.context import InitContext
from llmgw.service.manager import SupervisorManager
from llmgw.tlsconf import cert_hosts
from llmgw.views import NodeView, ProvisionView


def context(root: Path, **kw: Any) -> tuple[InitContext, io.StringIO]:
    paths = Paths(root)
    out = io.StringIO()
    return InitContext(paths, InitOptions(**kw), SupervisorManager(paths), out=out), out


def test_the_pki_step_alone_makes_then_keeps_everything(tmp_path: Path) -> None:
    ctx, out = context(tmp_path, hosts=["10.1.2.3"])
    pki.run(ctx)
    first = out.getvalue().splitlines()
    assert first[0] == f"  done cluster CA in {ctx.paths.pki}"
    assert first[1].startswith("  done server certificate for 10.1.2.3")
    assert first[2:] == [
        f"  done admin token {ctx.paths.admin_token}",
        f"  done gateway API key in {ctx.paths.client_keys}",
    ]
    assert "10.1.2.3" in cert_hosts(ctx.paths.pki / "server.pem")
    assert ctx.paths.client_keys.read_text().startswith("sk-llmgw-")

    again, out2 = context(tmp_path, hosts=["10.1.2.3"])
    pki.run(again)
    assert [ln.split()[0] for ln in out2.getvalue().splitlines()] == ["kept"] * 4


def test_the_pki_step_alone_adds_a_new_host_to_the_server_certificate(tmp_path: Path) -> None:
    pki.run(context(tmp_path, hosts=["10.1.2.3"])[0])
    ctx, out = context(tmp_path, hosts=["10.9.9.9"])
    pki.run(ctx)
    assert "  done server certificate now also for 10.9.9.9\n" in out.getvalue()
    assert {"10.1.2.3", "10.9.9.9"} <= set(cert_hosts(ctx.paths.pki / "server.pem"))


def test_the_pki_step_alone_refuses_a_ca_key_without_its_certificate(tmp_path: Path) -> None:
    ctx, _ = context(tmp_path)
    pki.run(ctx)
    (ctx.paths.pki / "ca.pem").unlink()
    with pytest.raises(PkiError, match=r"ca-key\.pem is there but .*ca\.pem is not; restore ca\.pem"):
        pki.run(context(tmp_path)[0])


def test_the_server_yaml_step_alone_writes_once_then_keeps(tmp_path: Path) -> None:
    ctx, out = context(tmp_path, admin_listen="127.0.0.1:7001", gateway_listen="127.0.0.1:7002")
    serveryaml.run(ctx)
    cfg = load_server_config(ctx.paths.server_config)
    assert (cfg.admin_listen, cfg.gateway.listen) == ("127.0.0.1:7001", "127.0.0.1:7002")
    serveryaml.run(ctx)
    assert out.getvalue() == f"  done {ctx.paths.server_config}\n  kept {ctx.paths.server_config}\n"


def test_the_how_to_ask_step_alone_names_the_model_and_the_gateway(tmp_path: Path) -> None:
    ctx, out = context(tmp_path, gateway_listen=":8099")
    serveryaml.run(ctx)
    howto.run(ctx, "gemma", 75.0)
    text = out.getvalue()
    assert "llmgw is ready (init took 1m15s)." in text
    assert "curl -s http://127.0.0.1:8099/v1/chat/completions" in text
    # bounded: a small starter model may not stop on its own, and an unbounded answer runs to the context
    assert '"max_tokens": 64}' in text
    assert '"model": "gemma"' in text
    token = ctx.paths.server_config.parent / "admin-token"
    assert f"Dashboard: http://127.0.0.1:9090/ui/ (log in with the token in {token};" in text
    ctx2, out2 = context(tmp_path)
    ctx2.admin_transport = models_answer([])
    howto.run(ctx2, "", 3.0)
    assert out2.getvalue().endswith("No model is served yet: add one with 'llmgw ctl' once a node has joined.\n")


def models_answer(models: list[dict[str, Any]]) -> httpx.MockTransport:
    """The admin API answering GET /api/v1/models with ``models`` (the control plane is not run here)."""
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/models", request.url
        return httpx.Response(200, json=models)

    return httpx.MockTransport(handler)


def test_a_second_init_whose_starter_was_skipped_names_the_chat_model_already_serving(tmp_path: Path) -> None:
    """A later ``server init --offline`` skips the default starter (not in the mirror) while the
    first run's starter serves: the end names that one, not "no model is served" (a new user's
    report). Guard models and models with no ready replica are not offered."""
    ctx, out = context(tmp_path)
    pki.run(ctx)  # the admin token the client sends
    serveryaml.run(ctx)
    ctx.admin_transport = models_answer([
        {"name": "a-judge", "role": "guard", "replicas_ready": 1},
        {"name": "b-idle", "role": "chat", "replicas_ready": 0},
        {"name": "gemma", "role": "chat", "replicas_ready": 1},
    ])
    howto.run(ctx, "", 3.0)
    text = out.getvalue()
    assert "No model is served yet" not in text
    assert '"model": "gemma"' in text


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({}, 1),
        ({"no_node": True}, 2),
        ({"judge_replicas": 3}, 3),
        ({"no_guard_model": True}, 0),
        ({"offline": True}, 0),  # nothing carried in: the starter keeps the judge's cores
        ({"offline": True, "judge_source": "file:/x/j.gguf"}, 1),
    ],
)
def test_the_judge_steps_replica_count(kw: dict[str, Any], want: int) -> None:
    assert judge.replicas(InitOptions(**kw)) == want


def client(answer: Any) -> AdminClient:
    def handler(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    return AdminClient("http://cp", "t", transport=httpx.MockTransport(handler))


def test_admin_client_reads_nodes_as_views() -> None:
    got = client([{"id": "n1", "state": "ready", "engines": ["llamacpp"],
                   "provision": [{"engine": "llamacpp", "version": "b1", "state": "ready"}]}]).nodes()
    assert got == [NodeView(id="n1", state="ready", engines=["llamacpp"],
                            provision=[ProvisionView(engine="llamacpp", version="b1", state="ready")])]
    assert got[0].provision[0].version == "b1"


def test_admin_client_names_an_answer_it_cannot_read() -> None:
    with pytest.raises(ApiError, match=r"GET /api/v1/explain-placement\?model=m: the control plane answered an? "
                                       r"ExplainView this client cannot read") as e:
        client({"model": "m"}).explain("m")  # no "placed"
    assert (e.value.status, e.value.code) == (502, "bad_answer")
