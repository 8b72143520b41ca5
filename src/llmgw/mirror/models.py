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

from llmgw import names

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


def check_catalog_name(value: str, what: str) -> str:
    """A model or version name for something new in the store: the catalog's rule
    (:func:`llmgw.names.check_name`, lowercase, at most 63 characters), so that a catalog entry can
    name what the mirror holds (a new user stored ``Big_Model/V1``, which no model.yaml could then
    refer to), and a safe path segment (:func:`check_name`). What is already stored under a name of
    the wider rule stays listed, served and removable.

    Raises:
        ValueError: the message names ``what``, the value and the rule.
    """
    check_name(value, what)
    return names.check_name(value, what)


def _model(v: str) -> str:
    return check_catalog_name(v, "model")


def _version(v: str) -> str:
    return check_catalog_name(v, "version")


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
        eta_s: seconds left at that rate (``bytes_total - bytes_done`` / rate); None while the
            size or the rate is unknown, 0 once present.
        expected_sha256: the digest the source published (the Hugging Face LFS sha256), which the
            download is checked against; empty when the source publishes none.
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
    eta_s: float | None = None
    expected_sha256: str = ""

    def percent(self) -> int | None:
        """Whole percent done (0..100), 100 once present; None while the size is unknown."""
        if self.state == "present":
            return 100
        if not self.bytes_total:
            return None
        return max(0, min(100, self.bytes_done * 100 // self.bytes_total))

    def eta_text(self) -> str:
        """``eta_s`` for people: ``"45 s"``, ``"3 min 20 s"``, ``"1 h 05 min"``; ``""`` when unknown."""
        if self.eta_s is None:
            return ""
        s = round(self.eta_s)
        if s < 60:
            return f"{s} s"
        if s < 3600:
            return f"{s // 60} min {s % 60:02d} s"
        return f"{s // 3600} h {s % 3600 // 60:02d} min"

    def progress_text(self) -> str:
        """One progress line: ``"42%, 12.3 MB/s, 20 s left"`` (parts not known are left out)."""
        parts = [f"{p}%"] if (p := self.percent()) is not None else [f"{self.bytes_done} bytes"]
        if self.rate_bytes_per_s:
            parts.append(f"{self.rate_bytes_per_s / 1e6:.1f} MB/s")
        if self.state == "fetching" and (eta := self.eta_text()):
            parts.append(f"{eta} left")
        return ", ".join(parts)


class Manifest(BaseModel):
    """The on-disk record of one ``model/version`` (``manifest.json``), written atomically.

    ``size`` is the final size once present (``None`` before); ``bytes_done``/``bytes_total`` are
    progress as of ``updated_at`` (written at most about once a second while fetching);
    ``expected_sha256`` is the digest the source published, kept so a resumed fetch checks it too.
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
    expected_sha256: str = ""
    updated_at: datetime
