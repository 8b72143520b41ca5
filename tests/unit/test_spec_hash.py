"""Replica spec hashes: what makes the leader replace a replica, and what must not (an upgrade)."""

from __future__ import annotations

import hashlib

from llmgw.catalog import Model
from llmgw.control.reconcile.leader import spec_hash, spec_hashes


def test_a_replica_hashed_before_profiles_had_nodes_and_env_is_not_stale() -> None:
    """Upgrading llmgw must not restart every replica: a stored hash of the whole profile as it was
    before ``nodes`` and ``env`` existed still matches while those are at their defaults."""
    model = Model.model_validate({"name": "m", "source": "http://x/m.gguf", "profiles": [{"name": "cpu"}]})
    prof = model.profiles[0]
    old_json = prof.model_dump_json(exclude={"nodes", "env"})  # what the hash of 2026-11 was over
    assert '"priority":100' in old_json
    old = hashlib.sha256("|".join([old_json, model.source, model.version, model.sha256]).encode()).hexdigest()[:16]
    assert old in spec_hashes(model, "cpu")
    assert spec_hash(model, "cpu") in spec_hashes(model, "cpu")
    grouped = model.model_copy(update={"profiles": [prof.model_copy(update={"nodes": 2})]})
    assert old not in spec_hashes(grouped, "cpu")  # a real change still restarts it
