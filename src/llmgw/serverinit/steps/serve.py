"""Serving one of init's models (the starter in step 6, the judge in step 7): into the mirror,
into the catalog, and, when it runs on this machine, a wait until a replica of it is ready.

A model already in the catalog is kept (and waited for). Offline, a model the mirror does not
have and that was not carried in as a ``file:`` is skipped rather than asked of the internet.
While waiting to serve, placement's "nowhere to run" is believed after ``--unplaced-grace``, and a
replica that failed stops the wait at once: it would not load on the next try either.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw import sourcecheck
from llmgw.catalog import Model
from llmgw.errors import ApiError, EngineError, LlmgwError, MirrorError
from llmgw.mirror.setup import copy_file
from llmgw.serverinit.steps import services
from llmgw.serverinit.steps.context import InitContext
from llmgw.serverinit.wait import PROBE_TIMEOUT_S
from llmgw.service.users import chown_tree
from llmgw.views import ReplicaView

# Builds the catalog entry from the mirror's URL, the file's sha256 and this machine's GPU classes.
EntryFn = Callable[[str, str, list[str]], Model]


def ensure_served(ctx: InitContext, name: str, source: str, version: str, here: bool, entry: EntryFn) -> bool:
    """Fetch a model into the mirror, add it to the catalog, and when it runs ``here``, wait for it
    to answer. Returns False when it was skipped (offline and not in the mirror).

    Raises:
        MirrorError: the mirror could not fetch it. ApiError: the catalog refused it.
        EngineError: it failed to start, or has nowhere to run. WaitTimeout: not in time.
    """
    client = ctx.admin()
    if any(m.name == name for m in client.models()):
        ctx.say("kept", f"{name} in the catalog")
        if here:
            wait_serving(ctx, name)
        return True

    kind = sourcecheck.to_download(source).kind
    mirror = ctx.mirror()
    try:
        st = mirror.status(name, version)
    except ApiError as e:
        if e.status != 404:
            raise
        if ctx.opts.offline and kind != "file":
            # Asked of the internet, it would fail after a timeout and stop init over a model
            # nobody carried in.
            ctx.say("skip", f"{name}: not in the mirror, and an offline cluster does not download it")
            return False
        if kind == "file" and not ctx.opts.mirror_url:
            copy_into_store(ctx, source, name, version)
        st = mirror.fetch(source, name, version)
        ctx.progress(f"{'copying' if kind == 'file' else 'downloading'} {name} into the mirror")

    last_pct = -10

    probe_mirror = ctx.mirror(PROBE_TIMEOUT_S)

    def present() -> bool:
        nonlocal st, last_pct
        try:
            st = probe_mirror.status(name, version)
        except LlmgwError as e:
            ctx.note(f"the mirror does not answer: {e}")
            return False
        detail = f": {st.progress_text()}" if st.percent() is not None else ""
        ctx.note(f"{name} {st.state} in the mirror{detail}")
        if st.state == "present":
            return True
        if st.state == "failed":
            raise MirrorError(f"the mirror could not fetch {name}: {st.err}")
        pct = st.percent()
        if pct is not None and pct >= last_pct + 10:
            ctx.progress(st.progress_text())  # percent, rate, ETA
            last_pct = pct
        return False

    ctx.wait(ctx.opts.download_wait_s, f"{name} to download", present, interval_s=ctx.opts.poll_s)
    ctx.say("done", f"{name} in the mirror")

    classes = ctx.gpu_probe() if here else []
    model = entry(st.url, st.sha256, classes)
    try:
        client.add_model(model.model_dump(mode="json"))
    except ApiError as e:
        raise ApiError(f"adding {name} to the catalog: {e}", status=e.status, code=e.code) from e
    if not here:
        ctx.say("done", f"{name} in the catalog; it runs on a node with room for it")
        return True
    where = "on CPU"
    if classes:
        where = "on " + ", ".join(classes) + ", or CPU if the card is busy"
    ctx.say("done", f"{name} in the catalog, served here {where}")
    wait_serving(ctx, name)
    return True


def copy_into_store(ctx: InitContext, source: str, name: str, version: str) -> None:
    """Copy a ``file:`` model into the local mirror's store as ``name/version`` (present, with its
    sha256), as this process (root), then give the store to the mirror's user; the mirror then
    finds it there when asked for ``source``.

    Init used to make the file's directory one of the mirror's import directories: everything
    beside the model (an ssh key in the same home) could then be imported by anyone who reached
    the management API and served on the bytes port, by a mirror that ran as root. Now the mirror
    imports nothing on init's behalf, and the one file named is copied.

    Raises:
        MirrorError: the file cannot be copied (missing, a special file, a hard link, inside
            llmgw's own configuration or state).
    """
    p = ctx.paths
    ctx.progress(f"copying {sourcecheck.to_download(source).path} into the mirror's store {p.mirror_store}")
    copy_file(source, name, version, store_dir=p.mirror_store, deny=[p.etc, p.state, p.agent_state])
    user = services.service_user(ctx)
    if user is not None:
        chown_tree(p.mirror_store, user)


#: Seconds a replica on a profile this run changed must stay ready and not draining before init
#: takes it for serving: the leader's pass after an admin write starts within its MIN_GAP_S (1 s) and
#: marks an outdated replica draining (llmgw.control.reconcile.leader); its periodic pass is every
#: 2 s (DEFAULT_INTERVAL_S).
REPLACED_SETTLE_S = 5.0


def wait_serving(ctx: InitContext, name: str) -> None:
    """Wait for a ready replica of ``name``; believe placement's "nowhere" after the grace.

    Raises:
        EngineError: a replica failed to start, or placement found nowhere for it for longer
            than ``--unplaced-grace``. WaitTimeout: no replica was ready within ``--serve-wait``.
    """
    client = ctx.admin(PROBE_TIMEOUT_S)
    unplaced: float | None = None
    retried: set[str] = set()
    seen_ready: dict[str, float] = {}  # a replica on a changed profile: when it was first seen ready
    first = True  # "kept" only when it was serving before this run looked

    def restart_old_failure(r: ReplicaView) -> bool:
        """Restart ``r`` once when it failed before this run changed anything (a new
        --llama-server, the agent restarted): that failure says nothing about now."""
        if r.state != "failed" or (r.created_at or 0.0) >= ctx.started_at or r.id in retried:
            return False
        retried.add(r.id)
        try:
            fresh = client.restart_replica(r.id)
        except LlmgwError as e:
            ctx.note(f"restarting replica {r.id}, which failed before this run: {e}")
            return True
        retried.add(fresh.id)
        ctx.progress(f"{name}: replica {r.id} had failed before this run; restarted it as {fresh.id}")
        return True

    def serving() -> bool:
        nonlocal unplaced, first
        was_first, first = first, False
        try:
            reps = client.replicas(name)
        except LlmgwError as e:
            ctx.note(f"the control plane does not answer: {e}")
            return False
        # Nowhere to put it is not waited out for ten minutes: once placement has said why
        # for the grace, that is the answer. (The replicas view lists a wanted but unplaced
        # replica as pending on no node.)
        reps = [r for r in reps if r.node]
        if not reps:
            try:
                ex = client.explain(name)
            except LlmgwError as e:
                ctx.note(f"the control plane does not answer: {e}")
                return False
            ctx.note(f"{name}: no replica placed yet ({ex.summary or 'placement has not run'})")
            if not ex.placed and ex.rejections:
                now = ctx.clock.now()
                unplaced = unplaced if unplaced is not None else now
                ctx.progress(f"{name}: {ex.summary}")
                if now - unplaced > ctx.opts.unplaced_grace_s:
                    why = "; ".join(f"{r.node}: {r.reason}" for r in ex.rejections)
                    raise EngineError(
                        f"{name} has nowhere to run ({why}); add a node with room, or free some "
                        f"('llmgw ctl explain-placement {name}')"
                    )
            return False
        unplaced = None
        old = ctx.replaced.get(name, set())
        for r in reps:
            # What the gateway routes to (ready, not draining). A replica on a profile this run changed
            # counts once it has stayed so for REPLACED_SETTLE_S: until the leader drained it, the old
            # one was taken for "serving" and the first request after init met only its replacement
            # starting (503 model_unavailable, tests/e2e/test_init.py at load ~12); one the change
            # does not replace (its own profile's spec unchanged) serves after that wait.
            if r.state != "ready" or r.draining_since is not None:
                continue
            if r.id in old and ctx.clock.now() - seen_ready.setdefault(r.id, ctx.clock.now()) < REPLACED_SETTLE_S:
                ctx.note(f"{name}: replica {r.id} is ready; waiting to see whether the profile change replaces it")
                continue
            ctx.say("kept" if was_first else "done", f"{name} is serving (profile {r.profile})")
            return True
        if any(restart_old_failure(r) for r in reps):
            return False
        for r in reps:
            err = r.err.strip()
            if r.state == "failed":
                # A model that does not load will not load on the next try either: say why
                # now rather than wait out the deadline.
                raise EngineError(
                    f"{name} failed to start on node {r.node or '?'}: {err or 'no reason given'}\n"
                    f"fix the cause and run init again; 'llmgw ctl replicas {name}' shows its state"
                )
            headline = err.splitlines()[0] if err else ""
            ctx.progress(f"{name} {r.state}" + (f": {headline}" if headline else ""))
        return False

    ctx.wait(ctx.opts.serve_wait_s, f"{name} to start", serving, interval_s=ctx.opts.poll_s)
