"""The login throttle's rule on an injected clock (:mod:`llmgw.control.ui.throttle`), table by
table: the waits, the keys of addresses, forgetting, and device cookies."""

from __future__ import annotations

import pytest

from llmgw.control.ui.throttle import GLOBAL, DeviceCookies, LoginThrottle, Rule, address_key, retry_after


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("wrong", "wait"), [(1, 0), (5, 0), (6, 1), (7, 2), (8, 4), (12, 60), (500, 60)])
def test_the_waits_double_after_the_free_ones_up_to_the_cap(wrong: int, wait: float) -> None:
    assert Rule(free=5, base_s=1, cap_s=60).wait_after(wrong) == wait


@pytest.mark.parametrize(("remote", "key"), [
    ("127.0.0.1", "addr:127.0.0.1"),
    ("::ffff:10.0.0.7", "addr:10.0.0.7"),
    ("2001:db8:1:2:aaaa::1", "addr:2001:db8:1:2::/64"),
    ("2001:db8:1:2:bbbb::9", "addr:2001:db8:1:2::/64"),
    (None, "addr:?"),
    ("not an address", "addr:?"),
])
def test_address_keys(remote: str | None, key: str) -> None:
    assert address_key(remote) == key


def test_a_closed_key_opens_after_its_wait_and_a_right_token_clears_the_address_only() -> None:
    clock = Clock()
    t = LoginThrottle(clock=clock)
    keys = ["addr:a", GLOBAL]
    for _ in range(5):
        assert t.closed_for(keys) == 0
        assert t.wrong(keys) == 0
    assert t.wrong(keys) == 1
    assert t.closed_for(keys) == 1
    assert t.closed_for(["addr:b", GLOBAL]) == 0  # another address: 6 of the 20 shared free ones
    clock.now += 1
    assert t.closed_for(keys) == 0
    assert t.wrong(keys) == 2
    t.right(keys)
    assert t.closed_for(["addr:a"]) == 0
    assert t._counts[GLOBAL].wrong == 7  # a right token does not reset the shared count
    assert retry_after(0.2) == "1"
    assert retry_after(1.01) == "2"


def test_counts_are_forgotten_after_a_quiet_while_and_the_table_is_bounded() -> None:
    clock = Clock()
    t = LoginThrottle(clock=clock, forget_s=900, max_keys=3)
    for _ in range(8):
        t.wrong(["addr:a"])
    assert t.closed_for(["addr:a"]) > 0
    clock.now += 901
    t.wrong(["addr:b"])
    assert "addr:a" not in t._counts
    for name in "cdef":
        t.wrong([f"addr:{name}", GLOBAL])
    assert len(t._counts) == 3
    assert GLOBAL in t._counts


def test_device_cookies_name_a_browser_until_they_expire_and_cannot_be_forged() -> None:
    wall = Clock()
    cookies = DeviceCookies(b"k" * 32, ttl_s=100, wall=wall)
    value = cookies.issue()
    ident = cookies.device(value)
    assert ident is not None
    assert value.startswith(ident + ".")
    other = DeviceCookies(b"j" * 32, ttl_s=100, wall=wall)
    assert other.device(value) is None  # another cluster's (another admin token's) key
    body, _, mac = value.rpartition(".")
    forged_id = ("y" if body[0] == "x" else "x") + body[1:]  # another id (a random one may begin with x)
    assert cookies.device(f"{forged_id}.{mac}") is None
    for bad in ("", "a.b", "a.b.c.d", "..."):
        assert cookies.device(bad) is None
    wall.now += 101
    assert cookies.device(value) is None
    a = DeviceCookies.from_admin_token("admin-token-for-tests")
    b = DeviceCookies.from_admin_token("admin-token-for-tests")
    assert b.device(a.issue()) is not None  # every control plane with the same token accepts it
