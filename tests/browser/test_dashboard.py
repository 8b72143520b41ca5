"""The dashboard in a real browser (headless Chromium through Playwright) over a real install: an
offline ``llmgw server init`` (control plane, mirror, agent, a real llama-server serving gemma-3-270m).

It logs in (a wrong token first), sees the starter's node and model, reads the engine's log live,
opens the explanation of a model that cannot be placed, cordons the node and sees it change, sees an
outside change arrive without a reload, looks at the guard and the keys pages (the usage plot drawn
from a real request's usage), and goes back to login when the session is gone. Every page passes
axe-core with no serious or critical violation, and each is saved as a screenshot
(``test-artifacts/screenshots``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

from tests.browser.conftest import axe_violations, format_violations, shot
from tests.conftest import Assets
from tests.helpers.processes import llmgw, offline_init
from tests.helpers.waits import wait_for

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

NODE = "e2e-node"
STARTER = "gemma-3-270m-q4_k_m"
WAIT_MS = 20_000


@dataclass
class Install:
    root: Path
    admin: str
    token: str
    gateway: str

    def api(self, method: str, path: str, body: object = None) -> httpx.Response:
        return httpx.request(method, self.admin + path, json=body, timeout=30,
                             headers={"Authorization": f"Bearer {self.token}"})


@pytest.fixture(scope="module")
def install(assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    with offline_init(tmp_path_factory.mktemp("ui"), assets) as (root, args):
        done = llmgw(root, *args)
        assert done.returncode == 0, done.stdout + done.stderr
        etc = root / "etc/llmgw"
        cfg = yaml.safe_load((etc / "server.yaml").read_text())
        gateway = re.search(r"curl -s (http://127\.0\.0\.1:\d+)/v1/chat/completions", done.stdout)
        assert gateway, done.stdout
        yield Install(root, f"http://{cfg['admin_listen']}", (etc / "admin-token").read_text().strip(),
                      gateway.group(1))


def _accessible(page: Page, name: str) -> None:
    shot(page, name)
    found = axe_violations(page)
    assert not found, f"{name}:\n" + format_violations(found)


def _login(page: Page, install: Install) -> None:
    page.goto(install.admin + "/ui/")
    page.get_by_label("Token", exact=True).fill(install.token)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(install.admin + "/ui/")


def test_login_then_the_starters_node_and_model(page: Page, install: Install) -> None:
    page.goto(install.admin + "/ui/")
    assert page.url.endswith("/ui/login")
    _accessible(page, "login")
    page.get_by_label("Token", exact=True).fill("not-the-token")
    page.get_by_role("button", name="Log in").click()
    assert "that token is not the admin token" in page.locator("#login-error").inner_text()
    assert "Traceback" not in page.content()
    _login(page, install)
    main = page.locator("main")
    assert page.get_by_role("link", name=NODE).count() == 1
    page.get_by_role("link", name=STARTER).first.wait_for()
    # The starter is ready: 1 of 1 wanted, and the node shows its bars (cores, memory).
    page.wait_for_function("() => document.querySelector('main').innerText.includes('1 / 1')", timeout=WAIT_MS)
    assert page.locator("progress").count() >= 2
    assert "Leader:" in main.inner_text()
    _accessible(page, "overview")


def test_a_models_page_and_its_engine_log_live(page: Page, install: Install) -> None:
    _login(page, install)
    page.get_by_role("link", name=STARTER).first.click()
    page.wait_for_url(re.compile(r"/ui/models/"))
    assert page.locator("h1").inner_text() == STARTER
    assert f"{STARTER}: placed" in page.locator("#placement-state").inner_text()
    page.locator("pre.log").wait_for(timeout=WAIT_MS)  # htmx loads the tail through the agent
    assert "llama-server" in page.locator("pre.log").inner_text()
    _accessible(page, "model")


def test_the_explanation_of_a_model_that_cannot_be_placed(page: Page, install: Install) -> None:
    huge = {"name": "huge", "source": "http://m/huge.gguf", "profiles": [{"name": "cpu", "min_memory_gb": 4000}]}
    r = install.api("POST", "/api/v1/models", huge)
    assert r.status_code == 201, r.text
    _login(page, install)
    problem = page.locator("main .problems").get_by_role("link", name="huge")
    problem.wait_for(timeout=WAIT_MS)  # "Needs a look", live
    problem.click()
    page.wait_for_url(re.compile(r"/ui/models/huge"))
    page.wait_for_function(
        "() => document.querySelector('main').innerText.includes('would fit if')", timeout=WAIT_MS
    )
    text = page.locator("main").inner_text()
    assert "huge: NOT placed (0/1 replicas)" in text
    assert "needs 4000.0 GB memory" in text
    assert re.search(r"would fit if: .*add a node with at least 4000\.0 GB", text), text
    _accessible(page, "model-unplaced")
    assert install.api("DELETE", "/api/v1/models/huge").status_code == 204


def test_cordon_a_node_and_see_changes_arrive_without_a_reload(page: Page, install: Install) -> None:
    _login(page, install)
    page.get_by_role("link", name=NODE).click()
    page.wait_for_url(re.compile(rf"/ui/nodes/{NODE}"))
    assert "schedulable" in page.locator("#node-state").inner_text()
    page.get_by_role("button", name="Cordon", exact=True).click()
    # the flash either way (role status, or alert for a refusal): a failure shows what it said (a
    # run under load waited 30 s for a "status" that never came, and said nothing more)
    assert page.locator("p.flash").inner_text() == f"node {NODE} cordoned"
    assert page.get_by_role("status").count() == 1
    assert "cordoned" in page.locator("#node-state").inner_text()
    _accessible(page, "node")
    page.get_by_role("button", name="Uncordon").click()
    assert "schedulable" in page.locator("#node-state").inner_text()
    # A change made elsewhere (ctl, another operator) shows up in place: the page is not reloaded
    # (a marker set in this document survives), only the live part is morphed.
    page.evaluate("() => { window.__kept = 1; }")
    assert install.api("POST", f"/api/v1/nodes/{NODE}/cordon").status_code == 200
    try:
        page.wait_for_function(
            "() => document.querySelector('#node-state').innerText.includes('cordoned')", timeout=WAIT_MS
        )
        assert page.evaluate("() => window.__kept") == 1
    finally:
        assert install.api("POST", f"/api/v1/nodes/{NODE}/uncordon").status_code == 200


def test_drain_and_restart_ask_first_and_a_no_changes_nothing(page: Page, install: Install) -> None:
    """A drain of the only node, or a replica's restart, took live traffic down in one click with no
    warning (a dashboard user's finding: two streams got 502). Both ask first, saying what they cut;
    answering no leaves everything as it was."""
    asked: list[str] = []

    def no(dialog: Any) -> None:
        asked.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", no)
    _login(page, install)
    page.goto(f"{install.admin}/ui/nodes/{NODE}")
    page.get_by_role("button", name="Drain", exact=True).click()
    assert asked, "no dialog"
    assert asked[-1].startswith(f"Drain {NODE}? Its replicas stop now, the requests they are answering are cut")
    assert "schedulable" in page.locator("#node-state").inner_text()
    page.goto(f"{install.admin}/ui/models/{STARTER}")
    restart = page.get_by_role("button", name=re.compile(r"^Restart "))
    restart.first.wait_for(timeout=WAIT_MS)
    replica = (restart.first.get_attribute("aria-label") or "").removeprefix("Restart ")
    restart.first.click()
    assert asked[-1] == f"Restart {replica}? Its engine stops now and the requests it is answering are cut."
    page.goto(f"{install.admin}/ui/models/{STARTER}")  # no flash, the same replica
    assert page.locator("p.flash").count() == 0
    assert page.get_by_role("button", name=f"Restart {replica}").count() == 1


def test_guard_and_keys_pages_with_a_usage_plot(page: Page, install: Install) -> None:
    r = install.api("POST", "/api/v1/keys", {"name": "alice", "rpm": 600})
    assert r.status_code == 201, r.text
    secret = r.json()["secret"]
    for _ in range(30):  # the gateway knows a new key within a second (accounting's sync)
        answer = httpx.post(
            install.gateway + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {secret}"},
            json={"model": "gemma", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
        )
        if answer.status_code != 401:
            break
        time.sleep(0.2)
    assert answer.status_code == 200, answer.text
    # usage reaches the store within 0.5 s (accounting's sync): the plot draws from it
    wait_for("alice's usage in the store", lambda: install.api("GET", "/api/v1/usage?key=alice").json(), 20, 0.1)
    _login(page, install)
    page.get_by_role("link", name="Keys and usage").click()
    page.wait_for_url(re.compile(r"/ui/keys"))
    page.locator("#usage-plot[data-drawn='1']").wait_for(timeout=WAIT_MS)  # uPlot drew alice's series
    assert page.locator("#usage-plot canvas").count() == 1
    row = page.locator("section[aria-labelledby=h-usage] tr", has_text="alice")
    assert row.count() >= 1
    assert "gemma" in row.first.inner_text()
    _accessible(page, "keys")
    page.get_by_role("link", name="Guard").click()
    page.wait_for_url(re.compile(r"/ui/guard"))
    assert "Recent verdicts" in page.locator("main").inner_text()
    _accessible(page, "guard")


def test_an_autoscaled_models_page_plots_wanted_ready_and_load(page: Page, install: Install) -> None:
    r = install.api("PATCH", f"/api/v1/models/{STARTER}", {"scaling": {"min": 1, "max": 2}})
    assert r.status_code == 200, r.text
    try:
        # the autoscaler's first pass writes the model's first point (every 0.5 s): the plot draws from it
        wait_for(f"{STARTER}'s first autoscale point",
                 lambda: install.api("GET", f"/api/v1/models/{STARTER}/autoscale").json()["history"], 20, 0.1)
        _login(page, install)
        page.goto(install.admin + f"/ui/models/{STARTER}")
        page.locator("#autoscale-plot[data-drawn='3']").wait_for(timeout=WAIT_MS)  # wanted, ready, load
        assert page.locator("#autoscale-plot canvas").count() == 1
        assert "1 wanted (scaling 1..2)" in page.locator("#autoscale-state").inner_text()
        _accessible(page, "model-autoscale")
    finally:
        install.api("PATCH", f"/api/v1/models/{STARTER}", {"scaling": {"min": 1, "max": 1}})


def test_a_lost_session_goes_back_to_login(page: Page, install: Install) -> None:
    _login(page, install)
    page.context.clear_cookies()  # as when the session expires: the next live poll is refused
    page.wait_for_url(re.compile(r"/ui/login"), timeout=WAIT_MS)
    assert page.get_by_label("Token", exact=True).is_visible()
