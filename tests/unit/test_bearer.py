"""Secrets as the client sent them (:mod:`llmgw.bearer`): bytes that are not UTF-8 compare as bytes."""

from __future__ import annotations

from llmgw.bearer import bearer_is, sent_bytes


def test_sent_bytes_gives_back_what_aiohttp_decoded() -> None:
    raw = b"Bearer \xff\xfe caf\xc3\xa9"
    assert sent_bytes(raw.decode("utf-8", "surrogateescape")) == raw  # how aiohttp decodes header bytes


def test_bearer_is_the_token_in_any_scheme_case_and_nothing_else() -> None:
    token = "t" * 32
    assert bearer_is(f"Bearer {token}", token)
    assert bearer_is(f"bearer  {token} ", token)
    for header in ("", f"Basic {token}", f"Bearer {token}x", token, "Bearer \udcff\udcfe", "\udcff"):
        assert not bearer_is(header, token), header
    assert not bearer_is("Bearer ", "")  # an empty token matches nothing
