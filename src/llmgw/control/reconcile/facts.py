"""The GGUF headers the leader reads before a pass (:mod:`llmgw.control.placement.estimate`), for
profiles that give no ``min_memory_gb``: read from the mirror once per source and stored; a source
that failed is tried again after :data:`FACTS_RETRY_S`."""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmgw.control.placement import estimate as est
from llmgw.control.reconcile.view import View
from llmgw.control.store import Store
from llmgw.errors import EstimateError

log = logging.getLogger(__name__)

#: A GGUF header that could not be read is tried again after this long (seconds).
FACTS_RETRY_S = 60.0

#: Reads a GGUF header from a source URL (the leader's seam; default: an HTTP Range request).
FactsReader = Callable[[str], est.GgufFacts]


def refresh(store: Store, view: View | None, read_facts: FactsReader, now: float) -> list[str]:
    """Read the GGUF header of every model source that needs an estimate and has none stored (or
    whose last try failed :data:`FACTS_RETRY_S` ago), store it; returns the sources read. With
    ``view`` (a dirty pass next) the models and facts are the view's, and the models of a source
    read have their reservations counted again; without, they are read from the store."""
    stored = view.facts if view is not None else store.list_gguf_facts()
    done = []
    for row in list(view.models.values()) if view is not None else store.list_models():
        m = row.model
        if all(p.min_memory_gb > 0 for p in m.profiles):
            continue
        have = stored.get(m.source)
        if have is not None and (have[0] or now - have[2] < FACTS_RETRY_S):
            continue
        try:
            facts = read_facts(m.source)
        except EstimateError as e:
            log.warning("model %s: no memory estimate: %s", m.name, e)
            store.set_gguf_facts(m.source, body="", error=str(e), now=now)
            stored[m.source] = ("", str(e), now)
            continue
        store.set_gguf_facts(m.source, body=facts.model_dump_json(), error="", now=now)
        stored[m.source] = (facts.model_dump_json(), "", now)
        done.append(m.source)
    if view is not None and done:
        view.touch_models({r.name for r in view.models.values() if r.model.source in done})
    return done
