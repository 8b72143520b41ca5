"""The gateway's hot-path shortcuts keep their results: request ids, the UTC day, kept metric children,
the JSON decoder made once, and the access-log record made without ``Logger.info``. Pure logic; the
whole path on real HTTP is tests/unit/test_gateway.py's."""

from __future__ import annotations

import logging
import re

import pytest

from llmgw import jsonbody
from llmgw.control.api.metrics import ControlPlaneMetrics
from llmgw.control.gateway.accesslog import log_exchange
from llmgw.control.gateway.inspect import Exchange
from llmgw.control.gateway.limits import day_of
from llmgw.control.gateway.requestid import new_request_id
from llmgw.errors import JsonBodyError


def _exchange(**kw: object) -> Exchange:
    base: dict[str, object] = {
        "requested": "g", "model": "gemma", "replica": "r-1", "status": 200, "stream": False,
        "overhead_ms": 0.1, "upstream_ms": 2.0, "usage": {"prompt_tokens": 9, "completion_tokens": 1},
        "key": "alice", "kind": "chat", "request_id": "rid-1",
    }
    return Exchange(**{**base, **kw})  # type: ignore[arg-type]


def test_request_ids_are_24_hex_digits_and_distinct() -> None:
    ids = [new_request_id() for _ in range(20_000)]
    assert all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert len({i[:8] for i in ids}) == 1  # one process prefix; the counter part is not a plain count
    assert int(ids[1][8:], 16) - int(ids[0][8:], 16) != 1


def test_day_of_is_the_utc_day_whatever_was_asked_before() -> None:
    asked = [(0.0, "1970-01-01"), (86399.9, "1970-01-01"), (86400.0, "1970-01-02"), (1_764_720_000.0, "2025-12-03"),
             (86399.9, "1970-01-01"), (1_764_806_399.0, "2025-12-03"), (1_764_806_400.0, "2025-12-04")]
    assert [day_of(now) for now, _ in asked] == [day for _, day in asked]


def test_metric_children_are_kept_and_count() -> None:
    m = ControlPlaneMetrics()
    for _ in range(3):
        m.observe(_exchange())
        m.routed("gemma", "affinity")
        m.waited("gemma", 0.0)
    value = m.registry.get_sample_value
    labels = {"model": "gemma", "key": "alice", "kind": "chat", "status": "200"}
    assert value("llmgw_gateway_requests_total", labels) == 3
    assert value("llmgw_gateway_tokens_total", {"model": "gemma", "key": "alice", "direction": "prompt"}) == 27
    assert value("llmgw_gateway_routing_decisions_total", {"model": "gemma", "reason": "affinity"}) == 3
    assert value("llmgw_gateway_queue_wait_seconds_count", {"model": "gemma"}) == 3
    with pytest.raises(ValueError, match="routing reason"):
        m.routed("gemma", "made-up")


def test_json_bodies_parse_as_json_loads_did() -> None:
    assert jsonbody.loads(b'{"a": [1, 2.5]}') == {"a": [1, 2.5]}
    assert jsonbody.loads('\ufeff{"a": 1}'.encode()) == {"a": 1}  # bytes: a UTF-8 BOM is skipped
    assert jsonbody.loads('{"a": "\\u00e9"}'.encode("utf-16")) == {"a": "é"}
    with pytest.raises(JsonBodyError, match="BOM"):
        jsonbody.loads('\ufeff{"a": 1}')  # text: refused, as json.loads does
    with pytest.raises(JsonBodyError, match="not a JSON number"):
        jsonbody.loads(b'{"a": NaN}')
    with pytest.raises(JsonBodyError, match="not valid JSON"):
        jsonbody.loads(b'{"a": ')


def test_access_line_goes_through_the_logger(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        log_exchange(_exchange())
    [record] = [r for r in caplog.records if r.name == "llmgw.access"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "request_id=rid-1 key=alice kind=chat model=gemma replica=r-1 status=200 stream=false prompt_tokens=9 "
        "completion_tokens=1 overhead_ms=0.100 upstream_ms=2.0 ttft_ms=0.0 code=- queued_ms=0.0"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmgw.access"):
        log_exchange(_exchange())
    assert not [r for r in caplog.records if r.name == "llmgw.access"]
