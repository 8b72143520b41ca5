"""The mirror's system user under systemd, through the command runner seam (no useradd here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.errors import ServiceError
from llmgw.service.manager import CommandResult
from llmgw.service.users import ensure_mirror_user


def test_a_missing_user_is_made_and_given_the_store(tmp_path: Path) -> None:
    ran: list[list[str]] = []

    def runner(argv: list[str]) -> CommandResult:
        ran.append(argv)
        return CommandResult(0, "")

    assert ensure_mirror_user(tmp_path, runner=runner, exists=lambda _: False) is True
    assert ran[0][:2] == ["useradd", "--system"]
    assert ran[0][-1] == "llmgw"
    assert ran[1] == ["chown", "-R", "llmgw:llmgw", str(tmp_path)]


def test_an_existing_user_is_only_given_the_store(tmp_path: Path) -> None:
    ran: list[list[str]] = []
    assert ensure_mirror_user(tmp_path, runner=lambda a: ran.append(a) or CommandResult(0, ""),
                              exists=lambda _: True) is False
    assert ran == [["chown", "-R", "llmgw:llmgw", str(tmp_path)]]


def test_a_failing_useradd_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match="create the user llmgw by hand"):
        ensure_mirror_user(tmp_path, runner=lambda a: CommandResult(1, "useradd: permission denied"),
                           exists=lambda _: False)
