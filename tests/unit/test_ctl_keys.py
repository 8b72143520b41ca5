"""``llmgw ctl key …`` and ``llmgw ctl usage`` through the real CLI against a real control plane
(``serve`` in a thread, SQLite), and the gateway taking the keys they make; bad input gets clear 400s."""

from __future__ import annotations

import calendar
import json
import pathlib
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.guard.config import key_id
from tests.helpers.control import TOKEN, Install, make_install
from tests.unit.test_ctl_model_rm import ThreadedControlPlane

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def cp(tmp_path: pathlib.Path) -> Iterator[Install]:
    inst = make_install(tmp_path)
    inst.write(gateway={"listen": f"127.0.0.1:{inst.ports['gateway']}", "allow_loopback_without_key": False})
    with ThreadedControlPlane(inst):
        yield inst


def _ctl(inst: Install, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", *args])
    return r.exit_code, r.output


def _gateway_models(inst: Install, secret: str) -> httpx.Response:
    url = f"http://127.0.0.1:{inst.ports['gateway']}/v1/models"
    return httpx.get(url, headers={"Authorization": f"Bearer {secret}"})


def test_create_list_rotate_revoke_through_the_cli(cp: Install) -> None:
    code, out = _ctl(cp, "key", "create", "team-a", "--models", "chat,gemma", "--rpm", "60",
                     "--budget-tokens", "100000", "--budget-period", "day", "--expires", "30d")
    assert code == 0, out
    secret = next(ln for ln in out.splitlines() if ln.startswith("sk-llmgw-"))
    assert len(secret) == 9 + 43
    assert "not shown again" in out
    # neither model is in this catalog: said, and the key kept (a new user's report)
    assert "!! no model or alias 'chat' in the catalog yet" in out
    assert "!! no model or alias 'gemma' in the catalog yet" in out
    code, out = _ctl(cp, "key", "ls", "--json")
    (key,) = json.loads(out)
    assert key["prefix"] == secret[:16]
    assert key["id"] == key_id(secret)  # what a guard policy's keys name it by (no command gave it)
    assert secret not in out
    assert (key["models"], key["rpm"], key["budget_tokens"], key["budget_period"], key["state"]) == (
        ["chat", "gemma"], 60, 100000, "day", "active")
    assert 29.9 * 86400 < key["expires_at"] - time.time() <= 30 * 86400
    code, out = _ctl(cp, "key", "ls")
    assert "team-a" in out
    assert "60 rpm" in out

    t0 = time.monotonic()
    while _gateway_models(cp, secret).status_code != 200:  # the gateway reads stored keys every 0.5 s
        assert time.monotonic() - t0 < 3
        time.sleep(0.1)
    code, out = _ctl(cp, "key", "rotate", "team-a")
    assert code == 0, out
    new = next(ln for ln in out.splitlines() if ln.startswith("sk-llmgw-"))
    assert new != secret
    # the id a guard policy would list, and the name that outlives it (a new user's finding: a rotated
    # key left its policy silently, and no command showed a key's id)
    assert f"Its id for a guard policy's keys: {key_id(new)} (key_names: [\"team-a\"] names it" in " ".join(out.split())
    t0 = time.monotonic()
    while _gateway_models(cp, new).status_code != 200:
        assert time.monotonic() - t0 < 1.5, "a rotated key's new secret was not taken within 1.5 s"
        time.sleep(0.05)
    assert _gateway_models(cp, secret).status_code == 401
    code, out = _ctl(cp, "key", "revoke", "team-a")
    assert code == 0
    assert "revoked" in out
    t0 = time.monotonic()
    while _gateway_models(cp, new).status_code != 401:
        assert time.monotonic() - t0 < 1.5, "a revoked key was still taken after 1.5 s"
        time.sleep(0.05)
    code, out = _ctl(cp, "key", "rotate", "team-a")
    assert code == 1
    assert "revoked" in out
    code, out = _ctl(cp, "usage", "--json")
    assert code == 0
    assert json.loads(out) == []


def test_a_key_limited_to_models_not_served_is_told_which_it_may_use(cp: Install) -> None:
    """A key whose model list names nothing served gets a 404 that says what the key may use, not
    "known models: (none yet)" (a new user's report)."""
    code, out = _ctl(cp, "key", "create", "solo", "--models", "nosuch")
    assert code == 0, out
    assert "!! no model or alias 'nosuch' in the catalog yet" in out
    secret = next(ln for ln in out.splitlines() if ln.startswith("sk-llmgw-"))
    t0 = time.monotonic()
    while _gateway_models(cp, secret).status_code != 200:  # the gateway reads stored keys every 0.5 s
        assert time.monotonic() - t0 < 3
        time.sleep(0.1)
    chat = httpx.post(f"http://127.0.0.1:{cp.ports['gateway']}/v1/chat/completions",
                      json={"model": "gemma", "messages": [{"role": "user", "content": "hi"}]},
                      headers={"Authorization": f"Bearer {secret}"})
    assert chat.status_code == 404
    assert "none this key may use (it may use only nosuch" in chat.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"name": "Bad Name"}, "name: 'Bad Name' is not a valid key name"),
        ({"name": "k", "rpm": 0}, "rpm: Input should be greater than 0"),
        ({"name": "k", "rpm": "many"}, "rpm: Input should be a valid integer"),
        ({"name": "k", "budget_tokens": 10}, "budget_tokens and budget_period go together"),
        ({"name": "k", "budget_tokens": 10, "budget_period": "week"}, "Input should be 'day' or 'month'"),
        ({"name": "k", "expires": "soon"}, "expires 'soon' is not a duration: a number and a unit, e.g. 90s, 30m"),
        # a new user's finding: 5000d was 'at most ten years' but 99999999d 'not a duration'
        ({"name": "k", "expires": "99999999d"}, "expires '99999999d' must be more than 0 and at most ten years"),
        ({"name": "k", "models": ["Not A Model"]}, "is not a valid model name"),
        ({"name": "k", "secret": "mine"}, "secret: Extra inputs are not permitted"),
        ([1, 2], "Input should be a valid dictionary"),
        # the usage names of the keys file's keys and of loopback clients (a new user's finding: a
        # stored key named so merged its usage with theirs)
        ({"name": "keys-file"}, "'keys-file' is the name usage, metrics and the access log give the keys file's"),
        ({"name": "loopback"}, "'loopback' is the name usage, metrics and the access log give loopback clients"),
    ],
)
def test_bad_key_specs_are_400_saying_what_is_wrong(cp: Install, body: object, says: str) -> None:
    r = httpx.post(cp.admin + "/api/v1/keys", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("since=yesterday", "since 'yesterday' is not a duration"),
        ("since=2027-02-30", "is not a date"),
        ("since=2026-12-01&until=2026-11-01", "is after until"),
        # a new user's finding: two durations on the same UTC day, backwards, answered the whole day
        ("since=30m&until=1h", "since (30m ago) is after until (1h ago)"),
        ("since=2020-01-01", "at most 400"),
    ],
)
def test_bad_usage_ranges_are_400(cp: Install, query: str, says: str) -> None:
    r = httpx.get(cp.admin + "/api/v1/usage?" + query, headers=AUTH)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def test_a_day_and_a_duration_or_two_durations_in_order_are_a_range(cp: Install) -> None:
    for query in ("since=3d&until=1d", "since=2h&until=30m", "since=2026-01-01&until=1d"):
        r = httpx.get(cp.admin + "/api/v1/usage?" + query, headers=AUTH)
        assert r.status_code == 200, (query, r.text)


def test_duplicate_and_unknown_keys(cp: Install) -> None:
    assert httpx.post(cp.admin + "/api/v1/keys", json={"name": "dup"}, headers=AUTH).status_code == 201
    r = httpx.post(cp.admin + "/api/v1/keys", json={"name": "dup"}, headers=AUTH)
    assert r.status_code == 409
    assert "already exists" in r.json()["error"]["message"]
    r = httpx.post(cp.admin + "/api/v1/keys/nobody/revoke", headers=AUTH)
    assert r.status_code == 404
    assert "ctl key ls" in r.json()["error"]["message"]


def test_a_revoked_keys_name_stays_taken_and_the_messages_say_so(cp: Install) -> None:
    """A new user's report: set/rotate of a revoked key said 'create a new one instead', and create
    under its name said 'already exists; ... or rotate it': a circle. A revoked key's name stays
    taken (usage and budgets are counted by name), and every message says to pick another name."""
    assert _ctl(cp, "key", "create", "bob")[0] == 0
    code, out = _ctl(cp, "key", "revoke", "bob")
    assert code == 0, out
    ((when,),) = [re.findall(r"key 'bob' revoked at ([0-9-]+ [0-9:]+) UTC", out)]
    code, out = _ctl(cp, "key", "revoke", "bob")  # again: said so, its time unchanged (it was silent)
    assert (code, out.strip()) == (0, f"key 'bob' was already revoked at {when} UTC; nothing changed")
    code, out = _ctl(cp, "key", "create", "bob")
    assert code == 1, out
    assert "the name 'bob' belongs to a revoked key" in out
    assert "pick another name" in out
    assert "rotate" not in out
    for args in (("rotate", "bob"), ("set", "bob", "--rpm", "5")):
        code, out = _ctl(cp, "key", *args)
        assert code == 1, out
        assert "key 'bob' is revoked" in out
        assert "make a new key under another name" in out
        assert "create a new one instead" not in out
    r = httpx.post(cp.admin + "/api/v1/keys", json={"name": "bob"}, headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "conflict"), r.text
    code, out = _ctl(cp, "key", "create", "bob-2")
    assert code == 0, out


def test_create_prints_the_expiry_it_set(cp: Install) -> None:
    """A new user's report: 'key create exp --expires 1m' printed no expiry at all."""
    code, out = _ctl(cp, "key", "create", "exp", "--expires", "1m")
    assert code == 0, out
    ((_, when),) = re.findall(r"made key 'exp' \(-; models: all; priority: 0; expires: (([0-9-]+ [0-9:]+) UTC)\)",
                              out)
    at = calendar.timegm(time.strptime(when, "%Y-%m-%d %H:%M"))
    assert time.time() - 60 < at <= time.time() + 60
    code, out = _ctl(cp, "key", "create", "forever")
    assert "made key 'forever' (-; models: all; priority: 0; expires: never)" in out
    code, out = _ctl(cp, "key", "rotate", "exp")
    assert f"rotated key 'exp' (-; models: all; priority: 0; expires: {when} UTC)" in out


def test_an_empty_models_option_is_refused_not_every_model(cp: Install) -> None:
    """A new user's finding: ``--models ''`` (an empty variable in a script) made a key for every model."""
    for args in (("key", "create", "m2", "--models", ""), ("key", "set", "m2", "--models", " , ")):
        code, out = _ctl(cp, *args)
        assert code == 2, out
        assert "names no model: give model names or aliases, comma-separated" in out
    code, out = _ctl(cp, "key", "ls")
    assert "m2" not in out


def test_usage_of_a_key_that_does_not_exist_is_an_error(cp: Install) -> None:
    """A new user's report: 'ctl usage --key nobody' printed 'no usage in that range' and exited 0."""
    code, out = _ctl(cp, "usage", "--key", "nobody")
    assert code == 1, out
    assert "no key 'nobody'" in out
    r = httpx.get(cp.admin + "/api/v1/usage?key=nobody", headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "key_not_found"), r.text
    assert _ctl(cp, "key", "create", "quiet")[0] == 0
    code, out = _ctl(cp, "usage", "--key", "quiet")
    assert (code, out.strip()) == (0, "no usage in that range")
    for name in ("keys-file", "loopback"):  # usage names that are no stored key's
        assert _ctl(cp, "usage", "--key", name)[0] == 0
    # a model: none may be a deleted model's history, so not an error
    code, out = _ctl(cp, "usage", "--model", "nope")
    assert code == 0, out
    assert "no usage of model 'nope' in that range ('llmgw ctl models' lists the models)" in " ".join(out.split())
    # an alias names its model, as elsewhere in ctl (a new user asked by alias, read "no usage", and was
    # pointed at 'llmgw ctl model ls', which does not exist)
    model = {"name": "m-usage", "aliases": ["mu"], "source": "http://127.0.0.1:9/m.gguf", "profiles": [{"name": "cpu"}]}
    assert httpx.post(cp.admin + "/api/v1/models", json=model, headers=AUTH).status_code == 201
    code, out = _ctl(cp, "usage", "--model", "mu")
    assert code == 0, out
    assert "no usage of model 'm-usage' in that range" in " ".join(out.split())


def test_patch_and_get_answer_the_keys_usage_as_the_list_does(cp: Install) -> None:
    """A new user's finding: ``PATCH /api/v1/keys/alice`` answered ``requests_today: 0`` while the list
    said 3; and there was no ``GET /api/v1/keys/{name}`` (405)."""
    made = httpx.post(cp.admin + "/api/v1/keys", json={"name": "alice"}, headers=AUTH)
    assert made.status_code == 201, made.text
    secret = made.json()["secret"]
    chat = httpx.post(f"http://127.0.0.1:{cp.ports['gateway']}/v1/chat/completions",
                      json={"model": "nosuch", "messages": [{"role": "user", "content": "hi"}]},
                      headers={"Authorization": f"Bearer {secret}"})
    assert chat.status_code == 404  # a request all the same: usage counts it

    def listed() -> dict[str, object]:
        (view,) = [k for k in httpx.get(cp.admin + "/api/v1/keys", headers=AUTH).json() if k["name"] == "alice"]
        return dict(view)

    deadline = time.monotonic() + 10
    while listed()["requests_today"] != 1:  # the gateway's usage is synced every 0.5 s
        assert time.monotonic() < deadline, listed()
        time.sleep(0.1)
    patched = httpx.patch(cp.admin + "/api/v1/keys/alice", json={"rpm": 3}, headers=AUTH)
    assert patched.status_code == 200, patched.text
    assert patched.json() == listed()
    assert patched.json()["requests_today"] == 1
    assert patched.json()["rpm"] == 3
    got = httpx.get(cp.admin + "/api/v1/keys/alice", headers=AUTH)
    assert got.json() == listed()
    missing = httpx.get(cp.admin + "/api/v1/keys/nobody", headers=AUTH)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "key_not_found")


@pytest.mark.parametrize("half", [["--budget-tokens", "10"], ["--budget-period", "month"]])
def test_a_budget_needs_both_flags_and_says_so_with_them(cp: Install, half: list[str]) -> None:
    """A new user's finding: ``key create dave --budget-tokens 10`` got the API's '400 budget_tokens and
    budget_period go together', naming fields rather than the flags to add. Refused before the call
    (exit 2), naming both flags; no key made."""
    code, out = _ctl(cp, "key", "create", "dave", *half)
    assert code == 2, out
    assert "--budget-tokens and --budget-period go together" in " ".join(out.split())
    assert "dave" not in _ctl(cp, "key", "ls")[1]
