"""The ``guard:`` block of server.yaml: guardrail policies.

A policy says which judges read the text (the first of them that is available serves), what is
checked (``in``: the prompt, before any engine is asked; ``out``: the answer, before the client
sees it), what happens to a Controversial verdict (``block``, ``warn`` or ``allow``: Qwen3Guard's
own report evaluates both the strict and the loose reading, and which wins depends on the traffic),
what happens when no verdict comes (``fail: closed`` refuses with 503, ``fail: open`` serves the
request marked unjudged), the time one judgment may take (``budget_s``, 5 s by default: a
~280-token judgment was measured at 4.2 s on two cores and 2.3 s on four), and which models and API
keys it applies to. Unsafe is always blocked; a parsed block blocks even under ``fail: open``.

Example::

    guard:
      policies:
        - name: default
          judge: [qwen3guard-0.6b]     # or one name
          check: [in, out]
          controversial: warn
          fail: closed
          budget_s: 5
          models: []                   # empty: every model; names, aliases or shell patterns ("qwen*")
          keys: []                     # empty: every caller; API key ids (sha256 hex prefixes)
          key_names: []                # stored keys by name ('ctl key create NAME': they survive 'ctl key rotate'),
                                       # keys-file (the keys file's keys), loopback (this machine, no key)

With no policy, guardrails are off (:meth:`GuardConfig.on` is False) and the gateway relays
untouched. The first policy (in file order) whose ``models`` and ``keys`` match a request is the
one that applies. ``keys`` and ``key_names`` together say which callers: a key whose id is in
``keys`` or which is the stored key named in ``key_names`` (an id changes when its key is rotated,
so a policy listing it stopped applying to the new secret, without a word: a new user's finding);
both empty, every caller.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmgw.bearer import sent_bytes
from llmgw.names import check_unique

#: Seconds one judgment may take unless a policy says otherwise.
DEFAULT_BUDGET_S = 5.0


class Direction(StrEnum):
    """What is judged: ``in`` the client's prompt, ``out`` the model's answer."""

    IN = "in"
    OUT = "out"


class Controversial(StrEnum):
    """What a Controversial verdict does: refuse it, serve it with a warning logged, or serve it."""

    BLOCK = "block"
    WARN = "warn"
    ALLOW = "allow"


class FailMode(StrEnum):
    """No verdict (judge missing, down, over budget, unparseable): ``closed`` refuses, ``open`` serves."""

    CLOSED = "closed"
    OPEN = "open"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def key_id(key: str) -> str:
    """An API key's id for policies and logs: the first 12 hex digits of its SHA-256 (never the key) of
    its bytes as sent (:func:`llmgw.bearer.sent_bytes`)."""
    return hashlib.sha256(sent_bytes(key)).hexdigest()[:12]


class Policy(_Strict):
    """One guardrail policy; see the module docstring for each field's meaning."""

    name: str
    judge: str | list[str]
    check: list[Direction] = Field(default_factory=lambda: [Direction.IN, Direction.OUT])
    controversial: Controversial = Controversial.WARN
    fail: FailMode = FailMode.CLOSED
    budget_s: Annotated[float, Field(gt=0, le=600)] = DEFAULT_BUDGET_S
    models: list[str] = Field(default_factory=list)
    keys: list[str] = Field(default_factory=list)
    key_names: list[str] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("a policy needs a name (it is shown to clients whose request it refuses)")
        return v

    @field_validator("judge")
    @classmethod
    def _judge(cls, v: str | list[str]) -> str | list[str]:
        names = [v] if isinstance(v, str) else v
        if not names or any(not n.strip() for n in names):
            raise ValueError(
                "name at least one judge model, e.g. 'qwen3guard-0.6b' (the first one available serves)"
            )
        return v

    @field_validator("check")
    @classmethod
    def _check(cls, v: list[Direction]) -> list[Direction]:
        if not v:
            raise ValueError("check what: [in], [out] or [in, out]; a policy that checks nothing does nothing")
        return list(dict.fromkeys(v))

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        for k in v:
            if len(k) < 8 or any(c not in "0123456789abcdef" for c in k):
                raise ValueError(
                    f"'{k}' is not a key id: use the first 8-64 hex digits of the key's SHA-256 "
                    "(printf %s KEY | sha256sum), never the key itself"
                )
        return v

    def judges(self) -> list[str]:
        """The judge models in order of preference (the first available serves)."""
        return [self.judge] if isinstance(self.judge, str) else list(self.judge)

    def checks(self, direction: Direction) -> bool:
        """Whether this policy judges ``direction``."""
        return direction in self.check

    def applies(self, model: str, caller: str, aliases: Sequence[str] = (), key_name: str = "") -> bool:
        """Whether this policy covers ``model`` (catalog name; ``aliases``: its other names, which a
        pattern may name too) for the caller whose key id is ``caller`` and, for a stored key, whose
        name is ``key_name`` ("" for a keys-file key or no key).

        ``caller`` is "" for a loopback client without a key; a policy limited to keys skips it.
        (``models: [gemma]`` with ``gemma`` an alias guarded nothing, without a word: a new user's finding.)
        """
        names = (model, *aliases)
        if self.models and not any(fnmatch.fnmatchcase(n, p) for p in self.models for n in names):
            return False
        if not self.keys and not self.key_names:
            return True
        by_id = bool(caller) and any(caller.startswith(k) or k.startswith(caller) for k in self.keys)
        return by_id or (bool(key_name) and key_name in self.key_names)


class GuardConfig(_Strict):
    """``guard:`` in server.yaml: the policies, in the order they are tried. Empty means off."""

    policies: list[Policy] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> GuardConfig:
        check_unique([p.name for p in self.policies], "policies")
        return self

    def on(self) -> bool:
        """Whether any policy is set."""
        return bool(self.policies)

    def policy_for(
        self, model: str, caller: str = "", aliases: Sequence[str] = (), key_name: str = ""
    ) -> Policy | None:
        """The first policy that applies to ``model`` (with its ``aliases``) and ``caller`` (a key id;
        ``key_name``: a stored key's name), or None."""
        for p in self.policies:
            if p.applies(model, caller, aliases, key_name):
                return p
        return None

    def judge_names(self) -> list[str]:
        """Every judge any policy names, sorted, each once."""
        return sorted({j for p in self.policies for j in p.judges()})


def closed_judges(guard: GuardConfig) -> dict[str, str]:
    """``{judge model name: policy name}`` for every judge of a ``fail: closed`` policy (the first
    such policy named): these models never scale to zero (the admin API refuses ``scaling.min: 0``)."""
    out: dict[str, str] = {}
    for p in guard.policies:
        if p.fail != FailMode.CLOSED:
            continue
        for judge in [p.judge] if isinstance(p.judge, str) else p.judge:
            out.setdefault(judge, p.name)
    return out

