"""server init's files and waits: the server.yaml append with its backup, atomic writes, waits."""

from __future__ import annotations

import errno
import os
import pwd
from pathlib import Path

import pytest

from llmgw.config import load_agent_config, load_server_config, unreadable
from llmgw.errors import ConfigError, WaitTimeout
from llmgw.serverinit import files
from llmgw.serverinit.wait import Clock, format_duration, wait_for


class FakeClock:
    """A clock that only moves when slept on."""

    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_append_keeps_the_file_and_a_backup(tmp_path: Path) -> None:
    p = tmp_path / "server.yaml"
    p.write_text("admin_listen: '127.0.0.1:9090'\n# my comment\n")
    os.chmod(p, 0o640)
    backup = files.append_block(p, files.mirror_block("http://127.0.0.1:8082", "# the mirror"), now=0)
    assert backup.read_text() == "admin_listen: '127.0.0.1:9090'\n# my comment\n"
    assert backup.name.startswith("server.yaml.bak-")
    text = p.read_text()
    assert text.startswith("admin_listen: '127.0.0.1:9090'\n# my comment\n")
    assert text.endswith("\n# the mirror\nmirror:\n  api: http://127.0.0.1:8082\n")
    assert p.stat().st_mode & 0o777 == 0o640


def test_written_configs_load(tmp_path: Path) -> None:
    s = tmp_path / "server.yaml"
    s.write_text(files.server_yaml(admin_listen="127.0.0.1:1", agent_listen=":2", gateway_listen=":3",
                                   pki=tmp_path / "pki", keys_file=tmp_path / "keys")
                 + files.mirror_block("http://127.0.0.1:4", "# m"))
    cfg = load_server_config(s)
    assert cfg.gateway.allow_loopback_without_key
    assert cfg.mirror.api == "http://127.0.0.1:4"
    a = tmp_path / "agent.yaml"
    a.write_text(files.agent_yaml(server="https://10.0.0.1:7443", node_id="n1", etc=tmp_path,
                                  label_key="llmgw.control-plane", label_value="true",
                                  llama_server=Path("/opt/llama-server")))
    ac = load_agent_config(a)
    assert ac.labels == {"llmgw.control-plane": "true"}
    assert ac.engines.llamacpp.binary == Path("/opt/llama-server")


def test_a_broken_config_names_file_and_line_and_is_left_alone(tmp_path: Path) -> None:
    s = tmp_path / "server.yaml"
    s.write_text("tls: [unclosed\n")
    with pytest.raises(ConfigError, match=r"server.yaml: not valid YAML at line"):
        load_server_config(s)
    assert s.read_text() == "tls: [unclosed\n"


@pytest.mark.parametrize(("text", "says"), [
    # PyYAML stops a line after a key that lacks its ':' (a new user read "line 4" and looked there)
    ('admin_listen: "127.0.0.1:1"\ngateway:\n  listen 127.0.0.1:2\n  drain_s: 3\n',
     "not valid YAML at line 4, column 10: mapping values are not allowed here; check line 3 too: "
     "a key without its ':', or a value indented under a key; fix the file"),
    ("a: 1\nb: [1, 2\nc: 3\n",
     "not valid YAML at line 3, column 2: expected ',' or ']', but got ':' "
     "(while parsing a flow sequence that starts at line 2); fix the file"),
])
def test_a_yaml_error_says_where_the_mistake_may_be(tmp_path: Path, text: str, says: str) -> None:
    s = tmp_path / "server.yaml"
    s.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_server_config(s)
    assert str(e.value) == f"{s}: {says}"


def test_write_atomic_sets_mode(tmp_path: Path) -> None:
    p = tmp_path / "d" / "token"
    files.write_atomic(p, "x\n", 0o600)
    assert p.read_text() == "x\n"
    assert p.stat().st_mode & 0o777 == 0o600
    assert [x.name for x in p.parent.iterdir()] == ["token"]


def test_wait_for_returns_when_done() -> None:
    c = FakeClock()
    n = iter([False, False, True])
    wait_for(10, "x", lambda: next(n), interval_s=2, clock=Clock(c.now, c.sleep))
    assert c.slept == [2, 2]


def test_wait_for_gives_up_at_the_deadline_and_says_what_to_do() -> None:
    c = FakeClock()
    with pytest.raises(WaitTimeout, match=r"gave up waiting for the mirror after 30s; run init again to keep waiting"):
        wait_for(30, "the mirror", lambda: False, interval_s=2, clock=Clock(c.now, c.sleep))
    assert c.t == 30


def test_wait_for_stops_at_once_on_an_error() -> None:
    c = FakeClock()

    def probe() -> bool:
        raise ConfigError("never")

    with pytest.raises(ConfigError):
        wait_for(30, "x", probe, clock=Clock(c.now, c.sleep))
    assert c.slept == []


def test_durations_read_like_go_durations() -> None:
    assert format_duration(90) == "1m30s"
    assert format_duration(1200) == "20m0s"
    assert format_duration(30) == "30s"


def test_a_file_the_services_user_may_not_read_says_who_and_how() -> None:
    """A new user's finding: the docs' ``chmod 600`` viewer token, made by root, was refused to the
    control plane (user ``llmgw``) with a bare "Permission denied". The message names the user this
    process runs as and the commands that let it read the file. (The suite runs as root, whom no file
    is refused to: the error is built as open() would raise it.)"""
    user = pwd.getpwuid(os.geteuid()).pw_name
    said = unreadable(Path("/etc/llmgw/viewer-token"), PermissionError(errno.EACCES, "Permission denied"))
    assert said == (f"Permission denied for user {user}, whom the service runs as; let it read the file "
                    f"(chgrp {user} /etc/llmgw/viewer-token && chmod g+r /etc/llmgw/viewer-token) "
                    "or put it where it can")
    assert unreadable(Path("/x"), IsADirectoryError(errno.EISDIR, "Is a directory")) == "Is a directory"
