"""One replica on this node, from weights to a serving engine (:mod:`~llmgw.agent.replicas.runner`):
engine-neutral, it asks the engine (:mod:`llmgw.agent.engines`) for everything engine-specific."""
