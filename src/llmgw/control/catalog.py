"""The model catalog: what a model is, how it may be served (profiles), and how many replicas.

Fields follow the seeds' ``catalog.Model``/``catalog.Profile`` (DESIGN.md, "Catalog model").
These are the catalog's own objects; storage rows and API views are separate classes.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


class Role(StrEnum):
    """What a model is for: ``chat`` is offered to clients; ``guard`` judges, and is not offered."""

    CHAT = "chat"
    GUARD = "guard"


class Engine(StrEnum):
    """The engines a profile can ask for."""

    LLAMACPP = "llamacpp"
    VLLM = "vllm"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Scaling(_Strict):
    """How many replicas: at least ``min``, at most ``max`` (``min <= max``)."""

    min: Annotated[int, Field(ge=0)] = 1
    max: Annotated[int, Field(ge=0)] = 1

    @model_validator(mode="after")
    def _order(self) -> Scaling:
        if self.min > self.max:
            raise ValueError(f"scaling.min {self.min} is more than scaling.max {self.max}")
        return self


class Profile(_Strict):
    """One way to serve a model: an engine, the resources it needs, and the engine's args.

    Attributes:
        priority: higher is tried first (the seed: GPU profiles 200, CPU 100).
        min_memory_gb: memory a replica reserves on the node (GB, 10^9 bytes); on a GPU profile, on the card.
        cpu_cores: cores reserved (0: no reservation, the engine shares the node's cores).
        gpu_class: the class a node's GPU must have (``h100-80gb``); empty for a CPU profile.
        gpu_count: whole GPUs of that class a replica takes (exclusively; ``min_memory_gb`` is split
            evenly over them). Ignored on a CPU profile.
        node_selector: labels the node must carry, all of them.
        args: extra engine arguments (``["--ctx-size", "16384"]``).
    """

    name: str
    engine: Engine = Engine.LLAMACPP
    gpu_class: str = ""
    gpu_count: Annotated[int, Field(ge=1)] = 1
    priority: int = 100
    min_memory_gb: Annotated[float, Field(ge=0)] = 0
    cpu_cores: Annotated[int, Field(ge=0)] = 0
    node_selector: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)


class GuardModel(_Strict):
    """A guard model's judge format: ``qwen3guard``, ``llamaguard3`` or ``prompted``."""

    format: str = "qwen3guard"


class Model(_Strict):
    """A catalog entry.

    Attributes:
        source: where the weights come from (normally the mirror's URL of the file).
        sha256: the file's digest, which a node checks after its download; empty to trust the mirror's header.
        context_length: the context a client may use (tokens).
        max_output: the most tokens a client may ask for in one answer.
    """

    name: str
    aliases: list[str] = Field(default_factory=list)
    description: str = ""
    source: str
    version: str = "1"
    sha256: str = ""
    role: Role = Role.CHAT
    guard: GuardModel | None = None
    routing_profile: str = ""
    context_length: Annotated[int, Field(ge=0)] = 0
    max_output: Annotated[int, Field(ge=0)] = 0
    scaling: Scaling = Field(default_factory=Scaling)
    profiles: list[Profile] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(
                f"'{v}' is not a model name: use lowercase letters, digits, '.', '_' or '-', "
                "starting with a letter or digit, at most 63 characters"
            )
        return v

    @model_validator(mode="after")
    def _profiles_unique(self) -> Model:
        names = [p.name for p in self.profiles]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"profiles: names must be unique, '{dup[0]}' appears more than once")
        if self.name in self.aliases:
            raise ValueError(f"aliases: '{self.name}' is the model's own name")
        return self

    def profiles_by_priority(self) -> list[Profile]:
        """Profiles in the order placement tries them: highest priority first, then as listed."""
        return sorted(self.profiles, key=lambda p: -p.priority)

    @property
    def file_name(self) -> str:
        """The weights' file name: the last part of ``source``."""
        return self.source.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]
