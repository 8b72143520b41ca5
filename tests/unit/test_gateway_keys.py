"""GatewayKeys: the keys file's rules, when it is looked at, and what a bad version of it does."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from llmgw.control.gateway.keys import GatewayKeys, digest, parse_keys
from llmgw.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_parse_skips_blanks_and_comments() -> None:
    assert parse_keys("# keys\n\n  sk-a  \nsk-b\n#sk-c\n", Path("k")) == {"sk-a", "sk-b"}


@pytest.mark.parametrize("line", ["sk-a # alice", "sk-\x00a", "sk-é", "k" * 1025])
def test_a_line_that_is_not_a_key_is_named_by_number_only(line: str) -> None:
    with pytest.raises(ConfigError, match=r"gateway.keys_file k: line 2 is not a key") as e:
        parse_keys(f"sk-ok\n{line}\n", Path("k"))
    assert line not in str(e.value)


def test_an_unreadable_file_at_startup_is_a_config_error(tmp_path: Path) -> None:
    """Each says what to do about it (a new user's finding: an unreadable file said "create it", and a
    byte that is not UTF-8 was named by its offset in the file, not by its line)."""
    with pytest.raises(ConfigError, match=r"missing does not exist; create it with one key per line"):
        GatewayKeys(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"cannot be read \(Is a directory\); let the control plane's user read"):
        GatewayKeys(tmp_path)
    (tmp_path / "bin").write_bytes(b"sk-a\n\xff\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text: line 2 has byte 0xff; a key is visible ASCII"):
        GatewayKeys(tmp_path / "bin")


def test_the_file_is_looked_at_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a\n")
    clock = Clock()
    keys = GatewayKeys(path, clock=clock)
    assert keys.digests() == {digest("sk-a")}
    path.write_text("sk-b\n")
    clock.now += 0.9
    assert keys.digests() == {digest("sk-a")}  # not looked at yet
    clock.now += 0.1
    assert keys.digests() == {digest("sk-b")}


def test_an_unchanged_file_is_not_read_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a\n")
    clock = Clock()
    keys = GatewayKeys(path, clock=clock)
    caplog.set_level(logging.INFO)
    for _ in range(3):
        clock.now += 1
        keys.digests()
    assert not caplog.records


def test_a_bad_version_keeps_the_last_keys_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a\n")
    clock = Clock()
    keys = GatewayKeys(path, clock=clock)
    path.write_text("sk-b\nsk-c d\n")
    for _ in range(3):
        clock.now += 1
        assert keys.digests() == {digest("sk-a")}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "line 2 is not a key" in errors[0].getMessage()
    assert "still using the 1 keys loaded before" in errors[0].getMessage()
    path.write_text("sk-b\n")
    clock.now += 1
    assert keys.digests() == {digest("sk-b")}


def test_reload_reads_the_file_whatever_its_stat_says(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a\n")
    keys = GatewayKeys(path, clock=Clock())
    st = path.stat()
    path.write_text("sk-b\n")  # same size; mtime put back
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert keys.reload("SIGHUP") is True
    assert keys.digests() == {digest("sk-b")}


def test_fixed_keys_ignore_empty_strings() -> None:
    keys = GatewayKeys(None, initial={"sk-a", ""})
    assert keys.digests() == {digest("sk-a")}
    assert keys.reload() is False
