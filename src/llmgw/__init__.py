"""llmgw: a self-hosted LLM service (control plane, model mirror, node agents, guarded gateway)."""

__version__ = "0.1.0"
