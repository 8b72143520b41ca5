"""The engines the agent runs, and the registry the replica runner picks them from.

Each engine module (:mod:`~llmgw.agent.engines.llamacpp`, :mod:`~llmgw.agent.engines.vllm`) finds
and checks its build on the node and implements :class:`~llmgw.agent.engines.base.Engine`, the
seam the runner (:mod:`llmgw.agent.replicas.runner`) drives every engine through. A new engine is a
module with an ``Engine`` and a line in :data:`ENGINES`.
"""

from __future__ import annotations

from typing import Any

from llmgw.agent.engines.base import Engine
from llmgw.agent.engines.llamacpp import LLAMACPP
from llmgw.agent.engines.vllm import VLLM
from llmgw.errors import EngineError

ENGINES: dict[str, Engine[Any]] = {e.name: e for e in (LLAMACPP, VLLM)}
"""Every engine this agent runs, by the profile's ``engine`` name."""


def engine_for(name: str) -> Engine[Any]:
    """The engine a profile names (``"llamacpp"``, ``"vllm"``).

    Raises:
        EngineError: this agent does not run ``name``; the message lists the engines it runs.
    """
    engine = ENGINES.get(name)
    if engine is None:
        raise EngineError(
            f"engine '{name}' is not run by this agent (it runs {' and '.join(ENGINES)}); "
            "place the model with a llamacpp profile"
        )
    return engine
