"""The mirror's shapes: what its management API speaks, and what it keeps on disk.

Three shapes, on purpose separate even where they look alike:

- :class:`FetchRequest` — the body of ``POST /api/v1/fetch``.
- :class:`FetchStatus` — what the API answers about one ``model/version``.
- :class:`Manifest` — the row kept in ``<dir>/<model>/<version>/manifest.json``.

States and who moves them (all moves are made by the mirror's fetcher):

- ``fetching`` — set when a fetch is asked for (or resumed at start-up after a restart);
- ``present`` — set when the bytes are whole, verified and renamed into place; only then are
  they served;
- ``failed`` — set when the fetch stopped with an error (``err`` says why); a new
  ``POST /api/v1/fetch`` for the same ``model/version`` tries again.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

State = Literal["fetching", "present", "failed"]

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A model, version or file name: one path segment, no leading dot (hidden files hold partial bytes)."""

MANIFEST = "manifest.json"
"""The manifest's name in each version directory; no model file may take it."""


def check_name(value: str, what: str = "name") -> str:
    """Return ``value`` when it is a safe single path segment, else raise ValueError saying the rule."""
    if not NAME_RE.fullmatch(value) or value == MANIFEST:
        raise ValueError(
            f"{what} '{value}' must be 1-128 of A-Z a-z 0-9 . _ -, start with a letter or digit, "
            f"and not be '{MANIFEST}'"
        )
    return value


def _model(v: str) -> str:
    return check_name(v, "model")


def _version(v: str) -> str:
    return check_name(v, "version")


class FetchRequest(BaseModel):
    """``POST /api/v1/fetch``: put ``source`` into the mirror as ``model/version``."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="hf:ORG/REPO/FILE, https://…, http://… or file:/abs/path")
    model: Annotated[str, AfterValidator(_model)]
    version: Annotated[str, AfterValidator(_version)]


class FetchStatus(BaseModel):
    """One ``model/version`` in the mirror, as the management API reports it.

    Attributes:
        model, version, file: where it lives: ``<dir>/<model>/<version>/<file>``.
        source: what it was fetched from.
        state: ``fetching``, ``present`` or ``failed``.
        bytes_done: bytes on disk so far (the whole size once present).
        bytes_total: the file's size when known (the server said, or the local file's size).
        sha256: hex digest, set once present.
        url: where nodes GET it: ``{base}/{model}/{version}/{file}``.
        err: why it failed; empty otherwise.
        rate_bytes_per_s: recent transfer rate over the last few seconds; 0 when idle.
    """

    model: str
    version: str
    file: str
    source: str
    state: State
    bytes_done: int = 0
    bytes_total: int | None = None
    sha256: str = ""
    url: str = ""
    err: str = ""
    rate_bytes_per_s: float = 0.0

    def percent(self) -> int | None:
        """Whole percent done (0..100), 100 once present; None while the size is unknown."""
        if self.state == "present":
            return 100
        if not self.bytes_total:
            return None
        return max(0, min(100, self.bytes_done * 100 // self.bytes_total))


class Manifest(BaseModel):
    """The on-disk record of one ``model/version`` (``manifest.json``), written atomically.

    ``size`` is the final size once present (``None`` before); ``bytes_done``/``bytes_total`` are
    progress as of ``updated_at`` (written at most about once a second while fetching).
    """

    model_config = ConfigDict(extra="ignore")

    file: str
    size: int | None = None
    sha256: str = ""
    source: str
    state: State
    err: str = ""
    bytes_done: int = 0
    bytes_total: int | None = None
    updated_at: datetime
