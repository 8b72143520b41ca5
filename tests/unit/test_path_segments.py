"""A name a user types goes into an API path as one segment (:func:`llmgw.names.path_segment`): the
admin client over a real admin API on real HTTP. A reviewer's ``llmgw ctl model resources a/b`` was
answered ``404 ... Not Found`` (the request went to another path), ``ctl logs ../nodes`` ``405 GET
/api/v1/nodes/logs`` and ``ctl replicas 'x?y'`` sent its query unquoted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmgw.adminclient import AdminClient
from llmgw.control.api.admin import build_admin_app
from llmgw.control.store import Store
from llmgw.errors import ApiError
from llmgw.names import path_segment
from tests.helpers.gateway import ServerThread

TOKEN = "t0ken"


@pytest.mark.parametrize(("value", "want"), [("gemma", "gemma"), ("a/b", "a%2Fb"), ("x?y", "x%3Fy"),
                                              ("../nodes", "..%2Fnodes"), ("a b#c", "a%20b%23c")])
def test_a_value_is_one_quoted_segment(value: str, want: str) -> None:
    assert path_segment(value) == want


@pytest.mark.parametrize("value", ["", ".", ".."])
def test_a_value_that_would_make_another_path_is_no_such_name(value: str) -> None:
    with pytest.raises(ApiError) as e:
        path_segment(value)
    assert (e.value.status, e.value.code) == (404, "not_found")


@pytest.fixture
def admin(store: Store) -> Iterator[AdminClient]:
    servers = ServerThread()
    try:
        port = servers.serve(build_admin_app(store, token=TOKEN))
        yield AdminClient(f"http://127.0.0.1:{port}", TOKEN, timeout_s=5)
    finally:
        servers.close()


def test_names_outside_the_rule_are_answered_as_names_the_api_does_not_know(admin: AdminClient) -> None:
    for call, name in ((admin.model_resources, "a/b"), (admin.model, "a/b"), (admin.replica_logs, "../nodes"),
                       (admin.restart_replica, "x?y"), (admin.explain, "a/b")):
        with pytest.raises(ApiError) as e:
            call(name)
        assert e.value.status == 404, (name, e.value)
        assert name in str(e.value), (name, str(e.value))  # the API names what it does not know
        assert "Not Found" not in str(e.value)
        assert "Method Not Allowed" not in str(e.value)
    with pytest.raises(ApiError, match=r"no model 'x\?y' in the catalog"):  # the query is quoted: one name
        admin.replicas(model="x?y")
