"""One rule for the names llmgw stores and routes on: model names, aliases, versions, node ids,
label keys.

The rule (:data:`NAME_RE`, matched whole, so a trailing newline is refused too): 1 to 63 characters,
lowercase ASCII letters, digits, ``.``, ``_`` and ``-``, starting with a letter or a digit:
``gemma-3-270m``, ``qwen2.5-0.5b-instruct``, ``q4_k_m``, ``node-1.example``. It is a DNS label's
length and alphabet (plus ``_``, which GGUF quantisation names use), so a name is safe in a URL
path, a file name, a log line, a certificate's CN and a replica id without quoting, and cannot be
``..``-like (it never starts with ``.``). Uppercase is refused rather than folded: ``Gemma`` and
``gemma`` would otherwise be two models that look the same in a listing. Node ids are hostnames:
``server init`` lowercases the machine's hostname, and a hostname longer than 63 characters needs an
explicit ``--node-id``.

Label keys (:data:`LABEL_KEY_RE`) are a name, optionally after a DNS-style prefix and a ``/``
(``gpu.vendor``, ``example.com/zone``): prefix at most 253 characters of lowercase letters, digits,
``.`` and ``-``. Label values follow Kubernetes' rule (:data:`LABEL_VALUE_RE`).

:func:`check_name` and :func:`check_label_key` raise :class:`ValueError` with a message that names
the kind, the bad value and the rule, so pydantic validators and CLI checks can share them; a pydantic
field takes the rule as ``Annotated[str, valid_name("node id")]``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import quote

from pydantic import AfterValidator

from llmgw.errors import ApiError

#: The label ``server init`` gives the control plane's own node (the starter and the guard judges are
#: pinned to it). A node cannot claim it: the agent API honours it only from a node a control plane
#: names as its own (:mod:`llmgw.control.api.nodelabels`), as Kubernetes' NodeRestriction keeps
#: kubelets from setting ``node-restriction.kubernetes.io/`` labels.
CONTROL_PLANE_LABEL = "llmgw.control-plane"

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
NAME_RULE = "1-63 characters: lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"

LABEL_KEY_RE = re.compile(r"(?:[a-z0-9][a-z0-9.-]{0,252}/)?[a-z0-9][a-z0-9._-]{0,62}")
LABEL_KEY_RULE = f"an optional 'prefix/' (a DNS name such as example.com) and a name of {NAME_RULE}"

LABEL_VALUE_MAX = 63
"""Kubernetes' label value rule: at most 63 characters (``LABEL_VALUE_RE``)."""

LABEL_VALUE_RE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
LABEL_VALUE_RULE = (
    f"empty, or at most {LABEL_VALUE_MAX} characters: letters, digits, '-', '_' or '.', starting and "
    "ending with a letter or digit (Kubernetes' label value rule)"
)


def check_name(value: str, kind: str) -> str:
    """Return ``value`` when it follows :data:`NAME_RE`.

    Args:
        kind: what the value is, for the message (``"model name"``, ``"node id"``).

    Raises:
        ValueError: ``"'Bad Name' is not a valid model name: 1-63 characters: …"``.
    """
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid {kind}: {NAME_RULE}")
    return value


def valid_name(kind: str) -> AfterValidator:
    """:func:`check_name` as a pydantic field's validator: ``node_id: Annotated[str, valid_name("node id")]``
    (``kind`` as for :func:`check_name`; the ValueError becomes the field's validation error)."""
    return AfterValidator(lambda value: check_name(value, kind))


def check_unique(names: Sequence[str], field: str) -> None:
    """Nothing when every one of ``names`` (the names of the items of ``field``) differs.

    Raises:
        ValueError: ``"profiles: names must be unique, 'cpu' appears more than once"`` (the first such
            name, sorted).
    """
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{field}: names must be unique, '{dup[0]}' appears more than once")


def check_label_key(value: str) -> str:
    """Return ``value`` when it follows :data:`LABEL_KEY_RE`; else ValueError naming the rule."""
    if not isinstance(value, str) or not LABEL_KEY_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid label key: {LABEL_KEY_RULE}")
    return value


def check_label_value(value: str, key: str) -> str:
    """Return ``value`` when it follows :data:`LABEL_VALUE_RE` and :data:`LABEL_VALUE_MAX`; else
    ValueError naming the key, the value and the rule."""
    if not isinstance(value, str) or len(value) > LABEL_VALUE_MAX or not LABEL_VALUE_RE.fullmatch(value):
        shown = repr(value[:80]) if isinstance(value, str) else repr(value)
        raise ValueError(f"label {key}: {shown} is not a valid label value: {LABEL_VALUE_RULE}")
    return value


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """Check every key of ``labels`` (:func:`check_label_key`) and every value
    (:func:`check_label_value`); return ``labels``. Raises ValueError naming the first bad one."""
    for key, value in labels.items():
        check_label_key(key)
        check_label_value(value, key)
    return labels


def path_segment(value: str) -> str:
    """``value`` (a name, an id, a serial a user typed) as one URL path segment of an llmgw API, every
    reserved character quoted (``a/b`` is ``a%2Fb``, ``x?y`` is ``x%3Fy``), so that a name outside
    the rule reaches the API as that name and is answered "no such ..." rather than routed to another
    path or a bare 404.

    Raises:
        ApiError: ``value`` is empty, ``.`` or ``..`` (a client would send another path: the API
            normalises them): status 404, code ``not_found``, as the API answers an unknown name.
    """
    if value in (".", "..") or not value:
        raise ApiError(f"no such name '{value}'", status=404, code="not_found")
    return quote(value, safe="")
