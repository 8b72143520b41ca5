"""How much memory a replica needs when its profile gives no ``min_memory_gb``: read from the GGUF.

Mechanism:

1. :func:`read_facts` reads the GGUF **header** only (magic, version, the key/value section) from
   the model's source, which is normally the mirror's URL: an HTTP ``Range: bytes=0-`` request
   whose body is read just as far as the key/value section goes (gemma-3-270m: 6.5 MB of 253 MB,
   almost all of it the 262,144-token vocabulary), then closed. ``file:`` sources are read locally.
   The value types come from the ``gguf`` package (``gguf.constants.GGUFValueType``). Its
   ``GGUFReader`` is not used: it maps the whole file, cannot read a truncated one ("cannot reshape
   array"), and took 13.7 s here on gemma-3-270m, parsing every vocabulary entry into numpy views.
2. :func:`estimate` turns the facts and a profile's engine args into bytes::

       weights  = the file's size (tensor data ≈ file − header; the header counts too, it is small)
       kv       = Σ over layers  cells(l) × head_count_kv × (key_length + value_length) × bytes(cache type)
       overhead = OVERHEAD_BYTES (compute buffers, output logits, the engine's own heap)
       total    = weights + kv + overhead

   ``cells(l)`` is the context (``--ctx-size``/``-c``; else the catalog's ``context_length``; else
   the GGUF's ``{arch}.context_length``, which is what llama-server uses with ``-c 0``).
   ``key_length``/``value_length`` fall back to ``embedding_length / head_count`` when absent;
   ``head_count_kv`` falls back to ``head_count`` and, when it is a per-layer array, is summed.
   Cache bytes per element come from ``--cache-type-k/-ctk`` and ``--cache-type-v/-ctv`` (f16: 2).

**Sliding-window models** (``{arch}.attention.sliding_window`` present): llama.cpp keeps only about
``min(ctx, window × n_seq + n_ubatch)`` cells on a sliding-window layer (unless ``--swa-full``).
Which layers slide is per architecture and is not in the GGUF for Gemma 3: llama.cpp hard-codes
the pattern (``hparams.set_swa_pattern(6)`` for ``gemma3``: five sliding layers, then one global;
``gemma2``: every other layer). :data:`SWA_PATTERN` holds those we know; for any other
architecture with a window every layer is counted at full context, which over-estimates and never
places a replica onto memory it will not have. ``n_seq`` is ``--parallel``/``-np`` (default 4,
llama-server's auto) and ``n_ubatch`` is ``--ubatch-size``/``-ub`` (default 512).

Worked example, gemma-3-270m Q4_K_M at ``--ctx-size 2048`` (18 layers, 1 KV head, key/value 256,
window 512): 3 global layers × 2048 cells + 15 sliding × min(2048, 512×4+512)=2048 cells → 36,864
cells × 1 × 512 × 2 B = 37.7 MB KV; weights 253.1 MB; + 300 MB overhead → 0.59 GB.

Errors: :class:`EstimateError` (a :class:`~llmgw.errors.LlmgwError`) names the source and what is
wrong with it ("not a GGUF file", "the header ends early", "cannot be read: …").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from llmgw.errors import EstimateError
from llmgw.ggufheader import HEADER_LIMIT_BYTES, GgufFacts, parse_header
from llmgw.httpverify import verify_context

__all__ = ["HEADER_LIMIT_BYTES", "Estimate", "GgufFacts", "estimate", "parse_header", "read_facts"]

GB = 1e9

OVERHEAD_BYTES = 300_000_000
"""Compute buffers, output logits and the engine's heap on top of weights and KV (llama.cpp:
"a few hundred MiB", growing with ``--ubatch-size``; llama-server measured here with gemma-3-270m
at ``-c 2048``: model 253 MB + KV 37.7 MB + compute ≈ 0.25 GB)."""

SWA_PATTERN = {"gemma3": 6, "gemma2": 2, "gemma3n": 5}
"""Every N-th layer is global (full context), the others slide (llama.cpp ``set_swa_pattern``)."""

CACHE_TYPE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}
"""Bytes per element of a KV cache type (block size / elements per block, as ggml lays them out)."""


@dataclass(frozen=True)
class Estimate:
    """A replica's memory by part (bytes) and the figures it came from."""

    weights: int
    kv: int
    overhead: int
    ctx: int
    kv_cells: int

    @property
    def total(self) -> int:
        """weights + kv + overhead (bytes)."""
        return self.weights + self.kv + self.overhead

    @property
    def total_gb(self) -> float:
        """The total in GB (10^9 bytes), as ``min_memory_gb`` is."""
        return self.total / GB


class _ChunkStream:
    """A file-like ``read`` over an iterator of byte chunks (an HTTP body). A read copies what it
    returns and nothing more: the header is read in ~500,000 small reads (two per vocabulary entry),
    and cutting each off the front of the 1 MiB chunk (a copy of the rest) took 9.6 s of CPU for
    gemma-3-270m's header, 0.5 s now (measured on 2 cores)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.buf, self.pos = chunks, b"", 0

    def read(self, n: int) -> bytes:
        if len(self.buf) - self.pos < n:
            parts, have = [self.buf[self.pos :]], len(self.buf) - self.pos
            while have < n:
                try:
                    chunk = next(self.chunks)
                except StopIteration:
                    break
                parts.append(chunk)
                have += len(chunk)
            self.buf, self.pos = b"".join(parts), 0
        out = self.buf[self.pos : self.pos + n]
        self.pos += len(out)
        return out


def read_facts(source: str, *, transport: httpx.BaseTransport | None = None, timeout_s: float = 30.0) -> GgufFacts:
    """The GGUF facts of ``source`` (``http(s)://`` by Range request, ``file:/abs/path`` locally).

    Raises:
        EstimateError: the source cannot be read (the cause chained), or is not a readable GGUF.
    """
    if source.startswith("file:"):
        path = Path(source.removeprefix("file:").removeprefix("//"))
        try:
            with path.open("rb") as f:
                return parse_header(f, source=source, file_size=path.stat().st_size)
        except OSError as e:
            raise EstimateError(f"{source}: cannot be read: {e.strerror}") from e
    if not source.startswith(("http://", "https://")):
        raise EstimateError(f"{source}: only http(s):// and file: sources can be estimated; set min_memory_gb")
    try:
        with (
            httpx.Client(
                timeout=timeout_s, transport=transport, follow_redirects=True, verify=verify_context()
            ) as client,
            client.stream("GET", source, headers={"Range": f"bytes=0-{HEADER_LIMIT_BYTES - 1}"}) as resp,
        ):
            if resp.status_code not in (200, 206):
                raise EstimateError(f"{source}: answered {resp.status_code} to a Range request for its header")
            size = _total_size(resp)
            return parse_header(
                _ChunkStream(resp.iter_bytes(1 << 20)),  # type: ignore[arg-type]
                source=source,
                file_size=size,
            )
    except httpx.HTTPError as e:
        raise EstimateError(f"{source}: cannot be read: {type(e).__name__}: {e}") from e


def _total_size(resp: httpx.Response) -> int:
    rng = resp.headers.get("content-range", "")  # bytes 0-999/253113024
    if "/" in rng and rng.rsplit("/", 1)[1].strip().isdigit():
        return int(rng.rsplit("/", 1)[1])
    if resp.status_code == 200 and resp.headers.get("content-length", "").isdigit():
        return int(resp.headers["content-length"])
    return 0


# --- the estimate ---


def _arg(args: Sequence[str], names: tuple[str, ...]) -> str | None:
    """The value of the last of ``names`` in ``args`` (``--ctx-size 2048`` or ``--ctx-size=2048``)."""
    found = None
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if flag in names:
            if eq:
                found = val
            elif i + 1 < len(args):
                found = args[i + 1]
    return found


def _int_arg(args: Sequence[str], names: tuple[str, ...], default: int) -> int:
    v = _arg(args, names)
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


def estimate(facts: GgufFacts, args: Sequence[str] = (), *, context_length: int = 0) -> Estimate:
    """The memory one replica needs with these engine ``args`` (llama-server flags), as the module
    docstring describes. ``context_length``: the catalog's, used when ``args`` set no ``--ctx-size``."""
    ctx = _int_arg(args, ("--ctx-size", "-c"), 0) or context_length or facts.context_length or 4096
    n_seq = max(_int_arg(args, ("--parallel", "-np"), 4), 1)
    ubatch = _int_arg(args, ("--ubatch-size", "-ub"), 512)
    bk = CACHE_TYPE_BYTES.get(_arg(args, ("--cache-type-k", "-ctk")) or "f16", 2.0)
    bv = CACHE_TYPE_BYTES.get(_arg(args, ("--cache-type-v", "-ctv")) or "f16", 2.0)
    fallback = facts.embedding_length // facts.head_count if facts.head_count else 0
    key_len = facts.key_length or fallback
    value_len = facts.value_length or fallback
    layers = facts.block_count
    heads = facts.head_count_kv or [facts.head_count or 1]
    per_layer_heads = heads if len(heads) == layers else [heads[0]] * layers
    pattern = SWA_PATTERN.get(facts.architecture, 0)
    swa_full = "--swa-full" in args
    swa_cells = min(ctx, facts.sliding_window * n_seq + ubatch)
    kv = 0.0
    cells_total = 0
    for layer, h in enumerate(per_layer_heads):
        sliding = bool(facts.sliding_window and pattern and not swa_full and (layer + 1) % pattern != 0)
        cells = swa_cells if sliding else ctx
        cells_total += cells
        kv += cells * h * (key_len * bk + value_len * bv)
    return Estimate(
        weights=facts.file_size,
        kv=int(kv),
        overhead=OVERHEAD_BYTES,
        ctx=ctx,
        kv_cells=cells_total,
    )
