"""``llmgw ctl guard``: the guardrails' judges and a way to try them.

- ``guard judge status``: each policy's judges: in the catalog, replicas ready, p50/p95 judge time,
  and what to do when one is missing.
- ``guard judge enable NAME [--repo R --file F --format FMT]``: fetch and serve a judge.
- ``guard test "text" [--out] [--prompt P] [--policy NAME]``: the verdict, categories and time.

Exit codes as ``llmgw ctl``: 0 fine, 1 an API error, 3 the control plane does not answer; ``guard
test`` exits 4 when the text would be blocked and 5 when there was no verdict, so scripts can tell.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmgw.cli.common import cli_errors, console, paths, table, typer_app

if TYPE_CHECKING:
    from llmgw.adminclient import AdminClient

app = typer_app(no_args_is_help=True, help="Guardrails: judges, policies, and trying a text.")
judge_app = typer_app(no_args_is_help=True, help="The judges the policies name.")
app.add_typer(judge_app, name="judge")

ServerOpt = Annotated[str | None, typer.Option("--server", help="Admin API URL (default: this machine's).")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="LLMGW_TOKEN", help="Admin bearer token.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]

BLOCKED_EXIT = 4
NO_VERDICT_EXIT = 5


def _client(server: str | None, token: str | None) -> AdminClient:
    from llmgw.adminclient import AdminClient

    return AdminClient.from_paths(paths(), server=server, token=token)


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.0f}"


@judge_app.command("status")
@cli_errors
def judge_status(server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Each policy's judges: in the catalog, replicas ready, judge time, what to do when missing."""
    data = _client(server, token).guard_status()
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    if not data["on"]:
        print("Guardrails are off: server.yaml has no guard policy, so prompts and answers are not judged.")
        return
    t = table("POLICY", "CHECKS", "FAIL", "JUDGE", "CATALOG", "READY", "P50 ms", "P95 ms", "TO DO", box=None)
    for p in data["policies"]:
        for j in p["judges"]:
            todo = j["hint"]
            if j["template_failed"]:
                todo = f"replicas {', '.join(j['template_failed'])} render the wrong chat template"
            t.add_row(
                p["name"], "+".join(p["check"]), p["fail"], f"{j['name']} ({j['format'] or '?'})",
                "yes" if j["in_catalog"] else "no", f"{j['replicas_ready']}/{j['replicas']}",
                _ms(j["p50_ms"]), _ms(j["p95_ms"]), todo,
            )
    console().print(t)
    s = data.get("stats") or {}
    if s:
        print(
            f"blocked {_counts(s.get('blocked'))}, unjudged (fail open) {_counts(s.get('unjudged'))}, "
            f"refused for no verdict {_counts(s.get('refused_unavailable'))}, judge errors {_counts(s.get('errors'))}"
        )


def _counts(by: Any) -> str:
    """``{"in": 2, "out": 1}`` as ``2 in, 1 out`` (``0`` when empty); it printed the Python dict."""
    return ", ".join(f"{n} {k}" for k, n in sorted(by.items())) if isinstance(by, dict) and by else "0"


@judge_app.command("enable")
@cli_errors
def judge_enable(
    name: Annotated[str, typer.Argument(help="The judge's catalog name (qwen3guard-0.6b, qwen3guard-4b, ...).")],
    repo: Annotated[str, typer.Option(help="Hugging Face repo of a judge llmgw does not know.")] = "",
    file: Annotated[str, typer.Option(help="The GGUF file in that repo.")] = "",
    fmt: Annotated[str, typer.Option("--format", help="qwen3guard, llamaguard3 or prompted.")] = "",
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Fetch a judge into the mirror and add it to the catalog (a known one by name alone)."""
    if bool(repo) != bool(file):
        raise typer.BadParameter("--repo and --file go together")
    body: dict[str, str] = {k: v for k, v in (("repo", repo), ("file", file), ("format", fmt)) if v}
    data = _client(server, token).enable_judge(name, body)
    print(f"fetching {data['source']} as {data['judge']} (job {data['job']}); "
          "'llmgw ctl guard judge status' shows when it is ready")


@app.command("test")
@cli_errors
def try_text(
    text: Annotated[str, typer.Argument(help="The text to judge.")],
    out: Annotated[bool, typer.Option("--out", help="Judge it as an answer (default: as a prompt).")] = False,
    prompt: Annotated[str, typer.Option(help="With --out: the prompt it answers.")] = "",
    policy: Annotated[str, typer.Option(help="The policy whose judges to use (default: the first).")] = "",
    server: ServerOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Judge a text as the gateway would: the verdict, its categories and the time it took."""
    if prompt and not out:  # it was dropped without a word (a new user's finding)
        raise typer.BadParameter("--prompt is the prompt an answer answers: give it with --out", param_hint="--prompt")
    if not text.strip():
        raise typer.BadParameter("the text to judge is empty", param_hint="TEXT")
    body: dict[str, str] = {"text": text, "direction": "out" if out else "in"}
    if prompt:
        body["prompt"] = prompt
    if policy:
        body["policy"] = policy
    data = _client(server, token).guard_test(body)
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
    elif "error" in data:
        print(f"no verdict ({data['kind']}, {data['ms']:.0f} ms): {data['error']}; policy "
              f"'{data['policy']}' would {data['decision'].replace('fail ', 'fail ')}")
        if data.get("raw"):
            print(f"the judge said: {data['raw']!r}")
    else:
        cats = ", ".join(data["categories"]) or "none"
        print(f"{data['verdict']} (categories: {cats}) by {data['judge']} in {data['ms']:.0f} ms "
              f"(engine {_ms(data['engine_ms'])} ms): policy '{data['policy']}' would {data['decision']}")
    if "error" in data:
        raise typer.Exit(NO_VERDICT_EXIT)
    if data["decision"] == "block":
        raise typer.Exit(BLOCKED_EXIT)
