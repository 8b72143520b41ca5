"""``engines.max_threads`` and ``LLMGW_ENGINE_MAX_THREADS``: the most compute threads an engine the agent
starts runs (llmgw.config.EnginesConfig; the argv's cap is in tests/unit/test_llamacpp.py).

The agent is built for real (its inventory declared, a stand-in llama-server that only prints its version:
no engine is started here).
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
import yaml

from llmgw.agent.engines.base import engine_threads
from llmgw.agent.loop.loop import Agent, run_agent
from llmgw.config import MAX_THREADS_ENV, AgentConfig
from llmgw.errors import ConfigError
from llmgw.paths import Paths
from llmgw.service import check
from llmgw.tlsconf import CA
from tests.helpers.nodes import declared_node


def config(tmp_path: Path, engines: dict[str, object] | None = None) -> AgentConfig:
    inv, fake = declared_node(tmp_path, cores=8)
    return AgentConfig.model_validate({
        "server": "https://127.0.0.1:7443",
        "node_id": "node-1",
        "tls": {"ca": tmp_path / "ca.pem", "cert": tmp_path / "a.pem", "key": tmp_path / "a-key.pem"},
        "discovery": {"inventory_file": str(inv)},
        "engines": {"llamacpp": {"binary": str(fake)}, **(engines or {})},
    })


def test_unset_means_no_cap(tmp_path: Path) -> None:
    assert config(tmp_path).engine_max_threads({}) is None
    assert config(tmp_path).engine_max_threads({MAX_THREADS_ENV: " "}) is None


def test_the_environment_sets_it_where_the_config_does_not(tmp_path: Path) -> None:
    assert config(tmp_path).engine_max_threads({MAX_THREADS_ENV: "1"}) == 1
    assert config(tmp_path, {"max_threads": 3}).engine_max_threads({MAX_THREADS_ENV: "1"}) == 3


@pytest.mark.parametrize("raw", ["0", "two", "-1", "1.5", "²", "١"])
def test_a_bad_value_in_the_environment_is_named(tmp_path: Path, raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"{MAX_THREADS_ENV}='{raw}'.*at least 1"):
        config(tmp_path).engine_max_threads({MAX_THREADS_ENV: raw})


@pytest.mark.parametrize("value", [0, True, "2"])
def test_a_bad_value_in_the_config_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match="max_threads"):
        config(tmp_path, {"max_threads": value})


async def test_the_agent_hands_the_cap_to_its_runners(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the runners launch with (RunnerEnv.max_threads) comes from the environment the agent runs in."""
    monkeypatch.setenv(MAX_THREADS_ENV, "2")
    async with aiohttp.ClientSession() as api, aiohttp.ClientSession() as plain:
        agent = Agent(config(tmp_path), Paths(tmp_path / "root"), api=api, plain=plain)
        assert agent.env.max_threads == 2
        assert agent.env.cores == 8  # the node's cores are still reported as they are
        monkeypatch.delenv(MAX_THREADS_ENV)
        assert Agent(config(tmp_path), Paths(tmp_path / "root"), api=api, plain=plain).env.max_threads is None


async def test_a_bad_value_stops_the_agent_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``llmgw agent`` (run_agent) with a bad variable ends with the ConfigError, naming it, before any beat."""
    ca = CA.create()
    ca.write(tmp_path)
    cert, key = ca.issue_client("node-1").write(tmp_path, "a")
    cfg = config(tmp_path)
    assert (cfg.tls.cert, cfg.tls.key) == (cert, key)
    monkeypatch.setenv(MAX_THREADS_ENV, "all")
    with pytest.raises(ConfigError, match=rf"{MAX_THREADS_ENV}='all'"):
        await run_agent(cfg, Paths(tmp_path / "root"))


def test_service_restart_s_check_refuses_a_bad_value_before_anything_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``llmgw service restart agent`` runs ``python -m llmgw.service.check agent CONFIG`` in the unit's
    environment first (llmgw.service.check): a bad variable there fails the check, and the running agent is
    left alone, as a bad agent.yaml is (a fresh operator's finding: the new agent exited 2 in a loop)."""
    ca = CA.create()
    ca.write(tmp_path)
    ca.issue_client("node-1").write(tmp_path, "a")
    cfg = config(tmp_path)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json(exclude_defaults=True))))
    monkeypatch.setenv(MAX_THREADS_ENV, "two")
    assert check.main(["agent", str(path)]) == 2
    assert f"{MAX_THREADS_ENV}='two'" in capsys.readouterr().err
    monkeypatch.setenv(MAX_THREADS_ENV, "1")
    assert check.main(["agent", str(path)]) == 0


@pytest.mark.parametrize(
    ("pinned", "reserved", "node_cores", "max_threads", "want"),
    [
        (None, 0, 8, None, 8),  # the node's cores
        (None, 0, 0, None, 1),  # at least one
        (None, 2, 8, None, 2),  # the profile's reservation
        (3, 2, 8, None, 3),  # the pinned cores first
        (None, 0, 8, 1, 1),  # capped
        (3, 2, 8, 2, 2),
        (None, 2, 8, 4, 2),  # a cap above changes nothing
    ],
)
def test_the_threads_an_engine_gets(pinned: int | None, reserved: int, node_cores: int, max_threads: int | None,
                                    want: int) -> None:
    """One rule for llama-server and a group worker's rpc-server (llmgw.agent.engines.base.engine_threads)."""
    assert engine_threads(pinned=pinned, reserved=reserved, node_cores=node_cores, max_threads=max_threads) == want
