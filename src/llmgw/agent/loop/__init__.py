"""The agent's loop (the top of the agent): heartbeats to the control planes it rotates through
(:mod:`~llmgw.agent.loop.controlplanes`), reconciling the replicas it is told to run
(:mod:`~llmgw.agent.loop.loop`), the engines' metrics relay and TLS diagnosis."""
