"""The network every member of a replica spread over several nodes uses, whatever its engine: the
worker's engine isolated in a network namespace of its own, and the agents' mTLS tunnels between
head and workers (:mod:`~llmgw.agent.groups.groupnet`)."""
