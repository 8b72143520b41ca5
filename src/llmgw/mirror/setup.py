"""Setting a mirror up from the command line: ``llmgw mirror init`` and ``llmgw mirror add``.

- :func:`init_mirror` — a mirror on its own machine: the store
  directory, the unit (:func:`~llmgw.service.units.mirror_unit`: bytes on ``:8081`` for every
  node, the management API on ``:8082`` answering loopback and each ``--control-plane`` address
  only), started by whichever manager runs services here (systemd, else llmgw's supervisor), a
  wait until the API answers on loopback, and the line to run on the control plane.
- :func:`add_file` — a file carried in by hand (an offline cluster), put into the store through the
  same verified path a ``file:`` source takes (copy to a hidden partial name while hashing, fsync,
  rename, manifest ``present`` with the sha256). Two ways, chosen by whether the mirror answers:

  1. the running mirror's management API answers (``--api``, default server.yaml's ``mirror.api``,
     else ``http://127.0.0.1:8082``: :func:`~llmgw.mirror.client.local_api`):
     ``POST /api/v1/fetch`` with ``file:/abs/path``; the mirror copies the file itself, so it
     knows the file at once, and the progress is polled and printed. The file must be inside one
     of the mirror's ``--import-dir`` directories and readable by the mirror's user (its unit has
     ``ProtectHome=true``: /home and /root are not visible to it).
  2. nothing answers there, or the mirror refuses the file (``source_refused``: not in an import
     directory) and this user may write the store: the file is copied straight into the store
     directory (``--dir``) by this process, with this user's rights and no fetches resumed. Run
     by root into a store another user owns (the mirror's user, as ``server init`` leaves it),
     each directory and file it makes is given to the store directory's uid and gid before it
     gets its name (:func:`~llmgw.mirror.store.store_owner`), so the mirror can replace and
     delete it; a chown refused is an error naming the path and leaves nothing behind. A
     mirror started later finds it; one already running on that store picks it up the first time
     it is asked for it. The copy still refuses special files, hard links and llmgw's own
     configuration and state (``deny``). Only a running mirror knows the base URL it serves
     under, so the status this way has the mirror's ``url`` when the mirror answered (it refused
     the import), and an empty ``url`` when nothing did.

  Before either, and before anything is copied (:func:`check_carried`): the names are checked
  (a :class:`~llmgw.errors.ConfigError` naming ``--model`` or ``--version`` and the rule, not a
  pydantic traceback), a ``*.gguf`` must start with the GGUF magic, and the file is held to the
  mirror's public-only rule (:mod:`llmgw.mirror.policy`, step 4, with the file's directory as the
  import directory): readable by others, its directory searchable by others. The bytes port
  serves it to anyone, so a file only its owner (root, run with sudo) could read is refused
  rather than published; the direct copy's policy is ``public_only`` too, so the rule holds again
  when the file is opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import pwd
import secrets
import shutil
import time
from collections.abc import Sequence
from typing import TextIO

from llmgw.atomicfile import write_atomic
from llmgw.config import parse_listen
from llmgw.errors import ApiError, ConfigError, LlmgwError, MirrorError, ServiceError, SourceError, UnreachableError
from llmgw.ggufheader import is_gguf
from llmgw.mirror.client import MIRROR_TOKEN, MirrorClient, read_token
from llmgw.mirror.fetch import Fetcher
from llmgw.mirror.models import FetchRequest, FetchStatus, check_catalog_name
from llmgw.mirror.policy import SourcePolicy
from llmgw.mirror.server import parse_allow
from llmgw.mirror.store import Store, store_owner
from llmgw.paths import Paths
from llmgw.service.manager import ServiceManager
from llmgw.service.units import mirror_unit
from llmgw.service.users import MIRROR_USER, choose_service_user, chown_tree
from llmgw.sourcecheck import to_download

INIT_ABOUT = (
    "'llmgw mirror init'. Bytes on :8081 for every node; the\n"
    "# management API for the control planes named with --control-plane only."
)
"""The ``# Written by`` text of the unit :func:`init_mirror` writes."""


def api_token(path: pathlib.Path) -> str:
    """The management API's token in ``path``; made (a new 256-bit secret, mode 0600) when the file
    is missing, as a mirror started by hand has none.

    Raises:
        ConfigError: it cannot be read or made (``/etc`` is read-only inside the unit's sandbox:
            ``server init`` and ``mirror init`` make it before they start the mirror).
    """
    if not path.exists():
        try:
            write_atomic(path, secrets.token_urlsafe(32) + "\n", 0o600)
        except OSError as e:
            raise ConfigError(
                f"the mirror's management API token {path} does not exist and cannot be made ({e}); "
                "run 'llmgw server init' or 'llmgw mirror init', or give --api-token-file"
            ) from e
    return read_token(path)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def init_mirror(
    paths: Paths,
    manager: ServiceManager,
    *,
    control_planes: Sequence[str],
    address: str,
    llmgw_bin: str,
    listen: str = ":8081",
    api_listen: str = ":8082",
    import_dirs: Sequence[str] = (),
    allow_source_nets: Sequence[str] = (),
    wait_s: float = 30.0,
    out: TextIO,
) -> str:
    """Make this machine a mirror for the control planes at ``control_planes``; returns the
    management API URL to give ``llmgw server init --mirror``.

    Args:
        paths: where the store (``paths.mirror_store``) and the unit go.
        manager: starts the service (``pick_manager(paths)``).
        control_planes: addresses (or CIDR networks) the management API answers besides loopback.
        address: this machine's address as the nodes and control planes reach it.
        llmgw_bin: the ``ExecStart`` program (``llmgw_binary()``).
        listen, api_listen: the bytes server and the management API (``HOST:PORT`` or ``:PORT``).
        import_dirs: absolute directories ``file:`` sources may come from (``--import-dir``).
        allow_source_nets: private addresses or networks ``http(s):`` sources may reach.
        wait_s: how long to wait for the management API to answer on loopback.
        out: where the step lines and the closing advice are printed.

    Raises:
        ConfigError: no control plane, a malformed address, no ``address``, or an import
            directory or source network the mirror would refuse (checked before anything is written).
        ServiceError: the service did not start or did not answer within ``wait_s`` (with its log).
    """
    if not control_planes:
        raise ConfigError("name the control plane: llmgw mirror init --control-plane <its address>")
    parse_allow(control_planes)
    for d in SourcePolicy.build(import_dirs=import_dirs, allow_nets=allow_source_nets).missing_dirs():
        raise ConfigError(f"--import-dir {d} is not a directory; create it (and put the files there) first")
    if not address:
        raise ConfigError("this machine has no non-loopback address; give --address <the address nodes reach>")
    _h, port = parse_listen(listen)
    api_host, api_port = parse_listen(api_listen)
    base = f"http://{_url_host(address)}:{port}"
    api_url = f"http://{_url_host(address)}:{api_port}"
    store = paths.mirror_store
    store.mkdir(parents=True, exist_ok=True)
    print(f"  done store in {store}", file=out, flush=True)
    token_file = paths.etc / MIRROR_TOKEN
    made = not token_file.exists()
    api_token(token_file)
    print(f"  {'done' if made else 'kept'} management API token {token_file}", file=out, flush=True)
    # The mirror runs as the llmgw user (under systemd, and under the supervisor when root).
    who = choose_service_user([store.parent, token_file.parent], systemd=manager.kind == "systemd")
    if who.user is not None:
        chown_tree(store, who.user)
        os.chown(token_file, *_ids(who.user))
        print(f"  done system user {MIRROR_USER}, owner of {store}", file=out, flush=True)
    else:
        print(f"  !! the mirror runs as this user, not as {MIRROR_USER}: {who.why}", file=out, flush=True)
    body = mirror_unit(
        paths, llmgw_bin, listen=listen, api_listen=api_listen, base=base, allow=list(control_planes),
        about=INIT_ABOUT, import_dirs=import_dirs, allow_source_nets=allow_source_nets, user=who.user,
        api_token_file=str(token_file),
    )
    was_running = manager.status("mirror").state == "running"
    changed = manager.install("mirror", body)
    if not was_running:
        manager.start("mirror")
        print(f"  done mirror started ({manager.kind}): bytes at {base}", file=out, flush=True)
    elif changed:
        manager.restart("mirror")
        print(f"  done mirror restarted: its unit changed ({manager.kind})", file=out, flush=True)
    else:
        print(f"  kept mirror ({manager.kind}, running)", file=out, flush=True)
    local = f"http://{'127.0.0.1' if api_host in ('0.0.0.0', '::', '') else _url_host(api_host)}:{api_port}"
    _wait_healthy(manager, local, wait_s)
    print(f"  done management API answers {', '.join(control_planes)} and loopback", file=out, flush=True)
    print(f"\nOn each control plane, copy {token_file} to its /etc/llmgw/{MIRROR_TOKEN} (mode 0600: only "
          f"root and the llmgw user may read it), then run:\n  sudo llmgw server init --mirror {api_url}",
          file=out, flush=True)
    return api_url


def _ids(user: str) -> tuple[int, int]:
    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid


def _wait_healthy(manager: ServiceManager, url: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    with MirrorClient(url, timeout=2.0) as client:
        while True:
            try:
                client.health()
            except LlmgwError as e:
                st = manager.status("mirror")
                if st.state == "failed" or time.monotonic() > deadline:
                    raise ServiceError(
                        f"the mirror did not answer at {url} ({e}); state {st.state} {st.detail}\n"
                        f"{manager.logs('mirror', 20)}\nsee 'llmgw service logs mirror'"
                    ) from e
                time.sleep(0.2)
            else:
                return


def add_file(
    file: pathlib.Path,
    model: str,
    version: str,
    *,
    api_url: str,
    store_dir: pathlib.Path,
    out: TextIO,
    deny: Sequence[pathlib.Path] = (),
    poll_s: float = 0.5,
    token: str | None = None,
) -> FetchStatus:
    """Put ``file`` into the mirror as ``model/version`` (see the module docstring for the two ways).

    Returns:
        The ``present`` status (its ``sha256`` is the file's).

    Args:
        deny: directories no file may be copied from (llmgw's configuration and state).
        token: the management API's token (:func:`~llmgw.mirror.client.read_token`).

    Raises:
        ConfigError: ``model`` or ``version`` is not a valid name (checked before anything is copied).
        SourceError: a ``*.gguf`` file without the GGUF magic. SourceRefused (a SourceError): the
            file is not readable by others or its directory not searchable by others (the mirror
            would publish what they cannot read), or a special file, a hard link, inside ``deny``.
        MirrorError: the file is missing or unreadable, the copy failed (disk full), the mirror
            refused the file and this user cannot write the store, root could not give the copy
            to the store's owner (nothing is left behind), or ``model/version`` already holds
            another source.
    """
    path = file.expanduser().resolve()
    if not path.is_file():
        raise MirrorError(f"{file} is not a file")
    req = fetch_request(f"file:{path}", model, version, flags=("--model", "--version"))
    policy = check_carried(path, req.source, deny=deny)
    client = MirrorClient(api_url, timeout=5.0, token=token)
    try:
        try:
            client.health()
        except UnreachableError:
            print(f"  .. the mirror at {api_url} does not answer: copying into {store_dir} directly"
                  f"{_given_to(store_dir)}", file=out, flush=True)
            return asyncio.run(_add_direct(req, store_dir, policy))
        print(f"  .. asking the mirror at {api_url} to copy {path}", file=out, flush=True)
        try:
            st = client.fetch(req.source, model, version)
        except ApiError as e:
            if e.code != "source_refused":
                raise MirrorError(str(e)) from e
            if not (store_dir.is_dir() and os.access(store_dir, os.W_OK | os.X_OK)):
                raise MirrorError(
                    f"{e}; or run 'llmgw mirror add' as a user who may write {store_dir} (sudo), "
                    "which copies the file there directly"
                ) from e
            print(f"  .. the mirror does not import from {path.parent}: copying into {store_dir} "
                  f"directly, as this user{_given_to(store_dir)}", file=out, flush=True)
            copied = asyncio.run(_add_direct(req, store_dir, policy))
            try:
                return client.status(model, version)  # the running mirror's view: its URL
            except (ApiError, UnreachableError):
                return copied  # it serves another store, or went away: no URL to give
        last = ""
        while st.state == "fetching":
            if (line := st.progress_text()) != last:
                print(f"  .. {line}", file=out, flush=True)
                last = line
            time.sleep(poll_s)
            st = client.status(model, version)
    finally:
        client.close()
    if st.state == "failed":
        raise MirrorError(f"the mirror could not add {path} as {model}/{version}: {st.err}")
    return st


def fetch_request(
    source: str, model: str, version: str, *, flags: tuple[str, str] = ("model", "version")
) -> FetchRequest:
    """The fetch of ``source`` as ``model/version``, its names checked first.

    Args:
        flags: what the message calls the model and the version (``--model``, ``--version``).

    Raises:
        ConfigError: a name breaks the rule (:func:`~llmgw.mirror.models.check_catalog_name`); the
            message names the flag, the value and the rule.
    """
    try:
        check_catalog_name(model, flags[0])
        check_catalog_name(version, flags[1])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return FetchRequest(source=source, model=model, version=version)


def check_carried(path: pathlib.Path, source: str, *, deny: Sequence[pathlib.Path] = ()) -> SourcePolicy:
    """Check a file carried in by hand (``mirror add``) before anything is copied; returns the
    policy the direct copy opens it with (the file's directory its one import directory,
    ``public_only``).

    Args:
        path: the file's real path.
        source: ``file:<path>``, for the messages.
        deny: directories no file may be copied from.

    Raises:
        SourceRefused: not readable by others, its directory not searchable by others, a special
            file, a hard link, or inside ``deny`` (the message says what to do).
        SourceError: the name ends in ``.gguf`` but the file does not start with the GGUF magic.
        MirrorError: it cannot be opened or read.
    """
    policy = SourcePolicy.build(import_dirs=[path.parent], deny=deny, public_only=True)
    try:
        os.close(policy.open_file(path, source))
        if path.name.lower().endswith(".gguf") and not is_gguf(path):
            raise SourceError(
                f"{path} is not a GGUF file (it does not start with the bytes 'GGUF') although its "
                "name ends in .gguf; give the model's .gguf file (a download cut short or an HTML "
                "error page saved under that name looks like this)"
            )
    except OSError as e:
        raise MirrorError(f"cannot read {path}: {e.strerror or e}") from e
    return policy


def copy_file(
    source: str, model: str, version: str, *, store_dir: pathlib.Path, deny: Sequence[pathlib.Path] = ()
) -> FetchStatus:
    """Copy the file of a ``file:`` ``source`` into the store at ``store_dir`` as ``model/version``,
    with this process's rights (given to the store's owner when root copies into another user's
    store, as :func:`add_file` does), through the same verified path the mirror's fetches take; the
    manifest keeps ``source``, so a mirror asked for it later finds it present. What ``server
    init`` does with its ``file:`` starter and judge instead of giving the mirror their directory.

    Unlike :func:`add_file` it does not hold the file to the public-only rule: ``server init``
    copies the one file its operator named on its command line (docs/operating.md says so).

    Raises:
        ConfigError: ``model`` or ``version`` is not a valid name.
        MirrorError: the file cannot be copied (missing, unreadable, a special file, a hard link,
            inside ``deny``), or given to the store's owner, or ``model/version`` holds another source.
    """
    req = fetch_request(source, model, version)
    path = to_download(source).path
    if path is None:
        raise MirrorError(f"{source} is not a file: source")
    real = pathlib.Path(os.path.realpath(path))
    if not real.is_file():
        raise MirrorError(f"{source}: {real} is not a file")
    return asyncio.run(_add_direct(req, store_dir, SourcePolicy.build(import_dirs=[real.parent], deny=deny)))


async def _add_direct(req: FetchRequest, store_dir: pathlib.Path, policy: SourcePolicy) -> FetchStatus:
    """Copy ``req.source`` into the store at ``store_dir`` with this process's rights; the
    ``present`` status, with an empty ``url``.

    Run by root in a store another user owns (the mirror's user, as ``server init`` leaves it:
    :func:`~llmgw.mirror.store.store_owner`), every directory and file it makes is given to the
    store directory's uid and gid before it gets its name, so the mirror can delete it later;
    then a failure takes back the directories this call made, leaving nothing half-added.

    Raises:
        MirrorError: the copy failed (its error), or, given to the store's owner, what is made
            there cannot be made or given (names the path and what to do).
        SourceConflict: ``model/version`` holds another source.
        OSError: not given to an owner, the store cannot be written.
    """
    store = Store(store_dir, owner=store_owner(store_dir))
    vdir = store.version_dir(req.model, req.version)
    made = [d for d in (vdir, vdir.parent) if not d.exists()]
    try:
        st = await _copy_into(store, req, policy)
    except (MirrorError, OSError) as e:
        if store.owner is None:  # this user's files: as before, what failed stays (a failed manifest)
            raise
        _take_back(vdir, made)
        if isinstance(e, OSError):
            raise MirrorError(
                f"cannot make {e.filename or vdir} and give it to {_who(store.owner)}, who owns {store.root}: "
                f"{e.strerror or e}; nothing was added. Where root may not chown (NFS with root_squash), put "
                "the file where that user may read it and run 'llmgw mirror add' as that user (sudo -u)"
            ) from e
        raise
    return st.model_copy(update={"url": ""})  # base "": a bare path, which no node could fetch


async def _copy_into(store: Store, req: FetchRequest, policy: SourcePolicy) -> FetchStatus:
    """The fetch of ``req`` into ``store``, to its end; the ``present`` status.

    Raises:
        MirrorError: it ended ``failed`` (its error), or another source holds ``model/version``.
        OSError: a manifest or directory cannot be written.
    """
    fetcher = Fetcher(store, base="", policy=policy)
    await fetcher.start(resume=False)
    try:
        await fetcher.fetch(req)
        st = await fetcher.wait(req.model, req.version)
    finally:
        await fetcher.close()
    assert st is not None  # noqa: S101 - fetch just created it
    if st.state != "present":
        raise MirrorError(f"cannot add {req.source} as {req.model}/{req.version}: {st.err}")
    return st


def _take_back(vdir: pathlib.Path, made: Sequence[pathlib.Path]) -> None:
    """Remove what a failed direct add made: the version directory ``vdir`` (with what is in it)
    and its model directory, each only when in ``made``; best effort."""
    if vdir in made:
        shutil.rmtree(vdir, ignore_errors=True)
    if vdir.parent in made:
        with contextlib.suppress(OSError):
            vdir.parent.rmdir()  # only when empty: another version may have come meanwhile


def _given_to(store_dir: pathlib.Path) -> str:
    """What the direct copy's line adds when the copy is given to the store's owner; else ''."""
    owner = store_owner(store_dir)
    return "" if owner is None else f", then given to {_who(owner)}, who owns the store"


def _who(owner: tuple[int, int]) -> str:
    """``user (uid N, gid M)``, or the ids alone when the uid has no name here."""
    try:
        name = pwd.getpwuid(owner[0]).pw_name
    except KeyError:
        return f"uid {owner[0]} gid {owner[1]}"
    return f"{name} (uid {owner[0]}, gid {owner[1]})"
