"""The engine seam (:mod:`llmgw.agent.engines`): the registry, and each engine's answers to the
runner's questions (argv, environment, a taken port, the cause of a failure, readiness).

The argv expected here is what the runner built before the seam (its ``isinstance`` branches called
``llamacpp.build_argv`` / ``vllm.build_argv`` with these arguments). Readiness is checked against a
real HTTP server (aiohttp, port 0) standing in for llama-server's ``/slots`` and ``/completion``.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent.engines import ENGINES, engine_for
from llmgw.agent.engines.base import Installed, Launch, engine_environment
from llmgw.agent.engines.llamacpp import LLAMACPP, LlamaServer
from llmgw.agent.engines.vllm import VLLM, VllmServer
from llmgw.errors import EngineError
from llmgw.protocol import ReplicaSpec

LLAMA = LlamaServer(binary=Path("/opt/llama/llama-server"), version="1234")  # no --help: every default passed
VLLM_BUILD = VllmServer(binary=Path("/opt/vllm/bin/vllm"), version="0.33.0")


def spec(engine: str, args: list[str], **kw: object) -> ReplicaSpec:
    base: dict[str, object] = {
        "id": "r1",
        "model": "gemma",
        "version": "v1",
        "profile": "p",
        "engine": engine,
        "source_url": "http://mirror/gemma/v1/g.gguf",
        "file_name": "g.gguf",
        "key": "k3y",
        "args": args,
    }
    return ReplicaSpec.model_validate(base | kw)


def launch(s: ReplicaSpec, *, threads: int | None = None, gpus: bool = False) -> Launch:
    return Launch(
        spec=s,
        model_path=Path("/cache/gemma/v1/g.gguf"),
        host="127.0.0.1",
        port=40001,
        key_file=Path("/state/replicas/r1/api-key"),
        node_cores=8,
        node_has_gpus=gpus,
        threads=threads,
    )


def test_registry_names_each_engine_once() -> None:
    assert engine_for("llamacpp") is LLAMACPP
    assert engine_for("vllm") is VLLM
    assert sorted(ENGINES) == ["llamacpp", "vllm"]
    assert (LLAMACPP.label, VLLM.label) == ("llama-server", "vllm")


def test_unknown_engine_is_an_engine_error_that_says_what_to_do() -> None:
    with pytest.raises(EngineError) as e:
        engine_for("sglang")
    assert str(e.value) == (
        "engine 'sglang' is not run by this agent (it runs llamacpp and vllm); place the model with a llamacpp profile"
    )


def test_llamacpp_argv_for_a_sample_profile() -> None:
    s = spec("llamacpp", ["-c", "8192", "--port", "1", "-ngl", "99"], cpu_cores=2)
    assert LLAMACPP.argv(LLAMA, launch(s, threads=2)) == [
        "/opt/llama/llama-server",
        "-m",
        "/cache/gemma/v1/g.gguf",
        "-c",
        "8192",
        "-ngl",
        "99",
        "--host",
        "127.0.0.1",
        "--port",
        "40001",
        "--threads",
        "2",
        "--threads-batch",
        "2",
        "--api-key-file",
        "/state/replicas/r1/api-key",
        "--parallel",
        "4",
        "--cache-ram",
        "1024",
        "--alias",
        "gemma",
        "--no-webui",
        "--metrics",
        "--fit",
        "off",
    ]


def test_llamacpp_argv_unpinned_cpu_replica_on_a_gpu_node() -> None:
    """Not pinned and no cores reserved: the node's cores; a CPU replica on a GPU node gets no GPU."""
    argv = LLAMACPP.argv(LLAMA, launch(spec("llamacpp", []), gpus=True))
    assert argv[argv.index("--threads") + 1] == "8"
    assert argv[-2:] == ["--device", "none"]
    assert argv[argv.index("--ctx-size") + 1] == "4096"


def test_vllm_argv_for_a_sample_profile() -> None:
    s = spec("vllm", ["--max-model-len", "4096", "--api-key", "leak", "--host=0.0.0.0"], gpu_indexes=[0])
    assert VLLM.argv(VLLM_BUILD, launch(s, threads=3)) == [
        "/opt/vllm/bin/vllm",
        "serve",
        "/cache/gemma/v1/g.gguf",
        "--max-model-len",
        "4096",
        "--host",
        "127.0.0.1",
        "--port",
        "40001",
        "--served-model-name",
        "gemma",
    ]


def test_environment_scrubbed_then_the_engines_own() -> None:
    base = engine_environment(
        {"PATH": "/bin", "LLAMA_ARG_CTX_SIZE": "1", "HF_TOKEN": "t", "LLAMA_API_KEY": "x"}, gpu_indexes=[2, 0]
    )
    assert base == {"PATH": "/bin", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,0"}
    assert LLAMACPP.environment(dict(base), "k3y") == base  # the key goes by --api-key-file
    assert VLLM.environment(dict(base), "k3y") == base | {"VLLM_API_KEY": "k3y", "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize(
    ("tail", "llama", "vllm"),
    [
        ("main: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 40001", True, False),
        ("ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 40001): address already in use",
         True, True),
        ("llama_model_load: error loading model: tensor data is not within the file bounds", False, False),
    ],
)
def test_port_taken(tail: str, llama: bool, vllm: bool) -> None:
    assert (LLAMACPP.port_taken(tail), VLLM.port_taken(tail)) == (llama, vllm)


def test_cause_is_the_engines_own_line() -> None:
    tail = "loading\nllama_model_load: error loading model: bad magic\nmain: exiting"
    assert LLAMACPP.cause(tail) == "error loading model: bad magic"
    assert VLLM.cause("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB") == (
        "out of memory. Tried to allocate 2 GiB"
    )
    assert LLAMACPP.cause("all fine") == ""


def test_usable_build_or_why_not() -> None:
    assert LLAMACPP.usable(Installed(LLAMA, "", 300.0)) is LLAMA
    with pytest.raises(EngineError, match=r"^vllm is not usable on this node: needs a GPU$"):
        VLLM.usable(Installed(None, "needs a GPU", 1200.0))


Serve = Callable[[dict[str, int]], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Starts a real HTTP server whose ``/slots`` and ``/completion`` answer the statuses asked
    (404 when not named; 403 without the replica's key); returns its base URL."""
    runners: list[web.AppRunner] = []

    async def start(statuses: dict[str, int]) -> str:
        async def answer(request: web.Request) -> web.Response:
            if request.headers.get("Authorization") != "Bearer k3y":
                return web.Response(status=403)
            return web.Response(status=statuses.get(request.path, 404))

        app = web.Application()
        app.router.add_get("/slots", answer)
        app.router.add_post("/completion", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for r in runners:
        await r.cleanup()


@pytest.mark.parametrize(
    ("statuses", "ready"),
    [
        ({"/slots": 200}, True),  # the task loop answered
        ({"/slots": 501, "/completion": 200}, True),  # --no-slots: a 1-token completion answered
        ({"/completion": 200}, True),  # a build without /slots at all (404)
        ({"/slots": 503, "/completion": 200}, False),  # /slots answered, but not ok
        ({"/slots": 501, "/completion": 500}, False),
    ],
)
async def test_llamacpp_serving_asks_the_task_loop(serve: Serve, statuses: dict[str, int], ready: bool) -> None:
    base = await serve(statuses)
    async with aiohttp.ClientSession() as session:
        assert await LLAMACPP.serving(session, base, "k3y") is ready
        assert await LLAMACPP.serving(session, base, "wrong") is False
        assert await VLLM.serving(session, base, "k3y") is True  # vLLM's /health 200 is enough


async def test_llamacpp_serving_false_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nothing listens once closed
    async with aiohttp.ClientSession() as session:
        assert await LLAMACPP.serving(session, f"http://127.0.0.1:{port}", "k3y") is False
