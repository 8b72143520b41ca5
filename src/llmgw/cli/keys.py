"""``llmgw ctl key …`` and ``llmgw ctl usage``: the gateway's API keys, their limits, and who used how much.

- ``key create NAME [--models M,…] [--rpm N] [--tpm N] [--budget-tokens N --budget-period day|month]
  [--expires 30d] [--priority 0-9]``: prints the secret once (the store keeps its SHA-256) and what
  was set, the expiry included. The key works on the control plane that answered at once.
- ``key set NAME [--models M,…] [--rpm N] [--tpm N] [--budget-tokens N] [--budget-period day|month]
  [--expires 30d] [--priority 0-9] [--clear rpm|tpm|budget|models|expires|priority …]``: change a key's limits
  (what is not named stays); the control plane that answers applies it before it answers, every
  other one within a second.
- ``key ls``: name, prefix, models, limits, priority, usage today / this month, last use, state and
  expiry.
- ``key revoke NAME``; ``key rotate NAME`` (prints the new secret once). A revoked key cannot be
  changed or rotated, and its name stays taken (its usage stays its own): a replacement needs a new name.
- ``usage [--key K] [--model M] [--since 7d] [--until …]``: requests, tokens, guard blocks and errors per
  key, model and UTC day, with a total; a ``--key`` that names no key is an error (exit 1).

Exit codes as ``llmgw ctl``: 0 fine, 1 an API error (a bad name or limit is a 400 that says what was
wrong), 3 the control plane does not answer.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmgw.cli.common import cli_errors, console, paths, table, typer_app, whole

if TYPE_CHECKING:
    from llmgw.adminclient import AdminClient
    from llmgw.views import KeyView, NewKeyView

app = typer_app(no_args_is_help=True, help="The gateway's API keys: create, list, change limits, revoke, rotate.")

ServerOpt = Annotated[str | None, typer.Option("--server", help="Admin API URL (default: this machine's).")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="LLMGW_TOKEN", help="Admin bearer token.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def _client(server: str | None, token: str | None) -> AdminClient:
    from llmgw.adminclient import AdminClient

    return AdminClient.from_paths(paths(), server=server, token=token)


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))


def _expiry(k: KeyView) -> str:
    """When the key expires, for a line about it: ``2026-05-01 12:00 UTC``, or ``never``."""
    return "never" if k.expires_at is None else f"{_when(k.expires_at)} UTC"


def _limits(k: KeyView) -> str:
    parts = [f"{k.rpm} rpm" if k.rpm else "", f"{k.tpm} tpm" if k.tpm else ""]
    if k.budget_tokens:
        parts.append(f"{k.budget_tokens}/{k.budget_period}")
    return ", ".join(p for p in parts if p) or "-"


def _print_secret(made: NewKeyView, as_json: bool, what: str) -> None:
    if as_json:
        print(json.dumps(made.model_dump(mode="json"), indent=2, sort_keys=True))
        return
    models = ", ".join(made.key.models) or "all"
    console().print(f"{what} key '{made.key.name}' ({_limits(made.key)}; models: {models}; "
                    f"priority: {made.key.priority}; expires: {_expiry(made.key)})")
    print(made.secret)
    console().print("This secret is not shown again: give it to its user now (Authorization: Bearer <secret>).")
    # A guard policy names a key by its id (this secret's) or, lasting across rotations, by key_names.
    from llmgw.guard.config import key_id

    # quoted: a name like 12345678 or 'on' is read as a number or a boolean in YAML (found checking this)
    print(f"Its id for a guard policy's keys: {key_id(made.secret)} (key_names: [{json.dumps(made.key.name)}] "
          "names it whatever its secret: a rotation changes the id)")  # print: Rich took [...] as markup


#: The limits ``key create`` sets and ``key set`` changes, one option each.
ModelsOpt = Annotated[str | None, typer.Option("--models", help="Comma-separated models or aliases.")]


def _model_list(models: str) -> list[str]:
    """``--models a,b`` as a list. BadParameter when it names none (``--models ''``, an empty
    variable in a script): an empty list would mean every model, the opposite of a restriction."""
    names = [m.strip() for m in models.split(",") if m.strip()]
    if not names:
        raise typer.BadParameter(
            f"{models!r} names no model: give model names or aliases, comma-separated; for every model "
            "leave --models out (key set: --clear models)", param_hint="--models",
        )
    return names
RpmOpt = Annotated[int | None, typer.Option("--rpm", parser=whole, help="Requests per minute.")]
TpmOpt = Annotated[int | None, typer.Option("--tpm", parser=whole, help="Tokens (prompt + completion) per minute.")]
BudgetTokensOpt = Annotated[int | None, typer.Option("--budget-tokens", parser=whole, help="Tokens per budget period.")]
BudgetPeriodOpt = Annotated[str | None, typer.Option("--budget-period", help="day or month (UTC).")]
ExpiresOpt = Annotated[
    str | None, typer.Option("--expires", help="A duration from now: 90s, 30m (minutes), 12h, 30d, 2w (no months).")
]
PriorityOpt = Annotated[
    int | None,
    typer.Option("--priority", help="0-9 (default 0): when a model is busy, higher is served first."),
]


@app.command("create")
@cli_errors
def create(
    name: Annotated[str, typer.Argument(help="The key's name (shown in usage, metrics and the access log).")],
    models: ModelsOpt = None,
    rpm: RpmOpt = None,
    tpm: TpmOpt = None,
    budget_tokens: BudgetTokensOpt = None,
    budget_period: BudgetPeriodOpt = None,
    expires: ExpiresOpt = None,
    priority: PriorityOpt = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Make a key; its secret is printed once."""
    if (budget_tokens is None) != (budget_period is None):  # the API's message names its fields, not these flags
        raise typer.BadParameter("--budget-tokens and --budget-period go together (e.g. --budget-tokens 100000 "
                                 "--budget-period month)")
    spec: dict[str, Any] = {"name": name}
    if models is not None:
        spec["models"] = _model_list(models)
    for field, value in (("rpm", rpm), ("tpm", tpm), ("budget_tokens", budget_tokens),
                         ("budget_period", budget_period), ("expires", expires), ("priority", priority)):
        if value is not None:
            spec[field] = value
    client = _client(server, token)
    _print_secret(client.create_key(spec), as_json, "made")
    _warn_unknown_models(client, spec.get("models", []))


def _warn_unknown_models(client: AdminClient, names: list[str]) -> None:
    """Say on stderr which of a key's ``names`` the catalog has neither as a model nor as an alias
    (the key is kept: the model may be added later; a typo shows here rather than as a 404 to its user)."""
    if not names:
        return
    catalog = client.models()
    known = {m.name for m in catalog} | {a for m in catalog for a in m.aliases}
    for name in names:
        if name not in known:
            print(f"!! no model or alias '{name}' in the catalog yet: this key cannot use it until one is added "
                  "(see 'llmgw ctl models')", file=sys.stderr)


#: ``key set --clear`` names → the PATCH fields they null.
_CLEARS = {"rpm": ("rpm",), "tpm": ("tpm",), "budget": ("budget_tokens", "budget_period"), "models": ("models",),
           "expires": ("expires",), "priority": ("priority",)}  # priority: null is back to 0 (KeyPatch)


@app.command("set")
@cli_errors
def set_limits(
    name: Annotated[str, typer.Argument(help="The key to change.")],
    models: ModelsOpt = None,
    rpm: RpmOpt = None,
    tpm: TpmOpt = None,
    budget_tokens: BudgetTokensOpt = None,
    budget_period: BudgetPeriodOpt = None,
    expires: ExpiresOpt = None,
    priority: PriorityOpt = None,
    clear: Annotated[
        list[str] | None,
        typer.Option("--clear", help="Remove a limit: rpm, tpm, budget, models (every model) or expires; "
                     "priority back to 0; repeat."),
    ] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a key's limits; what is not named stays as it is. The secret does not change."""
    patch: dict[str, Any] = {}
    for what in clear or ():
        if what not in _CLEARS:
            raise typer.BadParameter(f"--clear {what!r}: give one of {', '.join(_CLEARS)}", param_hint="--clear")
        patch.update(dict.fromkeys(_CLEARS[what]))
    if models is not None:
        patch["models"] = _model_list(models)
    for field, value in (("rpm", rpm), ("tpm", tpm), ("budget_tokens", budget_tokens),
                         ("budget_period", budget_period), ("expires", expires), ("priority", priority)):
        if value is not None:
            if field in patch:
                raise typer.BadParameter(f"--{field.replace('_', '-')} and --clear of it together: give one")
            patch[field] = value
    if not patch:
        raise typer.BadParameter(
            "nothing to change: give --rpm, --tpm, --budget-tokens/--budget-period, --models, --expires, "
            "--priority or --clear"
        )
    client = _client(server, token)
    k = client.set_key(name, patch)
    if as_json:
        print(json.dumps(k.model_dump(mode="json"), indent=2, sort_keys=True))
    else:
        console().print(f"key '{k.name}': {_limits(k)}; models: {', '.join(k.models) or 'all'}; "
                        f"priority: {k.priority}; expires: {_expiry(k)}")
    _warn_unknown_models(client, patch.get("models") or [])


@app.command("ls")
@cli_errors
def ls(server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Every key: prefix, models, limits, usage today and this month, last use, state."""
    keys = _client(server, token).keys()
    if as_json:
        print(json.dumps([k.model_dump(mode="json") for k in keys], indent=2, sort_keys=True))
        return
    t = table("NAME", "PREFIX", "ID", "MODELS", "LIMITS", "PRIORITY", "TODAY (req/tok)", "MONTH (tok)",
              "LAST USED", "STATE", "EXPIRES")
    for k in keys:
        t.add_row(k.name, k.prefix + "…", k.id, ", ".join(k.models) or "all", _limits(k), str(k.priority),
                  f"{k.requests_today}/{k.tokens_today}", str(k.tokens_this_month), _when(k.last_used_at),
                  k.state, _when(k.expires_at))
    console().print(t if keys else "no keys yet: 'llmgw ctl key create NAME'")


@app.command("revoke")
@cli_errors
def revoke(name: str, server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Revoke a key: refused by this control plane at once, by every other within a second. It stays
    revoked, and its name taken. A key revoked already is left as it was, and said so."""
    client = _client(server, token)
    k = client.key(name)
    already = k.revoked_at is not None
    if not already:
        k = client.revoke_key(name)
    if as_json:
        print(json.dumps(k.model_dump(mode="json"), indent=2, sort_keys=True))
    elif already:
        console().print(f"key '{k.name}' was already revoked at {_when(k.revoked_at)} UTC; nothing changed")
    else:
        console().print(f"key '{k.name}' revoked at {_when(k.revoked_at)} UTC")


@app.command("rotate")
@cli_errors
def rotate(name: str, server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """A new secret for a key (same name, limits and usage); the old secret stops working."""
    _print_secret(_client(server, token).rotate_key(name), as_json, "rotated")


def usage(
    key: Annotated[str | None, typer.Option("--key", help="One key's usage.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="One model's usage.")] = None,
    since: Annotated[str, typer.Option("--since", help="7d, 12h, or a UTC day YYYY-MM-DD.")] = "7d",
    until: Annotated[str | None, typer.Option("--until", help="Like --since; default today.")] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Requests, tokens, guard blocks and errors per key, model and UTC day."""
    client = _client(server, token)
    if model is not None:  # usage is kept by catalog name: an alias names its model (as elsewhere in ctl)
        model = next((m.name for m in client.models() if model in m.aliases), model)
    rows = client.usage(key=key, model=model, since=since, until=until)
    if as_json:
        print(json.dumps([r.model_dump(mode="json") for r in rows], indent=2, sort_keys=True))
        return
    t = table("DAY", "KEY", "MODEL", "REQUESTS", "PROMPT TOK", "COMPLETION TOK", "GUARD BLOCKS", "ERRORS")
    sums = [0, 0, 0, 0, 0]
    for r in rows:
        counts = [r.requests, r.prompt_tokens, r.completion_tokens, r.guard_blocks, r.errors]
        sums = [a + b for a, b in zip(sums, counts, strict=True)]
        t.add_row(r.day, r.key, r.model or "-", *map(str, counts))
    t.add_row("total", "", "", *map(str, sums), style="bold")
    if rows:
        console().print(t)
    elif model:  # a name mistyped finds none
        console().print(f"no usage of model '{model}' in that range ('llmgw ctl models' lists the models)")
    else:
        console().print("no usage in that range")
