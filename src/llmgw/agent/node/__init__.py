"""What this node has and keeps, below every other agent package: its inventory (discovery), its
model cache, the replica records that let a restarted agent adopt its engines, the engine logs
and the CPU cores handed to replicas."""
