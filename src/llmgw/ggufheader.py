"""A GGUF file's header: the magic, version and key/value section, and the facts llmgw uses of it.

Read by the control plane's memory estimate (:mod:`llmgw.control.placement.estimate`, over HTTP from
the mirror) and by a group head's agent (:mod:`llmgw.agent.engines.llamacpp_group`, the layer count of its local
file). The value types come from the ``gguf`` package (``gguf.constants.GGUFValueType``), imported
at the first header read, not with this module: it pulls numpy, 0.25-0.3 s of CPU that every control
plane and agent start paid (measured on 2 cores, 2026-12-04), most of them never reading a header. Its
``GGUFReader`` is not used: it maps the whole file, cannot read a truncated one, and took 9.7-13.7 s
here on gemma-3-270m, parsing every vocabulary entry into numpy views (this reads the header in
tens of milliseconds and skips the vocabulary).
"""

from __future__ import annotations

import functools
import pathlib
import struct
from typing import IO, Any, NamedTuple

from pydantic import BaseModel, Field

from llmgw.errors import EstimateError

HEADER_LIMIT_BYTES = 64 << 20
"""Give up on a key/value section longer than this (a 256k vocabulary takes ~7 MB)."""

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""


def is_gguf(path: pathlib.Path) -> bool:
    """True when ``path`` starts with the GGUF magic bytes ``GGUF`` (``server init``'s starter and
    judge, ``mirror add`` of a ``.gguf``).

    Raises:
        OSError: the file cannot be opened or read.
    """
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


class GgufFacts(BaseModel):
    """What placement needs from a GGUF header. Lengths in elements, sizes in bytes."""

    architecture: str
    file_size: int
    block_count: int
    head_count: int = 0
    head_count_kv: list[int] = Field(default_factory=list)  # one value, or one per layer
    key_length: int = 0
    value_length: int = 0
    embedding_length: int = 0
    context_length: int = 0
    sliding_window: int = 0
    header_bytes: int = 0


class _Format(NamedTuple):
    """The GGUF format's numbers: the magic (``GGUF`` as a little-endian uint32), the string and
    array value types, and the struct format of each scalar value type."""

    magic: int
    string: int
    array: int
    scalars: dict[int, str]


@functools.cache
def _format() -> _Format:
    from gguf.constants import GGUF_MAGIC, GGUFValueType  # noqa: PLC0415 - here: it pulls numpy (module docstring)

    t = GGUFValueType
    return _Format(int(GGUF_MAGIC), int(t.STRING), int(t.ARRAY), {
        int(t.UINT8): "<B", int(t.INT8): "<b", int(t.UINT16): "<H", int(t.INT16): "<h", int(t.UINT32): "<I",
        int(t.INT32): "<i", int(t.FLOAT32): "<f", int(t.BOOL): "<?", int(t.UINT64): "<Q", int(t.INT64): "<q",
        int(t.FLOAT64): "<d",
    })


class _Reader:
    """Little-endian reads over a byte stream, counting bytes; EstimateError when it ends early."""

    def __init__(self, stream: IO[bytes], source: str) -> None:
        self.stream, self.source, self.pos = stream, source, 0
        self.format = _format()

    def take(self, n: int) -> bytes:
        if self.pos + n > HEADER_LIMIT_BYTES:
            raise EstimateError(f"{self.source}: the GGUF header is longer than {HEADER_LIMIT_BYTES >> 20} MiB")
        data = self.stream.read(n)
        while len(data) < n:
            more = self.stream.read(n - len(data))
            if not more:
                raise EstimateError(f"{self.source}: the GGUF header ends early (at byte {self.pos + len(data)})")
            data += more
        self.pos += n
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool) -> Any:
        scalars = self.format.scalars
        if vtype in scalars:
            return self.scalar(scalars[vtype])
        if vtype == self.format.string:
            return self.string()
        if vtype == self.format.array:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in scalars and not keep:
                self.take(struct.calcsize(scalars[item]) * count)  # skipped in one read
                return None
            if item == self.format.string and not keep:  # the vocabulary: lengths read, text skipped
                for _ in range(count):
                    self.take(struct.unpack("<Q", self.take(8))[0])
                return None
            values = [self.value(item, keep) for _ in range(count)]
            return values if keep else None
        raise EstimateError(f"{self.source}: unknown GGUF value type {vtype}; not a GGUF this build can read")


def parse_header(stream: IO[bytes], *, source: str, file_size: int) -> GgufFacts:
    """Parse the magic, version and key/value section of a GGUF from ``stream`` (read no further).

    Raises:
        EstimateError: not a GGUF, an unsupported version, a header that ends early, or keys
            placement needs (``general.architecture``, ``{arch}.block_count``) missing.
    """
    r = _Reader(stream, source)
    magic = struct.unpack("<I", r.take(4))[0]
    if magic != r.format.magic:
        raise EstimateError(f"{source}: not a GGUF file (magic {magic:#010x}); the estimate needs a GGUF")
    version = r.scalar("<I")
    if version not in (2, 3):
        raise EstimateError(f"{source}: GGUF version {version} is not supported (2 and 3 are)")
    r.scalar("<Q")  # tensor count
    kv_count = r.scalar("<Q")
    kv: dict[str, Any] = {}
    for _ in range(kv_count):
        key = r.string()
        vtype = r.scalar("<I")
        # Only small arrays are kept (per-layer head counts); the vocabulary is skipped.
        keep = not key.startswith("tokenizer.")
        kv[key] = r.value(vtype, keep)
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        raise EstimateError(f"{source}: the GGUF has no general.architecture; cannot estimate its memory")

    def num(name: str) -> int:
        v = kv.get(f"{arch}.{name}")
        if isinstance(v, list):
            return int(max(v)) if v else 0
        return int(v) if isinstance(v, (int, float)) else 0

    blocks = num("block_count")
    if blocks <= 0:
        raise EstimateError(f"{source}: the GGUF has no {arch}.block_count; cannot estimate its memory")
    hkv = kv.get(f"{arch}.attention.head_count_kv")
    heads_kv = [int(x) for x in hkv] if isinstance(hkv, list) else ([int(hkv)] if hkv is not None else [])
    return GgufFacts(
        architecture=arch,
        file_size=file_size,
        block_count=blocks,
        head_count=num("attention.head_count"),
        head_count_kv=heads_kv,
        key_length=num("attention.key_length"),
        value_length=num("attention.value_length"),
        embedding_length=num("embedding_length"),
        context_length=num("context_length"),
        sliding_window=num("attention.sliding_window"),
        header_bytes=r.pos,
    )
