"""YAML loading for every file llmgw reads (server.yaml with its guard block, agent.yaml, model.yaml,
a declared inventory): PyYAML's safe loader, with duplicate keys refused.

Plain ``yaml.safe_load`` keeps the *last* of two equal keys in a mapping, silently: a server.yaml
with two ``gateway:`` blocks, or a model.yaml with ``min_memory_gb`` twice, loads as something the
operator did not write. :func:`load` raises :class:`DuplicateKeyError` naming the key and both
lines instead.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node


class DuplicateKeyError(ConstructorError):
    """A mapping has the same key twice. ``problem`` names the key and both lines (1-based)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose mappings refuse a key that appears twice (merge keys ``<<`` aside)."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        """As SafeLoader's, after checking that no key appears twice in ``node``.

        Raises:
            DuplicateKeyError: ``key 'gateway' appears twice (lines 3 and 9)``.
        """
        seen: dict[Any, Node] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader reports it below
                continue
            if first is not None:
                line1, line2 = first.start_mark.line + 1, key_node.start_mark.line + 1
                raise DuplicateKeyError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"key {key!r} appears twice (lines {line1} and {line2}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """Parse one YAML document safely, refusing duplicate keys.

    Raises:
        yaml.YAMLError: not valid YAML; :class:`DuplicateKeyError` (a subclass) for a repeated key.
    """
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


#: PyYAML's problem for a key line whose value runs on: it points at the line where it stopped.
_MAPPING_HERE = "mapping values are not allowed here"


def problem(e: yaml.YAMLError) -> str:
    """``not valid YAML at line L, column C: <problem>`` for a PyYAML error, with where its context
    began when that is another line (an unclosed ``[``), and, for "mapping values are not allowed
    here", the usual cause: PyYAML names the line where it stopped, often the one after the mistake
    (a new user's key without its ``:`` was reported one line down)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    what = str(getattr(e, "problem", None) or e)
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and cmark is not None and (mark is None or cmark.line != mark.line):
        what += f" ({context} that starts at line {cmark.line + 1})"
    if what == _MAPPING_HERE and mark is not None and mark.line > 0:
        what += f"; check line {mark.line} too: a key without its ':', or a value indented under a key"
    return f"not valid YAML{where}: {what}"
