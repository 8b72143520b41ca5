"""``llmgw ctl node drain NODE`` says when a model it drained has nowhere else to go (a new user drained
the only node of a model, read ``cordoned and drained``, and the model served nothing until the node
was uncordoned). A real control plane (``serve``), nodes that register and heartbeat over real mTLS,
and the real CLI as a child process."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.helpers.control import TOKEN, Install, heartbeat, make_install, run_ctl, serving
from tests.helpers.waits import until

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _join(s: aiohttp.ClientSession, inst: Install, node: str) -> None:
    async with s.post(inst.agent_url + "/agent/v1/register", data=heartbeat(cores=8, memory_gb=16),
                      ssl=inst.agent_ctx(node)) as r:
        assert r.status == 200, await r.text()


async def _placed(s: aiohttp.ClientSession, inst: Install, model: str) -> list[str] | None:
    async with s.get(inst.admin + f"/api/v1/replicas?model={model}", headers=AUTH) as r:
        nodes = [x["node"] for x in await r.json() if x["node"]]
    return nodes or None


async def test_a_drain_that_leaves_a_model_nowhere_to_go_says_so_and_one_that_does_not_is_quiet(
    tmp_path: Path,
) -> None:
    inst = make_install(tmp_path)
    async with serving(inst), aiohttp.ClientSession() as s:
        await _join(s, inst, "node-a")
        for name, gb in (("small", 1), ("big", 12)):  # big fits on one 16 GB node at a time
            model = {"name": name, "source": f"http://m/{name}.gguf",
                     "profiles": [{"name": "cpu", "min_memory_gb": gb, "cpu_cores": 1}]}
            async with s.post(inst.admin + "/api/v1/models", json=model, headers=AUTH) as r:
                assert r.status == 201, await r.text()
        await until("both placed on node-a", lambda: _both(s, inst), within_s=10)
        await _join(s, inst, "node-b")
        async with s.post(inst.admin + "/api/v1/models", json={
            "name": "filler", "source": "http://m/f.gguf",
            "profiles": [{"name": "cpu", "min_memory_gb": 12, "cpu_cores": 1}],
        }, headers=AUTH) as r:
            assert r.status == 201, await r.text()
        await until("filler placed on node-b", lambda: _placed(s, inst, "filler"), within_s=10)

        code, out = await run_ctl(inst, "node", "drain", "node-a")
        assert code == 0, out
        assert "node-a: cordoned and drained" in out
        assert "!! big: no other node can take the replicas drained from node-a now (node-b:" in out, out
        assert "0 of its replicas are ready elsewhere" in out
        assert "'llmgw ctl explain-placement big'" in out
        assert "!! small" not in out  # node-b has room for it: nothing to say


async def _both(s: aiohttp.ClientSession, inst: Install) -> bool:
    return bool(await _placed(s, inst, "small")) and bool(await _placed(s, inst, "big"))
