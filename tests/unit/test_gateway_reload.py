"""On a real control plane: a key removed from ``gateway.keys_file`` stops working
without a restart (re-read within a second of a change, and on SIGHUP), and a broken keys file
keeps the last good keys. ``serve()`` runs in-process with its real listeners (real HTTP); SIGHUP
to ``llmgw server run`` as a process is in tests/e2e/test_processes.py."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from llmgw.control import startcheck
from llmgw.control.gateway.keys import GatewayKeys
from tests.helpers.control import Install, make_keyed_install, serving

ALICE = "sk-alice-0123456789"
BOB = "sk-bob-0123456789"
#: The broken-file test's look interval (s): what it checks is what a look does, not how often one comes
#: (the real second is the other test's), so its gateway looks every 0.2 s and it waits 0.3 s, not 1.1.
LOOK_S = 0.2


@pytest.fixture
def keyed(tmp_path: Path) -> Install:
    """An install whose gateway needs a key from ``etc/gateway-keys`` (alice's and bob's)."""
    return make_keyed_install(tmp_path, ALICE, BOB)


@pytest.fixture
async def gateway(keyed: Install) -> AsyncIterator[str]:
    async with serving(keyed, stop_s=10):
        yield f"http://127.0.0.1:{keyed.ports['gateway']}/v1/models"


@pytest.fixture
def looks_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway started after this looks at its keys file every :data:`LOOK_S` (the constructor's
    own ``check_every_s``), not every second."""
    monkeypatch.setattr(startcheck, "GatewayKeys", functools.partial(GatewayKeys, check_every_s=LOOK_S))


async def _status(client: httpx.AsyncClient, url: str, key: str) -> int:
    return (await client.get(url, headers={"Authorization": f"Bearer {key}"})).status_code


async def test_a_removed_key_is_refused_within_a_second(keyed: Install, gateway: str) -> None:
    keys = keyed.paths.etc / "gateway-keys"
    async with httpx.AsyncClient() as client:
        assert await _status(client, gateway, ALICE) == 200
        assert await _status(client, gateway, BOB) == 200
        keys.write_text(f"{BOB}\n")  # in place, as `sed -i`-less editors do
        # The file is looked at, at most a second apart, on the request path: a request more than a
        # second after the change has seen it, whatever the machine's load.
        await asyncio.sleep(1.1)
        assert await _status(client, gateway, ALICE) == 401
        assert await _status(client, gateway, BOB) == 200
        new = keys.with_suffix(".new")
        new.write_text(f"{ALICE}\n")
        new.replace(keys)  # atomically, as editors and config managers do: a new inode
        await asyncio.sleep(1.1)
        assert await _status(client, gateway, ALICE) == 200
        assert await _status(client, gateway, BOB) == 401


async def test_a_broken_keys_file_keeps_the_last_good_keys(
    looks_often: None, keyed: Install, gateway: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = keyed.paths.etc / "gateway-keys"
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient() as client:
        assert await _status(client, gateway, ALICE) == 200
        keys.write_text(f"{BOB}\nthis line has spaces in it\n")
        await asyncio.sleep(LOOK_S + 0.1)
        assert await _status(client, gateway, ALICE) == 200  # the last good keys
        assert await _status(client, gateway, BOB) == 200
        await asyncio.sleep(LOOK_S + 0.1)
        assert await _status(client, gateway, ALICE) == 200
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, errors  # once per version of the file, not once a look
        assert f"gateway.keys_file {keys}: line 2 is not a key" in errors[0]
        assert "still using the 2 keys loaded before" in errors[0]
        assert "spaces in it" not in errors[0]  # a line may be a secret: never echoed
        keys.unlink()
        await asyncio.sleep(LOOK_S + 0.1)
        assert await _status(client, gateway, ALICE) == 200
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert "gateway-keys does not exist" in errors[-1]
        keys.write_text(f"{BOB}\n")
        await asyncio.sleep(LOOK_S + 0.1)
        assert await _status(client, gateway, ALICE) == 401
        assert await _status(client, gateway, BOB) == 200
