"""Waiting for something with a deadline.

``server init`` never waits silently: each wait has a deadline, the probe prints its own progress
lines, every :data:`REPORT_EVERY_S` seconds a ``waiting for <what> (<N>s): last state <state>``
line is reported whatever the probe said, and the message on giving up says what was awaited and
that running init again keeps waiting. The clock and the sleep are injected so tests do not sleep.

Silence is bounded by :data:`REPORT_EVERY_S` plus one poll interval plus one probe: init's probes
make HTTP calls of at most :data:`PROBE_TIMEOUT_S` and poll every 0.5 s or less, so no wait is
silent for more than 5 + 0.5 + 4 < 10 s (an agent pointed at an address where nothing
listens once made init wait twenty minutes without a word).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.errors import WaitTimeout

REPORT_EVERY_S = 5.0
"""Seconds between ``waiting for …`` lines (see the module docstring for the 10 s bound)."""

PROBE_TIMEOUT_S = 4.0
"""The longest HTTP call a wait's probe may make, so a probe that hangs cannot make a wait silent."""


@dataclass
class Clock:
    """Monotonic time and sleep (seconds); tests pass a fake that advances on ``sleep``."""

    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


def format_duration(seconds: float) -> str:
    """``90`` → ``1m30s``, ``1200`` → ``20m0s``, ``30`` → ``30s`` (Go's format, as the original llmgw printed)."""
    s = round(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


def wait_for(
    limit_s: float,
    what: str,
    done: Callable[[], bool],
    *,
    interval_s: float = 0.5,
    clock: Clock | None = None,
    report: Callable[[str], None] | None = None,
    state: Callable[[], str] | None = None,
) -> None:
    """Poll ``done`` until it returns True, raises, or ``limit_s`` seconds pass.

    ``done`` raising (an :class:`~llmgw.errors.LlmgwError`) ends the wait with that error: a probe
    that knows the answer is "never" says so at once. With ``report``, every
    :data:`REPORT_EVERY_S` seconds it gets ``waiting for <what> (<N>s): last state <state()>``
    (``state`` defaults to ``no answer yet``).

    Raises:
        WaitTimeout: "gave up waiting for <what> after <limit>; run init again to keep waiting".
    """
    clock = clock or Clock()
    started = clock.now()
    deadline = started + limit_s
    reported = started
    while True:
        if done():
            return
        now = clock.now()
        if now >= deadline:
            last = f" (last state: {state()})" if state is not None else ""
            raise WaitTimeout(
                f"gave up waiting for {what} after {format_duration(limit_s)}{last}; run init again to keep waiting"
            )
        if report is not None and now - reported >= REPORT_EVERY_S:
            reported = now
            report(f"waiting for {what} ({round(now - started)}s): last state {state() if state else 'no answer yet'}")
        clock.sleep(min(interval_s, REPORT_EVERY_S))
