"""What a replica was placed from (its ``spec_hash``) and its id: the leader's pass (step 3)
replaces a replica whose hash is no longer one of its profile's (:func:`spec_hashes`)."""

from __future__ import annotations

import hashlib
import secrets

from llmgw.catalog import Model


def spec_hash(model: Model, profile_name: str) -> str:
    """What a replica was placed from: the profile's JSON (fields at their defaults left out, so a
    field a new release adds does not restart every replica on upgrade), the source, version and
    digest. A change in any of them restarts the replica."""
    prof = next((p for p in model.profiles if p.name == profile_name), None)
    return _hash(prof.model_dump_json(exclude_defaults=True) if prof else "", model)


#: Profile fields added after replicas were first hashed with every field (the hash of 2026-11:
#: the whole profile). A stored hash of that form still matches while these are at their defaults.
_ADDED_SINCE_FULL_HASH = {"nodes", "env"}


def spec_hashes(model: Model, profile_name: str) -> set[str]:
    """Every hash a replica of this profile may carry and still be current: :func:`spec_hash`, and
    the older whole-profile form while the fields added since are at their defaults."""
    out = {spec_hash(model, profile_name)}
    prof = next((p for p in model.profiles if p.name == profile_name), None)
    if prof is not None and prof.nodes == 1 and not prof.env:
        out.add(_hash(prof.model_dump_json(exclude=_ADDED_SINCE_FULL_HASH), model))
    return out


def _hash(profile_json: str, model: Model) -> str:
    text = "|".join([profile_json, model.source, model.version, model.sha256])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def new_replica_id(model: str) -> str:
    """``<model>-<6 hex>``: short enough to read in logs, random enough not to repeat."""
    return f"{model}-{secrets.token_hex(3)}"
