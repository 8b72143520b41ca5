"""`llmgw mirror` commands: serve, init (a mirror on its own machine), add (carry a file in), rm, ls."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw.cli.common import cli_errors, paths, typer_app

if TYPE_CHECKING:
    from llmgw.paths import Paths

app = typer_app(
    no_args_is_help=True, help="The model mirror: download weights once, serve them to every node."
)

#: The mirror's store, which ``mirror serve`` serves and ``mirror add`` copies into when the mirror
#: does not answer.
StoreDirOpt = Annotated[
    Path | None,
    typer.Option("--dir", help="The store: <model>/<version>/<file> plus manifests. Default /srv/models "
                 "(under --root or LLMGW_ROOT when set)."),
]
#: The flags ``mirror serve`` takes and ``mirror init`` writes into the unit's ``mirror serve`` line.
ListenOpt = Annotated[str, typer.Option("--listen", help="Bytes server, for every node (HOST:PORT or :PORT).")]
ImportDirOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--import-dir",
        help="A directory file: sources may come from (regular files only); repeatable. None: no file: source.",
    ),
]
AllowSourceNetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-source-net", help="A private address or network (CIDR) http(s) sources may reach; repeatable."
    ),
]


@app.command("serve")
@cli_errors
def serve(
    base: Annotated[
        str,
        typer.Option(
            "--base",
            help="The URL nodes reach the bytes server at (http://ADDR:8081); status URLs start with it.",
        ),
    ],
    directory: StoreDirOpt = None,
    listen: ListenOpt = ":8081",
    api_listen: Annotated[
        str,
        typer.Option("--api-listen", help="Management API (HOST:PORT); answers loopback and --api-allow."),
    ] = "127.0.0.1:8082",
    api_allow: Annotated[
        list[str] | None,
        typer.Option(
            "--api-allow", help="An address or network (CIDR) the management API also answers; repeatable."
        ),
    ] = None,
    import_dir: ImportDirOpt = None,
    allow_source_net: AllowSourceNetOpt = None,
    allow_private_sources: Annotated[
        bool,
        typer.Option(
            "--allow-private-sources",
            help="Let http(s) sources reach any address, this machine's and private ones included.",
        ),
    ] = False,
    api_token_file: Annotated[
        Path | None,
        typer.Option(
            "--api-token-file",
            help="The management API's token (0600). Default /etc/llmgw/mirror-token if it exists, "
            "else /etc/llmgw/admin-token; made (0600) when missing.",
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option("--check", help="Read the options and files as serving would, say what is wrong, serve nothing."),
    ] = False,
) -> None:
    """Serve the mirror until SIGTERM or Ctrl-C; fetches left running resume at the next start."""
    from llmgw.errors import ConfigError
    from llmgw.mirror import server, setup
    from llmgw.mirror.client import MIRROR_TOKEN, read_token, token_path
    from llmgw.mirror.policy import SourcePolicy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = paths()
    root = directory if directory is not None else p.mirror_store
    policy = SourcePolicy.build(
        import_dirs=import_dir or [], deny=[p.etc, p.state, p.agent_state],
        allow_nets=allow_source_net or [], allow_private=allow_private_sources, public_only=True,
    )
    token_file = api_token_file or token_path(p)
    if api_token_file is None and not token_file.exists():
        token_file = p.etc / MIRROR_TOKEN  # a mirror started by hand, on a machine without llmgw's files
    if check:  # what 'service restart mirror' runs first: a typo'd path took the mirror down (found checking)
        if api_token_file is not None and not api_token_file.exists():
            raise ConfigError(f"--api-token-file {api_token_file} does not exist; fix the path in the unit")
        if token_file.exists():
            read_token(token_file)
        return
    token = setup.api_token(token_file)
    print(f"management API token in {token_file} (every route but /api/v1/health needs it)")
    print(f"mirror of {root}: bytes on {listen}, management API on {api_listen}, served as {base}")
    dirs = ", ".join(map(str, policy.import_dirs)) or "none (file: sources are refused)"
    print(f"imports file: sources from {dirs}")
    for d in policy.missing_dirs():
        print(f"!! --import-dir {d} is not a directory here (missing, or hidden from this service by "
              "ProtectHome=); its file: sources fail until it is")
    server.run(
        root=root, listen=listen, api_listen=api_listen, base=base, api_allow=api_allow or [], policy=policy,
        api_token=token,
    )


API_OPTION = typer.Option(
    "--api", help="The mirror's management API (default: server.yaml's mirror.api, else http://127.0.0.1:8082)."
)


@app.command("init")
@cli_errors
def init(
    control_plane: Annotated[
        list[str],
        typer.Option(
            "--control-plane",
            help="A control plane's address (or CIDR network) the management API answers; repeatable.",
        ),
    ],
    address: Annotated[
        str | None,
        typer.Option(
            "--address", help="This machine's address as nodes reach it. Default: the first non-loopback IPv4."
        ),
    ] = None,
    listen: ListenOpt = ":8081",
    api_listen: Annotated[str, typer.Option("--api-listen", help="Management API.")] = ":8082",
    import_dir: ImportDirOpt = None,
    allow_source_net: AllowSourceNetOpt = None,
) -> None:
    """Make this machine a model mirror for the control plane at --control-plane.

    Writes the unit, creates the store, starts the mirror (systemd, else llmgw's supervisor), waits
    until it answers, and prints the line to run on the control plane.
    """
    from llmgw.mirror import setup
    from llmgw.serverinit.steps.pki import primary_address
    from llmgw.service.manager import pick_manager
    from llmgw.service.units import installed_binary, llmgw_binary

    p = paths()
    setup.init_mirror(
        p,
        pick_manager(p),
        control_planes=control_plane,
        address=address or primary_address(),
        llmgw_bin=installed_binary(p, llmgw_binary()),
        listen=listen,
        api_listen=api_listen,
        import_dirs=[str(d.resolve()) for d in import_dir or []],
        allow_source_nets=allow_source_net or [],
        out=sys.stdout,
    )


@app.command("add")
@cli_errors
def add(
    file: Annotated[Path, typer.Argument(help="The weights file, on this machine.")],
    model: Annotated[str, typer.Option("--model", help="The model's name in the mirror.")],
    version: Annotated[str, typer.Option("--version", help="The version it is stored as.")],
    api: Annotated[str | None, API_OPTION] = None,
    directory: StoreDirOpt = None,
) -> None:
    """Carry a file into the mirror (offline clusters): copied, hashed, served as MODEL/VERSION.

    Through the running mirror when its API answers; otherwise straight into the store (--dir).
    """
    from llmgw.mirror import setup
    from llmgw.mirror.client import local_api, local_token

    p = paths()
    root = directory if directory is not None else p.mirror_store
    st = setup.add_file(
        file, model, version, api_url=api or local_api(p), store_dir=root, out=sys.stdout,
        deny=[p.etc, p.state, p.agent_state], token=local_token(p),
    )
    print(f"  done {st.model}/{st.version}: {st.file}, {st.bytes_total} bytes, sha256 {st.sha256}")
    where = st.url or (f"/{st.model}/{st.version}/{st.file} on the mirror's bytes server ('llmgw mirror ls' "
                       "gives the whole URL once the mirror runs)")
    print(f"nodes fetch it from {where}")


@app.command("rm")
@cli_errors
def rm(
    model: Annotated[str, typer.Argument(help="The model.")],
    version: Annotated[str, typer.Argument(help="The version.")],
    api: Annotated[str | None, API_OPTION] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Delete even when a catalog model uses it, or when the control plane cannot be asked.",
        ),
    ] = False,
) -> None:
    """Cancel a download if it runs and delete MODEL/VERSION from the mirror.

    First asks this machine's control plane (server.yaml's admin API and token) which catalog
    models' source points at it, and refuses while any does, or when it cannot ask, unless --force.
    """
    from llmgw.errors import MirrorError
    from llmgw.mirror.client import MirrorClient, local_api, local_token
    from llmgw.mirror.usage import models_using

    p = paths()
    with MirrorClient(api or local_api(p), token=local_token(p)) as client:
        if not force:
            catalog, why = _catalog(p)
            if catalog is None:
                raise MirrorError(
                    f"could not check whether a catalog model uses {model}/{version}: {why}; run "
                    "'llmgw mirror rm' where the control plane's admin API answers (its server.yaml and "
                    "admin token), or give --force to delete it without checking"
                )
            if users := models_using(model, version, client.files(), catalog):
                raise MirrorError(
                    f"{model}/{version} is the weights of catalog model{'s' if len(users) > 1 else ''} "
                    f"{', '.join(users)} (their source points at it): a node starting a replica could no "
                    "longer fetch them. Remove those models first ('llmgw ctl model rm NAME "
                    "--delete-weights' deletes the weights once no model uses them), or give --force"
                )
        last = client.delete(model, version)
    print(f"deleted {model}/{version} ({last.file}, was {last.state})")


def _catalog(p: Paths) -> tuple[list[tuple[str, str]] | None, str]:
    """``(name, source)`` of every catalog model from this machine's control plane, or None and why not."""
    from llmgw.adminclient import ASK_TIMEOUT_S, AdminClient
    from llmgw.errors import LlmgwError

    try:
        models = AdminClient.from_paths(p, timeout_s=ASK_TIMEOUT_S).models()
        return [(m.name, m.source) for m in models], ""
    except LlmgwError as e:
        return None, str(e)


@app.command("ls")
@cli_errors
def ls(api: Annotated[str | None, API_OPTION] = None) -> None:
    """Every model/version in the mirror: state, file, sha256 (or progress, or the error), and the
    URL nodes fetch it from (a model's source)."""
    from llmgw.mirror.client import MirrorClient, local_api, local_token

    p = paths()
    with MirrorClient(api or local_api(p), token=local_token(p)) as client:
        rows = client.files()
    if not rows:
        print("the mirror holds nothing yet")
    for st in rows:
        detail = st.sha256[:16] if st.state == "present" else (st.progress_text() if st.state == "fetching" else st.err)
        print(f"{st.model}/{st.version}\t{st.state}\t{st.file}\t{detail}\t{st.url}")
