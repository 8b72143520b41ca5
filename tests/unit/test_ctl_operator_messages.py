"""What ``llmgw ctl`` says back to a new operator's mistakes and surprises (a report of 2026-12-05):

- ``ctl restart nosuch`` advised ``GET /api/v1/replicas`` where every other command names
  ``llmgw ctl replicas``;
- ``ctl model scale NAME -1`` was Typer's ``No such option: -1``;
- ``ctl model add`` of a model that fits on no node printed ``added … (replicas 1..1)`` and nothing else.

A real control plane (``serve`` in a thread, SQLite) driven through the real CLI.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import yaml
from typer.testing import CliRunner

from llmgw.adminclient import AdminClient
from llmgw.cli.main import app
from llmgw.control.store import ReplicaRow, open_store
from tests.helpers.control import TOKEN, Install, make_install
from tests.unit.test_ctl_model_rm import ThreadedControlPlane


@pytest.fixture
def cp(tmp_path: pathlib.Path) -> Iterator[Install]:
    inst = make_install(tmp_path / "root")
    with ThreadedControlPlane(inst):
        yield inst


def ctl(inst: Install, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", *args])
    return r.exit_code, r.output


def test_an_unknown_replica_is_listed_with_ctl_replicas(cp: Install) -> None:
    code, out = ctl(cp, "restart", "nosuch")
    assert code != 0
    assert out.strip().endswith(
        "404 no replica 'nosuch'; list them with 'llmgw ctl replicas' (GET /api/v1/replicas)")
    code, out = ctl(cp, "logs", "nosuch")
    assert code != 0
    assert out.strip().endswith(
        "404 no replica 'nosuch'; list them with 'llmgw ctl replicas' (GET /api/v1/replicas)")


def test_a_model_name_given_for_a_replica_lists_its_replicas(cp: Install) -> None:
    """``ctl logs tiny-b`` (a model's name) said only "no replica 'tiny-b'" (an operator's finding)."""
    admin = AdminClient(cp.admin, TOKEN)
    admin.add_model({"name": "m", "source": "http://m.test:8081/m/1/m.gguf", "scaling": {"min": 0, "max": 0},
                     "profiles": [{"name": "cpu", "min_memory_gb": 1}]})
    code, out = ctl(cp, "logs", "m")
    assert code != 0
    assert out.strip().endswith("404 'm' is a model, not a replica; it has no replica now")
    store = open_store(f"sqlite:///{cp.paths.database}")  # a replica on a node, as the leader places one
    rid = "m-0a1b2c"
    for _ in range(5):
        # The leader deletes a replica on a node it never saw (an orphan) at the next pass that reads
        # it: the pass add_model woke may come after this write (CI, 2026-12-06). Then written again.
        store.add_replica(ReplicaRow(rid, "m", "node-a", "cpu", "k"))
        code, out = ctl(cp, "restart", "m")
        if "it has no replica now" not in out:
            break
    store.close()
    assert code != 0
    assert out.strip().endswith(f"404 'm' is a model, not a replica; its replicas: {rid} ('llmgw ctl restart {rid}')")


def test_scale_to_a_negative_count_says_what_is_allowed(cp: Install) -> None:
    admin = AdminClient(cp.admin, TOKEN)
    admin.add_model({"name": "m", "source": "http://m.test:8081/m/1/m.gguf",
                     "profiles": [{"name": "cpu", "min_memory_gb": 1}]})
    code, out = ctl(cp, "model", "scale", "m", "-1")
    assert code == 2, out
    assert "replicas must be 0 or more, not -1" in out
    assert "No such option" not in out
    assert admin.model("m").scaling_min == 1  # nothing changed
    code, out = ctl(cp, "model", "scale", "m", "3", "--json")  # known options still parse
    assert code == 0, out
    assert (admin.model("m").scaling_min, admin.model("m").scaling_max) == (3, 3)
    code, out = ctl(cp, "model", "scale", "m", "0")
    assert (code, out) == (0, "m: scaling 0..0\n")


def _install_with_node_a(tmp_path: pathlib.Path) -> Install:
    """An install whose store knows ``node-a`` (2 cores, 4 GiB, llama.cpp installed), its heartbeat
    fresh for as long as a test runs."""
    from llmgw.control.store import default_url, open_store  # noqa: PLC0415
    from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState  # noqa: PLC0415

    inst = make_install(tmp_path / "root")
    store = open_store(default_url("", inst.paths.database))
    inv = Inventory(cores=2, memory_total_bytes=4 << 30, memory_available_bytes=4 << 30)
    engines = [EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")]
    store.upsert_node_heartbeat("node-a", Heartbeat(inventory=inv, engines=engines), 1e12)
    store.close()
    return inst


def test_add_of_a_model_that_fits_nowhere_points_at_explain_placement(tmp_path: pathlib.Path) -> None:
    """A node with 4 GiB: a model needing 100 GB is added (rc 0) and a ``!!`` line says it fits on no
    node, why, and to run ``explain-placement``; one needing 1 GB gets no such line."""
    inst = _install_with_node_a(tmp_path)
    src = "http://m.test:8081/m/1/m.gguf"
    with ThreadedControlPlane(inst):
        code, out = ctl(inst, "model", "add", "--name", "big", "--source", src, "--memory-gb", "100")
        assert code == 0, out
        lines = out.splitlines()
        assert lines[0] == "added big (replicas 1..1)"
        assert lines[1].startswith("!! big fits on no node now (node-a: ")
        assert "needs 100.0 GB memory, the node has 4.3 GB in all: too small" in lines[1]
        assert lines[1].endswith("); its replica stays pending until a node has room: see "
                                 "'llmgw ctl explain-placement big'")
        assert len(lines) == 2
        code, out = ctl(inst, "model", "add", "--name", "small", "--source", src, "--memory-gb", "1")
        assert (code, out) == (0, "added small (replicas 1..1)\n")


def test_add_with_no_node_at_all_says_so(cp: Install) -> None:
    code, out = ctl(cp, "model", "add", "--name", "m", "--source", "http://m.test:8081/m/1/m.gguf",
                    "--memory-gb", "1", "--replicas", "2")
    assert code == 0, out
    assert out.splitlines() == [
        "added m (replicas 2..2)",
        "!! m fits on no node now (no node has joined the cluster); its replicas stay pending until a node "
        "has room: see 'llmgw ctl explain-placement m'",
    ]


def test_set_profiles_that_fit_no_node_say_so_but_not_for_room_the_models_own_replicas_hold(
    tmp_path: pathlib.Path,
) -> None:
    """A node with 4 GiB and 2 cores. ``set-profiles`` asking 100 GB prints ``profiles set`` and a
    ``!!`` line (the node is too small whatever runs there); asking 2 GB, nothing more. A model whose
    own replica holds the node's 2 cores gets no warning when its new profile needs them again: the
    profile change replaces that replica, freeing them (an earlier new user's finding, carried:
    ``set-profiles`` never warned)."""
    from tests.helpers.waits import wait_for  # noqa: PLC0415

    inst = _install_with_node_a(tmp_path)
    src = "http://m.test:8081/m/1/m.gguf"

    def profiles(**profile: object) -> str:
        path = tmp_path / "profiles.yaml"
        path.write_text(yaml.safe_dump([{"name": "cpu", **profile}]))
        return str(path)

    with ThreadedControlPlane(inst):
        admin = AdminClient(inst.admin, TOKEN)
        code, out = ctl(inst, "model", "add", "--name", "m", "--source", src, "--memory-gb", "1")
        assert (code, out) == (0, "added m (replicas 1..1)\n")
        code, out = ctl(inst, "model", "set-profiles", "m", "-f", profiles(min_memory_gb=100))
        assert (code, out.splitlines()) == (0, [
            "m: profiles set; replicas restart onto them",
            "!! m: its profiles fit on no node (node-a: needs 100.0 GB memory, the node has 4.3 GB in all: too "
            "small); its replicas stay pending until a profile or a node changes: see 'llmgw ctl "
            "explain-placement m'",
        ]), out
        code, out = ctl(inst, "model", "set-profiles", "m", "-f", profiles(min_memory_gb=2))
        assert (code, out) == (0, "m: profiles set; replicas restart onto them\n")
        code, out = ctl(inst, "model", "rm", "m")
        assert code == 0, out

        code, out = ctl(inst, "model", "add", "--name", "c", "--source", src, "--memory-gb", "1", "--cpu-cores", "2")
        assert code == 0, out
        wait_for("c's replica placed on node-a", lambda: any(r.node == "node-a" for r in admin.replicas("c")), 10, 0.1)
        fits = admin.model_resources("c")["profiles"][0]["nodes"]
        assert [(n["fits"], n["kind"]) for n in fits] == [(False, "exhausted")]  # its own replica holds the cores
        code, out = ctl(inst, "model", "set-profiles", "c", "-f", profiles(min_memory_gb=2, cpu_cores=2))
        assert (code, out) == (0, "c: profiles set; replicas restart onto them\n")


def test_scale_past_the_room_there_is_says_so(tmp_path: pathlib.Path) -> None:
    """A node with 2 cores; a model of 2 cores a replica has one placed. ``scale c 2`` printed
    ``scaling 2..2`` alone while the second replica stayed pending (an operator's finding): now a
    ``!!`` line says how many are placed and why no node takes another; ``scale c 1`` says nothing."""
    from tests.helpers.waits import wait_for  # noqa: PLC0415

    inst = _install_with_node_a(tmp_path)
    with ThreadedControlPlane(inst):
        admin = AdminClient(inst.admin, TOKEN)
        code, out = ctl(inst, "model", "add", "--name", "c", "--source", "http://m.test:8081/m/1/m.gguf",
                        "--memory-gb", "1", "--cpu-cores", "2")
        assert code == 0, out
        wait_for("c's replica placed on node-a", lambda: any(r.node == "node-a" for r in admin.replicas("c")), 10, 0.1)
        code, out = ctl(inst, "model", "scale", "c", "2")
        assert code == 0, out
        lines = out.splitlines()
        assert lines[0] == "c: scaling 2..2"
        assert lines[1].startswith("!! c: 1 of 2 replicas placed, and no node can take another now (node-a: ")
        assert lines[1].endswith("the rest stay pending until a node has room: see 'llmgw ctl explain-placement c'")
        code, out = ctl(inst, "model", "scale", "c", "1")
        assert (code, out) == (0, "c: scaling 1..1\n")


@pytest.mark.parametrize(
    "args",
    [("key", "create", "k", "--rpm", "5.0"), ("key", "create", "k", "--tpm", "1e3"),
     ("key", "create", "k", "--budget-tokens", "100.0", "--budget-period", "day"), ("model", "scale", "m", "2.0"),
     ("model", "add", "--name", "x", "--source", "http://m.test:8081/m/1/m.gguf", "--replicas", "2.0")],
)
def test_counts_on_the_command_line_are_whole_numbers_as_typed(cp: Install, args: tuple[str, ...]) -> None:
    """Typer read ``--rpm 5.0`` as 5 (an operator's finding), where the API refuses 5.0 for a count:
    refused before anything is sent, naming the option."""
    code, out = ctl(cp, *args)
    assert code == 2, out
    assert f"'{args[-1] if args[-2] != '--budget-period' else args[4]}' is not a whole number" in out
    assert AdminClient(cp.admin, TOKEN).keys() == []
