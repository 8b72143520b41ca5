"""Which mirror entry a catalog model's weights are, and which models use it
(``llmgw ctl model rm NAME --delete-weights``).

A catalog ``source`` is normally the mirror's URL of the file,
``http://MIRROR:8081/<model>/<version>/<file>``, and the mirror entry is named by those three path
segments, which need not be the catalog model's own name and version (two catalog models may
serve one file; init names the judge's entry after its file). :func:`entry_for` finds the entry
by that URL (the same path on the mirror's ``--base``; the host may be spelled differently),
else, for a source given as ``hf:``/``https://``/``file:``, by the one entry fetched from that
source. :func:`delete_weights` deletes it only when no other catalog model points at it;
:func:`models_using` is what ``llmgw mirror rm`` asks before it deletes an entry.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

from llmgw.mirror.client import MirrorClient
from llmgw.mirror.models import FetchStatus


def _path_of(url: str) -> tuple[str, ...]:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return ()
    if parts.scheme not in ("http", "https"):
        return ()
    segs = tuple(urllib.parse.unquote(s) for s in parts.path.strip("/").split("/"))
    return segs[-3:] if len(segs) >= 3 else ()


def entry_for(source: str, files: Sequence[FetchStatus]) -> FetchStatus | None:
    """The mirror entry ``source`` points to, or None when it points to none (or is ambiguous).

    Args:
        source: a catalog model's ``source``.
        files: the mirror's entries (``GET /api/v1/files``).
    """
    for f in files:
        if f.url and f.url == source:
            return f
    tail = _path_of(source)
    if tail:
        by_path = [f for f in files if (f.model, f.version, f.file) == tail]
        if len(by_path) == 1:
            return by_path[0]
    by_source = [f for f in files if f.source == source]
    return by_source[0] if len(by_source) == 1 else None


def models_using(
    model: str, version: str, files: Sequence[FetchStatus], catalog: Sequence[tuple[str, str]]
) -> list[str]:
    """The catalog models whose source points at the mirror entry ``model/version``, sorted.

    Args:
        model, version: the mirror entry.
        files: the mirror's entries (``GET /api/v1/files``); an entry not among them has no users.
        catalog: ``(name, source)`` of every catalog model.
    """
    entry = next((f for f in files if (f.model, f.version) == (model, version)), None)
    if entry is None:
        return []
    return sorted(n for n, s in catalog if entry_for(s, files) == entry)


def delete_weights(
    mirror: MirrorClient, *, name: str, source: str, others: Sequence[tuple[str, str]], api: str
) -> str:
    """Delete the mirror entry model ``name``'s ``source`` points to, unless another model uses it.

    Args:
        mirror: the mirror's management API.
        name: the model being removed.
        source: its catalog source.
        others: ``(name, source)`` of every other model in the catalog.
        api: the mirror's URL, for the message.

    Returns:
        One line for people: what was deleted, or why nothing was.

    Raises:
        ApiError, UnreachableError: the mirror refused or did not answer.
    """
    files = mirror.files()
    entry = entry_for(source, files)
    if entry is None:
        return (
            f"{name}'s source {source} is not a file of the mirror at {api}; nothing deleted there "
            "(see 'llmgw mirror ls')"
        )
    where = f"{entry.model}/{entry.version}"
    users = models_using(entry.model, entry.version, files, others)
    if users:
        return (
            f"kept {where} ({entry.file}) in the mirror: {', '.join(users)} use{'s' if len(users) == 1 else ''} "
            f"it too; delete it with 'llmgw mirror rm {entry.model} {entry.version}' once no model does"
        )
    last = mirror.delete(entry.model, entry.version)
    return f"deleted {where} ({last.file}) from the mirror at {api}"
