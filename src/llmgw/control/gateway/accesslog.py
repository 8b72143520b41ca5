"""The gateway's access log: one line per request on the logger ``llmgw.access`` (INFO).

Fields, ``name=value`` separated by spaces (logfmt, which Loki, Vector and ``grep`` read)::

    request_id=3f9c… key=alice kind=chat model=gemma replica=r-1a2b status=200 stream=true
    prompt_tokens=26 completion_tokens=64 overhead_ms=0.081 upstream_ms=2561.2 ttft_ms=41.7 code=-
    queued_ms=0.0

``upstream_ms`` includes the wait for a slot in the model's queue; ``queued_ms`` is that wait (a new
user read 30 s of queueing as 30 s of engine time), last so that parsers of the older line still read
every field they knew.

Every value comes from the catalog, the store or the gateway itself (key and model names follow
:mod:`llmgw.names`' rules, a client's ``x-request-id`` is kept only when it is plain, see
:func:`llmgw.control.gateway.requestid.request_id`): never a prompt, an answer, a secret, or the model
name as the client typed it. ``prompt_tokens``/``completion_tokens`` are ``-`` when no replica
answered; ``estimated=true`` marks a stream counted from its events (the client left early).

A request refused for its key (401, on any keyed route: the endpoints and ``/v1/models``) gets a
line too, ``key=invalid`` when a key was presented that is unknown, revoked or expired (never the
key itself, nor any part or hash of it) and ``key=missing`` when none was::

    request_id=9b1e… key=invalid kind=chat model=- replica=- status=401 stream=false prompt_tokens=-
    completion_tokens=- overhead_ms=0.012 upstream_ms=0.0 ttft_ms=0.0 code=invalid_api_key queued_ms=0.0

A key may be named ``invalid`` or ``missing`` too; ``status=401 code=invalid_api_key`` tells them
apart. So a guessing run shows up as a burst of such lines (and in
``llmgw_gateway_refused_keys_total``, :mod:`llmgw.control.api.metrics`).

Cost: ~10 µs per request with a handler writing to stderr (the control plane's journal), most of it
the logging module's own; set the logger to WARNING to turn it off (the check is ~0.1 µs). The record
is made directly (:meth:`logging.Logger.makeRecord`) and handed to the logger's handlers, skipping
``Logger.info``'s walk up the stack for the caller's file and line (the access log names none): that
walk was about a quarter of the line's cost (timeit, a file handler, two runs each way at load ~12 on
this 2-core machine: 50.7-56.9 µs before, 35.0-45.5 µs after). Filters, levels, propagation and
formatting are the logging module's as before.
"""

from __future__ import annotations

import logging

from llmgw.control.gateway.inspect import Exchange

access = logging.getLogger("llmgw.access")


def log_exchange(ex: Exchange) -> None:
    """Write ``ex``'s access-log line (see the module docstring); nothing when INFO is off."""
    if not access.isEnabledFor(logging.INFO):
        return
    usage = ex.usage or {}
    prompt = usage.get("prompt_tokens", "-") if ex.usage is not None else "-"
    completion = usage.get("completion_tokens", "-") if ex.usage is not None else "-"
    args = (
        ex.request_id or "-",
        ex.refused or ex.key or "-",
        ex.kind,
        ex.model or "-",
        ex.replica or "-",
        ex.status,
        "true" if ex.stream else "false",
        prompt,
        completion,
        ex.overhead_ms,
        ex.upstream_ms,
        ex.ttft_ms,
        ex.code or "-",
        " estimated=true" if usage.get("estimated") else "",
        ex.queued_ms,
    )
    # What Logger.info does, less findCaller (see the module docstring): fn, lno and func stay unknown.
    access.handle(access.makeRecord(access.name, logging.INFO, "(unknown file)", 0, _LINE, args, None))


_LINE = (
    "request_id=%s key=%s kind=%s model=%s replica=%s status=%d stream=%s prompt_tokens=%s "
    "completion_tokens=%s overhead_ms=%.3f upstream_ms=%.1f ttft_ms=%.1f code=%s%s queued_ms=%.1f"
)
