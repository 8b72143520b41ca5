"""The ``guard:`` block: defaults, validation messages, which policy applies."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.config import load_server_config
from llmgw.errors import ConfigError
from llmgw.guard.config import Controversial, Direction, FailMode, GuardConfig, Policy, key_id

TLS = "tls: {ca: /c, cert: /s, key: /k}\n"


def _load(tmp_path: Path, text: str) -> GuardConfig:
    p = tmp_path / "server.yaml"
    p.write_text(TLS + text)
    return load_server_config(p).guard


def test_off_without_policies(tmp_path: Path) -> None:
    assert not _load(tmp_path, "").on()
    assert not _load(tmp_path, "guard: {}\n").on()


def test_defaults(tmp_path: Path) -> None:
    g = _load(tmp_path, "guard:\n  policies:\n    - name: default\n      judge: qwen3guard-0.6b\n")
    assert g.on()
    p = g.policies[0]
    assert p.judges() == ["qwen3guard-0.6b"]
    assert p.check == [Direction.IN, Direction.OUT]
    assert p.fail is FailMode.CLOSED
    assert p.controversial is Controversial.WARN
    assert p.budget_s == 5.0
    assert g.policy_for("anything") is p


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        ("    - name: x\n      judge: []\n", "guard.policies.0.judge"),
        ("    - name: x\n      judge: j\n      fail: sometimes\n", "guard.policies.0.fail"),
        ("    - name: x\n      judge: j\n      controversial: maybe\n", "guard.policies.0.controversial"),
        ("    - name: x\n      judge: j\n      check: []\n", "a policy that checks nothing"),
        ("    - name: x\n      judge: j\n      check: [sideways]\n", "guard.policies.0.check.0"),
        ("    - name: x\n      judge: j\n      budget_s: 0\n", "guard.policies.0.budget_s"),
        ("    - name: x\n      judge: j\n      keys: [sk-secret]\n", "never the key itself"),
        ("    - name: x\n      judge: j\n      typo: 1\n", "unknown field"),
        ("    - name: x\n      judge: j\n    - name: x\n      judge: k\n", "'x' appears more than once"),
    ],
)
def test_errors_name_the_field(tmp_path: Path, block: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, "guard:\n  policies:\n" + block)
    assert needle in str(e.value)


def test_first_matching_policy_applies() -> None:
    kid = key_id("sk-team")
    g = GuardConfig(
        policies=[
            Policy(name="team", judge="j", keys=[kid[:8]], fail=FailMode.OPEN),
            Policy(name="qwen", judge=["a", "b"], models=["qwen*"]),
            Policy(name="rest", judge="j", check=[Direction.IN]),
        ]
    )
    assert g.policy_for("qwen2.5", kid).name == "team"  # type: ignore[union-attr]
    assert g.policy_for("qwen2.5", "").name == "qwen"  # type: ignore[union-attr]
    assert g.policy_for("gemma", "").name == "rest"  # type: ignore[union-attr]
    assert g.judge_names() == ["a", "b", "j"]
    assert not g.policies[2].checks(Direction.OUT)


def test_a_policys_models_may_name_an_alias() -> None:
    """A new user's finding: ``models: [gemma]``, ``gemma`` an alias of the starter, guarded nothing,
    whatever name the client used (the policy was matched against the catalog name only)."""
    g = GuardConfig(policies=[Policy(name="byalias", judge="j", models=["gemma"]),
                              Policy(name="qwen", judge="j", models=["qwen*"])])
    assert g.policy_for("gemma-3-270m-q4_k_m", "", ("gemma", "g")).name == "byalias"  # type: ignore[union-attr]
    assert g.policy_for("gemma-3-270m-q4_k_m", "") is None  # no alias: not named
    assert g.policy_for("small", "", ("qwen-small",)).name == "qwen"  # type: ignore[union-attr]


def test_a_policy_names_stored_keys_by_name_which_survives_a_rotation() -> None:
    """A new user's finding: a policy listing a stored key's id stopped applying once the key was
    rotated (a new secret, a new id), without a word. ``key_names`` names the stored key itself;
    the keys-file and keyless callers (no name) are not it."""
    cfg = GuardConfig(policies=[
        Policy(name="team", judge="j", key_names=["ivy"]),
        Policy(name="rest", judge="j"),
    ])
    assert cfg.policy_for("chat", key_id("sk-ivy-new"), key_name="ivy").name == "team"
    assert cfg.policy_for("chat", key_id("sk-ivy-old"), key_name="ivy").name == "team"
    assert cfg.policy_for("chat", key_id("sk-other"), key_name="olga").name == "rest"
    assert cfg.policy_for("chat", key_id("sk-file")).name == "rest"
    both = Policy(name="both", judge="j", keys=[key_id("sk-x")], key_names=["ivy"])
    assert both.applies("chat", key_id("sk-x"))
    assert both.applies("chat", "", key_name="ivy")
    assert not both.applies("chat", key_id("sk-y"), key_name="olga")


def test_key_names_may_name_the_keys_file_and_loopback_callers() -> None:
    """The access log and usage name those callers ``keys-file`` and ``loopback`` (names no stored key
    may take), and an operator writes them in ``key_names``: they matched nobody (found checking this
    stop's changes)."""
    p = Policy(name="p", judge="j", key_names=["keys-file", "loopback"])
    assert p.applies("chat", key_id("sk-file"), key_name="keys-file")
    assert p.applies("chat", "", key_name="loopback")
    assert not p.applies("chat", key_id("sk-x"), key_name="alice")
