"""``llmgw ctl model set NAME KEY=VALUE…`` (a new user had to write curl with the admin token to change
a model's queue, routing, max_output or autoscaling target): the assignments as a merge patch
(:mod:`llmgw.modelpatch`), and the real CLI against a real control plane (``serve`` in a thread)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from llmgw.adminclient import AdminClient
from llmgw.cli.main import app
from llmgw.modelpatch import AssignmentError, assignments_text, merge_patch
from tests.helpers.control import TOKEN, Install, make_install
from tests.unit.test_ctl_model_rm import ThreadedControlPlane


def test_assignments_become_a_merge_patch_with_yaml_values() -> None:
    patch = merge_patch(["scaling.target=2.5", "scaling.max=4", "queue.size=0", "routing=round-robin",
                         "aliases=[a, b]", "max_output=null", "version='007'"])
    assert patch == {"scaling": {"target": 2.5, "max": 4}, "queue": {"size": 0}, "routing": "round-robin",
                     "aliases": ["a", "b"], "max_output": None, "version": "007"}
    assert assignments_text(patch) == ["scaling.target=2.5", "scaling.max=4", "queue.size=0",
                                       "routing=round-robin", "aliases=[a, b]", "max_output=null", "version='007'"]


@pytest.mark.parametrize(("args", "words"), [
    (["scaling.target"], "is not KEY=VALUE"),
    (["=2"], "is not KEY=VALUE"),
    (["scaling..min=1"], "is not KEY=VALUE"),
    (["queue.size=1", "queue.size=2"], "queue.size is set twice"),
    (["scaling=null", "scaling.min=1"], "scaling is set to a value already"),
    (["routing=[a"], "is not valid YAML"),
    # YAML's NaN and infinity: the CLI crashed with a traceback encoding them (a new user's finding)
    (["scaling.target=.nan"], "'scaling.target=.nan': .nan is not a finite number"),
    (["scaling.target=-.inf"], "is not a finite number"),
    (["aliases=[a, .inf]"], "is not a finite number"),
])
def test_a_bad_assignment_says_what_to_write(args: list[str], words: str) -> None:
    with pytest.raises(AssignmentError, match=words.replace(".", r"\.").replace("[", r"\[")):
        merge_patch(args)


@pytest.fixture
def cp(tmp_path: pathlib.Path) -> Iterator[tuple[Install, AdminClient]]:
    inst = make_install(tmp_path)
    with ThreadedControlPlane(inst):
        admin = AdminClient(f"http://127.0.0.1:{inst.ports['admin']}", TOKEN)
        admin.post("/api/v1/models", {"name": "gemma", "aliases": ["g"], "source": "http://m.test/g.gguf",
                                      "profiles": [{"name": "cpu"}]})
        yield inst, admin


def _set(inst: Install, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", "model", "set", *args])
    return r.exit_code, r.output


def test_set_changes_the_fields_and_says_what_it_set(cp: tuple[Install, AdminClient]) -> None:
    inst, admin = cp
    code, out = _set(inst, "g", "queue.size=0", "queue.wait_s=7.5", "routing=round-robin", "max_output=256",
                     "scaling.max=3", "scaling.target=2")
    assert code == 0, out
    assert out.strip() == ("gemma (alias g): set queue.size=0, queue.wait_s=7.5, routing=round-robin, "
                           "max_output=256, scaling.max=3, scaling.target=2")
    spec = admin.get("/api/v1/models/gemma")["spec"]
    assert (spec["queue"], spec["routing"], spec["max_output"]) == ({"size": 0, "wait_s": 7.5}, "round-robin", 256)
    assert (spec["scaling"]["max"], spec["scaling"]["target"]) == (3, 2.0)
    code, out = _set(inst, "gemma", "max_output=null")  # back to its default
    assert code == 0, out
    assert admin.get("/api/v1/models/gemma")["spec"].get("max_output", 0) == 0


@pytest.mark.parametrize(("args", "code", "words"), [
    (["gemma", "queue.size=-1"], 1, "queue.size"),  # the API's 400 names the field
    (["gemma", "routing=fastest"], 1, "routing"),
    (["gemma", "queue.size"], 2, "'queue.size' is not KEY=VALUE"),  # refused before asking
    (["nosuch", "queue.size=1"], 1, "nosuch"),
])
def test_what_is_refused_says_why_and_changes_nothing(
    cp: tuple[Install, AdminClient], args: list[str], code: int, words: str
) -> None:
    inst, admin = cp
    got, out = _set(inst, *args)
    assert got == code, out
    assert words in out
    spec = admin.get("/api/v1/models/gemma")["spec"]
    assert (spec.get("routing", "cache-aware"), spec.get("queue", {}).get("size", 64)) == ("cache-aware", 64)


def test_a_number_typed_for_a_text_field_is_kept_as_typed() -> None:
    # `ctl model set tiny-b version=2` (rolling to version 2) was a 400 "version: Input should be a
    # valid string": YAML read 2 as a number. The version is text, so it is kept as typed.
    assert merge_patch(["version=2", "description=3.10", "scaling.min=2"]) == {
        "version": "2", "description": "3.10", "scaling": {"min": 2}}


def test_set_version_to_a_number_rolls_the_model(cp: tuple[Install, AdminClient]) -> None:
    inst, admin = cp
    code, out = _set(inst, "gemma", "version=2", "source=http://m.test/g2.gguf")
    assert code == 0, out
    assert admin.get("/api/v1/models/gemma")["spec"]["version"] == "2"


def test_a_number_for_a_version_in_model_yaml_says_to_quote_it(cp: tuple[Install, AdminClient]) -> None:
    inst, _ = cp
    f = inst.root / "m.yaml"
    f.write_text("name: other\nsource: http://m.test/o.gguf\nversion: 2\nprofiles: [{name: cpu}]\n")
    r = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", "model", "add", "-f", str(f)])
    assert r.exit_code == 1, r.output
    assert 'version: 2 is a number; a version is text: quote it (version: "2")' in r.output
