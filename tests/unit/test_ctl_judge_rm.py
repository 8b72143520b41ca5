"""``llmgw ctl model rm`` of a guard policy's judge says what the policy does now (a new user's finding:
the removal of a ``fail: closed`` policy's only judge said nothing, while ``scaling.min: 0`` for it is
refused), on a real control plane (``serve`` in a thread) with a guard block in server.yaml."""

from __future__ import annotations

import pathlib

import httpx
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.serverinit import plan
from tests.helpers.control import TOKEN, make_install
from tests.unit.test_ctl_model_rm import ThreadedControlPlane


def test_removing_the_only_judge_of_a_policy_says_what_the_policy_does_now(tmp_path: pathlib.Path) -> None:
    judge = plan.guard_model("http://127.0.0.1:9/q.gguf", 1, 2)
    inst = make_install(tmp_path, guard={"policies": [
        {"name": "strict", "judge": judge.name, "fail": "closed"},
        {"name": "lenient", "judge": [judge.name, "other-judge"], "fail": "open", "models": ["chat*"]},
    ]})
    with ThreadedControlPlane(inst):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = httpx.post(f"{inst.admin}/api/v1/models", json=judge.model_dump(mode="json"), headers=auth)
        assert r.status_code == 201, r.text
        out = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", "model", "rm", judge.name])
    assert out.exit_code == 0, out.output
    said = " ".join(out.output.split())
    assert f"removed {judge.name}" in said
    assert (f"!! guard policy 'strict' judged with {judge.name} and has no other judge ready: it now refuses every "
            "request it guards (503 judge_unavailable)") in said
    assert f"!! guard policy 'lenient' judged with {judge.name} and has no other judge ready: it now serves the " \
        "requests it guards unjudged" in said
