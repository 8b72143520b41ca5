"""``KEY=VALUE`` assignments as a JSON merge patch of a model (``llmgw ctl model set``).

``scaling.target=2 queue.size=0 routing=round-robin max_output=512`` becomes
``{"scaling": {"target": 2}, "queue": {"size": 0}, "routing": "round-robin", "max_output": 512}``,
which ``PATCH /api/v1/models/{name}`` merges into the model (RFC 7396) and validates as any model
write: an unknown field or a bad value is a 400 naming the field. A value is read as YAML (``2``
a number, ``true`` a boolean, ``[a, b]`` a list, ``"007"`` a string), so the command line says what a
model.yaml would; ``null`` removes an optional field (back to its default), as RFC 7396 says.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import yaml


class AssignmentError(ValueError):
    """An assignment that is not ``KEY=VALUE`` with a dotted KEY of names, or two that collide."""


def merge_patch(assignments: Iterable[str]) -> dict[str, Any]:
    """The merge patch of ``assignments`` (``a.b=VALUE`` each; see the module docstring).

    Raises:
        AssignmentError: no ``=``, an empty key part (``a..b``, ``.a``), a value YAML cannot read, a
            key set twice, or a key both set and used as a parent (``scaling=null scaling.min=1``);
            the message names the assignment and what to write instead.
    """
    patch: dict[str, Any] = {}
    for text in assignments:
        key, eq, raw = text.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(p.strip() for p in parts):
            raise AssignmentError(
                f"'{text}' is not KEY=VALUE: write e.g. scaling.target=2 or routing=round-robin"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise AssignmentError(f"'{text}': the value is not valid YAML ({e}); quote it: {key}='\"…\"'") from e
        if len(parts) == 1 and parts[0].strip() in TEXT_FIELDS and _is_number(value):
            value = raw.strip()  # version=2 means the version "2" (the catalog refuses a number there)
        if not _finite(value):  # YAML's .nan and .inf: JSON has no such numbers (the CLI crashed sending one)
            raise AssignmentError(f"'{text}': {raw.strip()} is not a finite number; give a number such as {key}=2")
        node = patch
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part.strip(), {})
            if not isinstance(child, dict):
                raise AssignmentError(f"'{text}': {'.'.join(parts[: i + 1])} is set to a value already")
            node = child
        last = parts[-1].strip()
        if last in node:
            raise AssignmentError(f"'{text}': {key.strip()} is set twice")
        node[last] = value
    return patch


#: A model's top-level fields that are text: a number typed there (``version=2``) is kept as typed.
TEXT_FIELDS = frozenset({"name", "description", "source", "version", "sha256", "routing_profile"})


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    """False when ``value`` holds a NaN or an infinity anywhere (YAML reads ``.nan``, ``.inf``)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def assignments_text(patch: dict[str, Any], prefix: str = "") -> list[str]:
    """``patch`` back as ``key=value`` lines (dotted keys, values as JSON-ish YAML), for the CLI's
    confirmation: ``{"scaling": {"target": 2}}`` → ``["scaling.target=2"]``."""
    out: list[str] = []
    for k, v in patch.items():
        if isinstance(v, dict) and v:
            out += assignments_text(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}")
    return out
