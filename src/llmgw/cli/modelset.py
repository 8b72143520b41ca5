"""``llmgw ctl model set NAME KEY=VALUE…``: change any field of a model from the command line.

The fields without a command of their own (``routing``, ``queue.size``, ``queue.wait_s``,
``max_output``, ``context_length``, ``scaling.target`` and the other autoscaling settings,
``aliases``...) become a JSON merge patch (:func:`llmgw.modelpatch.merge_patch`) sent as
``PATCH /api/v1/models/NAME``, validated as any model write. Before, a CLI user had to write the
curl call with the admin token (a new user's finding). What restarts replicas is what a PATCH
restarts: a change of the profiles or the source; routing, queue and scaling settings restart none.

Exit codes as ``llmgw ctl``: 0 set, 1 an API error (the 400 names the field), 2 an assignment that
is not ``KEY=VALUE``, 3 the control plane does not answer.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from llmgw.cli.common import admin_client, print_json
from llmgw.cli.keys import JsonOpt, ServerOpt, TokenOpt
from llmgw.modelpatch import AssignmentError, assignments_text, merge_patch


def model_set(
    name: Annotated[str, typer.Argument(help="The model (name or alias).")],
    assignments: Annotated[
        list[str],
        typer.Argument(help="KEY=VALUE, KEY dotted as in model.yaml: scaling.target=2 routing=round-robin."),
    ],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Change model fields as in model.yaml: scaling.target=2, queue.size=0, queue.wait_s=10,
    routing=round-robin, max_output=512 (values are YAML: a list is written in brackets); null puts a
    field back to its default."""
    try:
        patch = merge_patch(assignments)
    except AssignmentError as e:
        print(f"Error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    data = admin_client(server, token).patch_model(name, patch)
    if as_json:
        print_json(data)
        return
    called = data.name if data.name == name else f"{data.name} (alias {name})"
    print(f"{called}: set {', '.join(assignments_text(patch))}")
