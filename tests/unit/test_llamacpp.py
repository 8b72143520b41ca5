"""llama-server: lookup order, version and help parsing, and the argv of a replica.

Lookup tests use temp dirs and a fake executable shell script (it is only found and asked
``--version``/``--help``, never served from). The help text is an excerpt of the real
llama-server's ``--help`` (the build scripts/assets makes).
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from llmgw.agent.engines import llamacpp
from llmgw.agent.engines.llamacpp import LlamaServer, build_argv, drop_owned, parse_help_flags, parse_version
from llmgw.config import AgentConfig
from llmgw.protocol import ProvisionState, ReplicaSpec

HELP_EXCERPT = """\
-c,    --ctx-size N                     size of the prompt context (default: 0, 0 = loaded from model)
-t,    --threads N                      number of CPU threads to use during generation (default: -1)
-tb,   --threads-batch N                number of threads to use during batch and prompt processing (default:
                                        same as --threads)
-dev,  --device <dev1,dev2,..>          comma-separated list of devices to use for offloading (none = don't
-m,    --model FNAME                    model path to load
-cram, --cache-ram N                    set the maximum cache size in MiB (default: 8192, -1 - no limit, 0 -
-np,   --parallel N                     number of server slots (default: -1, -1 = auto)
-a,    --alias STRING                   set model name aliases, comma-separated (to be used by API)
--host HOST                             IP addresses to listen on, comma-separated, or UNIX socket paths
--port PORT                             port to listen (default: 8080)
--ui,  --webui, --no-ui, --no-webui     whether to enable the Web UI (default: enabled)
--api-key KEY                           API key to use for authentication, multiple keys can be provided as a
--api-key-file FNAME                    path to file containing API keys, one per line; lines starting with a
--metrics                               enable prometheus compatible metrics endpoint (default: disabled)
-fit,  --fit [on|off]                   whether to adjust unset arguments to fit in device memory ('on' or
"""
FLAGS = parse_help_flags(HELP_EXCERPT)
SERVER = LlamaServer(binary=Path("/opt/llama/llama-server"), version="1234", flags=FLAGS)


def spec(**kw: object) -> ReplicaSpec:
    base: dict[str, object] = {
        "id": "r1",
        "model": "gemma",
        "version": "v1",
        "profile": "cpu",
        "engine": "llamacpp",
        "source_url": "http://mirror/gemma/v1/g.gguf",
        "file_name": "g.gguf",
        "key": "k3y",
    }
    return ReplicaSpec.model_validate(base | kw)


def argv_for(
    s: ReplicaSpec,
    *,
    gpus: bool = False,
    server: LlamaServer = SERVER,
    key_file: Path | None = None,
    threads: int | None = None,
    max_threads: int | None = None,
) -> list[str]:
    return build_argv(
        server,
        s,
        model_path=Path("/c/g.gguf"),
        host="127.0.0.1",
        port=4321,
        node_cores=8,
        node_has_gpus=gpus,
        key=s.key,
        key_file=key_file,
        threads=threads,
        max_threads=max_threads,
    )


def flag_count(argv: list[str], *spellings: str) -> int:
    return sum(1 for a in argv if a.split("=", 1)[0] in spellings)


def value_of(argv: list[str], *spellings: str) -> str:
    for i, a in enumerate(argv):
        if a in spellings:
            return argv[i + 1]
        if a.split("=", 1)[0] in spellings:
            return a.split("=", 1)[1]
    raise AssertionError(f"{spellings} not in {argv}")


# --- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("version: 1234 (abcd)\nbuilt with cc for x86_64", "1234"),
        ("version: 6512 (a1b2c3d4)", "6512"),
        ("ggml_cuda_init: found 1 CUDA devices\nversion: 7312 (0c1e570)", "7312"),
        ("version: 0.5.0-dev (build 1, commit 0c1e570)", "0.5.0-dev"),
        ("no idea", ""),
    ],
)
def test_parse_version(text: str, version: str) -> None:
    assert parse_version(text) == version


def test_parse_help_flags() -> None:
    assert {"-np", "--parallel", "-cram", "--cache-ram", "--api-key-file", "--no-webui", "-dev"} <= FLAGS
    assert "FNAME" not in FLAGS
    assert "N" not in FLAGS


# --- argv -----------------------------------------------------------------------------------------


def test_argv_defaults() -> None:
    argv = argv_for(spec(args=["--ctx-size", "16384"]))
    assert argv[:3] == ["/opt/llama/llama-server", "-m", "/c/g.gguf"]
    assert argv[3:5] == ["--ctx-size", "16384"]
    assert value_of(argv, "--host") == "127.0.0.1"
    assert value_of(argv, "--port") == "4321"
    assert value_of(argv, "--threads") == "8"  # cpu_cores 0: the node's cores
    assert value_of(argv, "--threads-batch") == "8"
    assert value_of(argv, "--parallel") == "4"
    assert value_of(argv, "--cache-ram") == "1024"
    assert value_of(argv, "--alias") == "gemma"
    assert "--no-webui" in argv
    assert "--device" not in argv  # no GPUs on this node: nothing to keep the replica off
    assert value_of(argv, "--api-key") == "k3y"


SIZING = [("-c", "--ctx-size"), ("-np", "--parallel"), ("-cram", "--cache-ram"), ("-t", "--threads")]


@pytest.mark.parametrize(
    "profile",
    [[], ["-c", "512"], ["--ctx-size=512", "-np", "2"], ["-cram", "0", "-t", "1", "--parallel=1"]],
)
def test_every_sizing_flag_is_explicit_exactly_once(profile: list[str]) -> None:
    for gpus in (False, True):
        argv = argv_for(spec(args=profile), gpus=gpus)
        for spellings in SIZING:
            assert flag_count(argv, *spellings) == 1, (spellings, argv)
        assert flag_count(argv, "-tb", "--threads-batch") <= 1
    assert value_of(argv_for(spec()), "--ctx-size") == str(llamacpp.DEFAULT_CTX_SIZE)


def test_pinned_cores_set_threads() -> None:
    argv = argv_for(spec(cpu_cores=2), threads=1)
    assert value_of(argv, "--threads") == value_of(argv, "--threads-batch") == "1"


@pytest.mark.parametrize(
    ("profile", "cpu_cores", "threads", "max_threads", "want"),
    [
        ([], 0, None, 1, "1"),  # the node's 8 cores, capped
        ([], 2, None, 1, "1"),  # 2 reserved, capped
        ([], 0, 4, 2, "2"),  # pinned to 4, capped
        ([], 2, None, 4, "2"),  # a cap above the cores changes nothing
        (["-t", "3"], 0, None, 1, "3"),  # the profile's own --threads wins
    ],
)
def test_max_threads_caps_the_threads_the_agent_chooses(
    profile: list[str], cpu_cores: int, threads: int | None, max_threads: int, want: str
) -> None:
    """``engines.max_threads`` bounds the threads the agent picks (node, reservation, pinning), not a profile's."""
    argv = argv_for(spec(args=profile, cpu_cores=cpu_cores), threads=threads, max_threads=max_threads)
    assert value_of(argv, "-t", "--threads") == want
    if not profile:
        assert value_of(argv, "--threads-batch") == want


def test_argv_reserved_cores() -> None:
    argv = argv_for(spec(cpu_cores=2))
    assert value_of(argv, "--threads") == value_of(argv, "--threads-batch") == "2"


@pytest.mark.parametrize(
    ("profile", "name", "spellings", "value"),
    [
        (["--cache-ram", "0"], "cache-ram", ("-cram", "--cache-ram"), "0"),
        (["-cram", "0"], "cache-ram", ("-cram", "--cache-ram"), "0"),
        (["--cache-ram=0"], "cache-ram", ("-cram", "--cache-ram"), "0"),
        (["-np", "1"], "parallel", ("-np", "--parallel"), "1"),
        (["--parallel", "8"], "parallel", ("-np", "--parallel"), "8"),
        (["-a", "other"], "alias", ("-a", "--alias"), "other"),
        (["-t", "3"], "threads", ("-t", "--threads"), "3"),
        (["--device", "CUDA0"], "device", ("-dev", "--device"), "CUDA0"),
    ],
)
def test_profile_overrides_without_duplicates(
    profile: list[str], name: str, spellings: tuple[str, ...], value: str
) -> None:
    argv = argv_for(spec(args=profile), gpus=True)
    assert flag_count(argv, *spellings) == 1, argv
    assert value_of(argv, *spellings) == value


def test_profile_threads_also_governs_threads_batch() -> None:
    argv = argv_for(spec(args=["--threads", "3"], cpu_cores=2))
    assert flag_count(argv, "-tb", "--threads-batch") == 0  # llama-server makes -tb follow -t


def test_profile_webui_choice_is_kept() -> None:
    argv = argv_for(spec(args=["--webui"]))
    assert flag_count(argv, "--webui", "--no-webui", "--ui", "--no-ui") == 1


def test_fit_is_off_unless_the_profile_sets_it() -> None:
    """llama-server's --fit would lower an unset -c/-ngl to the free memory it sees at start, behind
    placement's back; off, unless the profile chooses (either spelling), and not for a build without it."""
    assert value_of(argv_for(spec()), "-fit", "--fit") == "off"
    assert value_of(argv_for(spec(gpu_indexes=[0]), gpus=True), "-fit", "--fit") == "off"
    for args in (["--fit", "on"], ["-fit", "on"], ["--fit=on"]):
        argv = argv_for(spec(args=args))
        assert flag_count(argv, "-fit", "--fit") == 1
        assert value_of(argv, "-fit", "--fit") == "on"
    old = LlamaServer(binary=SERVER.binary, flags=FLAGS - {"-fit", "--fit"})
    assert flag_count(argv_for(spec(), server=old), "-fit", "--fit") == 0


def test_cpu_profile_on_gpu_node_gets_device_none() -> None:
    assert value_of(argv_for(spec(), gpus=True), "-dev", "--device") == "none"
    assert "--device" not in argv_for(spec(gpu_indexes=[0]), gpus=True)


def test_agent_owned_flags_are_dropped_from_profile() -> None:
    s = spec(args=["--port", "80", "--host=0.0.0.0", "-m", "/etc/passwd", "--api-key", "x", "-c", "4096"])
    argv = argv_for(s)
    assert flag_count(argv, "--port") == flag_count(argv, "--host") == flag_count(argv, "-m", "--model") == 1
    assert value_of(argv, "--port") == "4321"
    assert value_of(argv, "-m") == "/c/g.gguf"
    assert value_of(argv, "--api-key") == "k3y"
    assert value_of(argv, "-c") == "4096"
    kept, dropped = drop_owned(s.args)
    assert kept == ["-c", "4096"]
    assert dropped == ["--port", "80", "--host=0.0.0.0", "-m", "/etc/passwd", "--api-key", "x"]


def test_key_by_file_when_the_build_knows_it(tmp_path: Path) -> None:
    argv = argv_for(spec(), key_file=tmp_path / "api-key")
    assert value_of(argv, "--api-key-file") == str(tmp_path / "api-key")
    assert "k3y" not in argv  # argv is readable by every user in /proc
    old = LlamaServer(binary=SERVER.binary, flags=FLAGS - {"--api-key-file"})
    assert value_of(argv_for(spec(), server=old, key_file=tmp_path / "api-key"), "--api-key") == "k3y"


def test_unknown_defaults_are_not_passed() -> None:
    old = LlamaServer(binary=SERVER.binary, flags=FLAGS - {"--cache-ram", "--no-webui", "--metrics"})
    argv = argv_for(spec(), server=old)
    assert "--cache-ram" not in argv
    assert "--no-webui" not in argv


def test_free_port_is_bindable() -> None:
    port = llamacpp.free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# --- lookup ---------------------------------------------------------------------------------------


def fake_server(path: Path, version_line: str = "version: 4242 (feedbee)", code: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "{version_line}" >&2; exit {code}; fi\n'
        "echo '--api-key-file FNAME   keys file'\n"
        "echo '-np,   --parallel N    slots'\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def cfg(tmp_path: Path, binary: Path | None = None) -> AgentConfig:
    engines = {"llamacpp": {"binary": str(binary)}} if binary else {}
    return AgentConfig.model_validate(
        {
            "server": "https://cp:7443",
            "node_id": "n1",
            "tls": {"ca": tmp_path / "ca.pem", "cert": tmp_path / "a.pem", "key": tmp_path / "k.pem"},
            "engines": engines,
        }
    )


def test_lookup_order(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path_dir = tmp_path / "bin"
    path_dir.mkdir()
    empty_path = str(tmp_path / "nothing")

    status, server = llamacpp.probe(cfg(tmp_path), state, path_env=empty_path)
    assert server is None
    assert status.state == ProvisionState.FAILED
    assert status.detail == llamacpp.NO_BINARY

    own_old = fake_server(state / "engines" / "llamacpp" / "b900" / "llama-server")
    own_new = fake_server(state / "engines" / "llamacpp" / "b4242" / "bin" / "llama-server")
    assert llamacpp.locate(cfg(tmp_path), state, path_env=empty_path)[0] == own_new
    assert own_old in llamacpp.own_installs(state)

    on_path = fake_server(path_dir / "llama-server")
    binary, where = llamacpp.locate(cfg(tmp_path), state, path_env=str(path_dir))
    assert (binary, where) == (on_path, "on PATH")

    configured = fake_server(tmp_path / "opt" / "llama-server")
    status, server = llamacpp.probe(cfg(tmp_path, configured), state, path_env=str(path_dir))
    assert server is not None
    assert server.binary == configured
    assert status.state == ProvisionState.INSTALLED
    assert status.version == server.version == "4242"
    assert status.binary == str(configured)
    assert server.knows("--api-key-file")
    assert not server.knows("--cache-ram")


def test_configured_binary_must_exist_and_run(tmp_path: Path) -> None:
    on_path = tmp_path / "bin"
    fake_server(on_path / "llama-server")
    missing = tmp_path / "opt" / "llama-server"
    status, server = llamacpp.probe(cfg(tmp_path, missing), tmp_path, path_env=str(on_path))
    assert server is None  # no silent fallback to PATH when agent.yaml names a binary
    assert status.state == ProvisionState.FAILED
    assert str(missing) in status.detail
    assert "engines.llamacpp.binary" in status.detail

    plain = tmp_path / "plain-file"
    plain.write_text("not a program")
    status, server = llamacpp.probe(cfg(tmp_path, plain), tmp_path)
    assert server is None
    assert "chmod +x" in status.detail

    broken = fake_server(
        tmp_path / "broken" / "llama-server", "error while loading shared libraries", code=127
    )
    status, server = llamacpp.probe(cfg(tmp_path, broken), tmp_path)
    assert server is None
    assert "error while loading shared libraries" in status.detail


def test_path_lookup_uses_the_process_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_server(tmp_path / "bin" / "llama-server")
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ.get("PATH", ""))
    assert llamacpp.locate(cfg(tmp_path), tmp_path / "state")[1] == "on PATH"
