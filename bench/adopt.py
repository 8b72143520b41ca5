"""Agent restart to replicas adopted: seconds from starting a new agent process to the control plane
seeing both replicas ``ready`` again with the same engine pids (nothing restarted).

One node, two CPU replicas of gemma-3-270m (1 core each) on the real llama-server, the real agent
API + store + leader in this process (tests/e2e/agent_world.py). The agent is restarted
``ROUNDS`` times, alternating SIGKILL and SIGTERM. Target: <= 2 s. Figures last, one
``name: value unit`` per line.

    .venv/bin/python bench/adopt.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.agent_world import make_cluster
from tests.helpers.net import serve_files

from llmgw.agent.node.records import stop_all_engines

ROUNDS = 4
CACHE = Path(os.environ.get("LLMGW_ASSETS", Path.home() / ".cache" / "llmgw"))
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER") or CACHE / "llama-cpp-0.3.36-rpc" / "bin" / "llama-server")
MODEL = Path(os.environ.get("MODEL") or CACHE / "models" / "gemma-3-270m-q4_k_m.gguf")


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        files = tmp / "files"
        files.mkdir()
        os.symlink(MODEL, files / "gemma.gguf")
        file_runner, files_url = await serve_files(files)
        cp, agent, model = make_cluster(tmp, llama_server=LLAMA_SERVER, files_url=files_url)
        await cp.start()
        assert cp.store is not None
        cp.store.add_model(model, now=cp.clock())

        def pids() -> dict[str, int | None]:
            return {r.id: r.pid for r in cp.reported() if r.state == "ready"}

        def last_seen() -> float:
            node = cp.store.get_node("node-1") if cp.store else None
            return node.last_seen if node else 0.0

        try:
            agent.start()
            first = await cp.wait(lambda: len(pids()) == 2, 120, "two replicas ready")
            print(f"first start (fetch + load of 2 engines): {first:.2f} s")
            before = pids()
            times = []
            for i in range(ROUNDS):
                if i % 2:
                    agent.term()
                else:
                    agent.kill9()
                await asyncio.sleep(0.5)  # let the control plane's view go stale for a beat
                t0 = time.monotonic()
                agent.start()
                # The first report after start is already the adopted one (same pids, ready).
                seen = last_seen()
                await cp.wait(lambda s=seen: last_seen() > s and pids() == before, 10, "adopted")
                times.append(time.monotonic() - t0)
                print(f"round {i + 1} ({'SIGTERM' if i % 2 else 'SIGKILL'}): {times[-1]:.2f} s")
            assert pids() == before, "an engine was restarted"
            print(f"adopt_median: {statistics.median(times):.2f} s")
            print(f"adopt_max: {max(times):.2f} s")
            print("engines_restarted: 0 count")
        finally:
            agent.term()
            stop_all_engines(agent.agent_state, grace_s=5)
            await cp.stop()
            await file_runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
