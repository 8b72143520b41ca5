"""The overview's models table (``overview_live.html``, rendered by the dashboard's own Jinja
environment): its "Ready / wanted" column counts against the replicas wanted (an autoscaled model's
decided count), not ``scaling.min`` (an autoscaled model at 1 of 3 wanted read ``1 / 1``, healthy)."""

from __future__ import annotations

import re

from llmgw.control.ui.app import _ENV
from llmgw.views import ClusterView, DatabaseView, ModelView


def _row(model: ModelView) -> str:
    html = _ENV.get_template("overview_live.html").render(
        nodes=[], models=[model], counts=[], ha=False, problems=[],
        cluster=ClusterView(me="cp", term=1, leader="cp", database=DatabaseView(reachable=True)),
    )
    found = re.search(r'<a href="/ui/models/m">m</a>.*?</tr>', html, re.S)
    assert found, html
    return found.group(0)


def test_ready_is_counted_against_the_wanted_replicas() -> None:
    short = _row(ModelView(name="m", role="chat", scaling_min=1, scaling_max=4, replicas_ready=1, replicas=3,
                           replicas_wanted=3))
    assert '<td class="short">1 / 3</td>' in short
    met = _row(ModelView(name="m", role="chat", scaling_min=0, scaling_max=2, replicas_ready=0, replicas=0,
                         replicas_wanted=0))
    assert '<td class="ok">0 / 0</td>' in met
