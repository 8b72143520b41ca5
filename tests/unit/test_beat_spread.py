"""Agents spread over the control planes (rendezvous hashing), move when theirs fails and go back
when it returns; the interval and the node-lost threshold grow with the cluster (Nomad's rule);
server.yaml's ``cluster.max_heartbeats_per_s`` is bounded. Pure logic, injected clocks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from llmgw.agent.loop.controlplanes import JITTER, RETURN_S, ControlPlanes, beat_wait_s, rendezvous
from llmgw.config import load_server_config
from llmgw.control.api.cadence import Cadence, interval_for, lost_after_for
from llmgw.errors import ConfigError

URLS = ["https://cp-a:7443", "https://cp-b:7443", "https://cp-c:7443"]
NODES = [f"node-{i:03d}" for i in range(300)]


def test_300_nodes_spread_within_20_percent_of_even_over_3_control_planes() -> None:
    homes = Counter(ControlPlanes(URLS, node=n).current for n in NODES)
    assert set(homes) == set(URLS)
    assert all(80 <= c <= 120 for c in homes.values()), homes
    # Deterministic: the same node ranks the same way whatever the configured order.
    assert all(rendezvous(n, URLS) == rendezvous(n, URLS[::-1]) for n in NODES[:20])


def test_a_failed_control_plane_s_agents_spread_over_the_others_and_go_back() -> None:
    now = [0.0]
    planes = {n: ControlPlanes(URLS, node=n, clock=lambda: now[0]) for n in NODES}
    dead = URLS[0]
    moved = Counter()
    for cps in planes.values():
        if cps.current == dead:
            cps.failed(dead)
            moved[cps.current] += 1
    assert set(moved) == set(URLS[1:])
    assert all(c >= 0.3 * sum(moved.values()) for c in moved.values()), moved  # not all on one
    # While away, the home is tried first again only every RETURN_S.
    away = next(c for c in planes.values() if c.home == dead)
    assert away.order()[0] != dead
    now[0] = RETURN_S - 1
    assert away.order()[0] != dead
    now[0] = RETURN_S + 1
    assert away.order()[0] == dead
    assert away.order()[0] != dead  # tried once per RETURN_S
    away.succeeded(dead)  # it answered: back home
    assert away.current == dead


def test_learned_members_rank_the_home_again() -> None:
    homes = Counter()
    for n in NODES:
        cps = ControlPlanes(URLS[:1], node=n)  # agent.yaml names one; replies name all three
        cps.learn(URLS)
        homes[cps.home] += 1
        assert cps.home == rendezvous(n, URLS)[0]
        assert cps.order()[0] == cps.home  # moved there at the next beat
    assert all(80 <= c <= 120 for c in homes.values()), homes


@pytest.mark.parametrize(
    ("nodes", "interval_s", "lost_s"),
    [(1, 2.0, 30.0), (90, 2.0, 30.0), (180, 4.0, 30.0), (450, 10.0, 30.0), (500, 11.11, 33.33),
     (2000, 44.44, 133.33), (5000, 111.11, 333.33)],
)
def test_the_interval_and_lost_threshold_grow_with_the_cluster(nodes: int, interval_s: float, lost_s: float) -> None:
    assert interval_for(nodes, 50) == pytest.approx(interval_s, abs=0.01)
    assert lost_after_for(interval_for(nodes, 50), 30) == pytest.approx(lost_s, abs=0.01)


def test_a_short_configured_threshold_holds_at_the_floor() -> None:
    assert lost_after_for(2.0, 1.5) == 1.5  # agents beat at agent.yaml's own interval there
    assert lost_after_for(4.0, 1.5) == 12.0


def test_cadence_tells_the_leader_when_the_threshold_moves() -> None:
    told: list[float] = []
    c = Cadence(50, 30, on_lost_after=told.append)
    c.set_nodes(360)  # 8 s interval: still 30 s
    assert (c.interval_s, c.lost_after_s, told) == (8.0, 30.0, [])
    c.set_nodes(4500)
    assert (c.interval_s, told) == (100.0, [300.0])
    c.node_added()
    assert c.nodes == 4501
    with pytest.raises(ValueError, match="max_heartbeats_per_s must be a positive number"):
        Cadence(0)


def test_agents_wait_their_own_interval_or_the_control_plane_s_longer_one_jittered() -> None:
    assert beat_wait_s(0.2, 2.0, 1.0) == 0.2  # a small cluster: agent.yaml's interval
    assert beat_wait_s(2.0, 0.0, 1.0) == 2.0  # no reply yet
    assert beat_wait_s(2.0, 100.0, JITTER[0]) == 80.0  # 4,500 nodes: 80-100 s
    assert beat_wait_s(0.2, 40.0, JITTER[1]) == 40.0


@pytest.mark.parametrize(("value", "why"), [(0, "greater than or equal to 1"), (20_000, "less than or equal to 10000"),
                                            ("fast", "valid number")])
def test_max_heartbeats_per_s_out_of_bounds_is_a_clear_error(tmp_path: Path, value: object, why: str) -> None:
    doc = {"tls": {"ca": "ca.pem", "cert": "s.pem", "key": "k.pem"}, "cluster": {"max_heartbeats_per_s": value}}
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"cluster\.max_heartbeats_per_s") as e:
        load_server_config(path)
    assert why in str(e.value)
