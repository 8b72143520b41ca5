"""Waiting for a condition that real processes make true: :func:`until` in async tests, :func:`wait_for`
in sync ones."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


async def until(what: str, pred: Callable[[], Awaitable[Any]], within_s: float = 20, every_s: float = 0.1) -> Any:
    """Await ``pred()`` every ``every_s`` seconds until it returns something truthy, and return that;
    an AssertionError naming ``what`` after ``within_s`` seconds."""

    async def poll() -> Any:
        while True:
            got = await pred()
            if got:
                return got
            await asyncio.sleep(every_s)

    try:
        return await asyncio.wait_for(poll(), within_s)
    except TimeoutError:
        raise AssertionError(f"not within {within_s} s: {what}") from None


def wait_for(what: str, check: Callable[[], T | None], within_s: float, every_s: float = 0.2) -> T:
    """Call ``check`` every ``every_s`` seconds until it returns something truthy (HTTP errors count
    as not yet) and return that; AssertionError naming ``what`` after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            got = check()
            if got:
                return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s:g} s: {what}")
        time.sleep(every_s)
