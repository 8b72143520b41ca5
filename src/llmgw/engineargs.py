"""Which engine flags a profile's ``args`` may not carry, and why.

Engines run as the agent's user (root on a node): a profile arg that names a file makes the engine
read or write that file wherever it is (``--log-file /etc/cron.d/x``, ``--slot-save-path /``,
``--api-key-file /etc/shadow``, ``--lora /root/.ssh/id_rsa``), and the control plane cannot know
the replica's directory when the catalog is written, so every flag that takes a path is refused,
whatever its value. Refused too: flags the agent owns (where the engine listens, the file it
serves, the key that guards it, the paths it answers on), flags that fetch weights or work from
elsewhere (the mirror is the only source), flags that let clients run tools on the node, flags that
run code shipped with a model, flags that put prompts or answers into the engine log (which the
dashboard's viewers and ``ctl logs`` read: llmgw keeps no prompt), and flags that send request data
to another address (OpenTelemetry traces).

The lists come from llama.cpp's ``common/arg.cpp`` (the build in ``scripts/assets``, every option
whose value is ``FNAME``/``FILE``/``PATH``/``DIR``/``URL``) and vLLM's ``vllm serve --help``.
Spellings: llama-server turns ``_`` into ``-`` in a ``--`` flag,
vLLM's parser does the same and also reads ``--flag=value``, ``--flag.key=value`` and unambiguous
prefixes (argparse abbreviations), so a token is reduced to its flag before the lookup, and for
vLLM a long flag that is a prefix of a refused one is refused too.

:func:`refused_args` returns the reason for the first refused token; the catalog's ``Profile``
validator turns it into the 400 the admin API answers.
"""

from __future__ import annotations

from collections.abc import Sequence

OWNED = (
    "the agent sets it: it decides where the engine listens, which weights file it serves and "
    "which key guards it; remove it from the profile"
)
READS_FILE = (
    "it makes the engine (running as root on the node) read a file outside the replica's "
    "directory; profiles cannot name files on nodes"
)
WRITES_FILE = (
    "it makes the engine (running as root on the node) write files outside the replica's "
    "directory; profiles cannot name files on nodes"
)
FETCHES = (
    "it makes the engine fetch weights or work from elsewhere; the agent gives it the file from "
    "the mirror, which is the only source"
)
RUNS_TOOLS = "it lets clients run commands or edit files on the node through the engine"
RUNS_CODE = "it makes the engine import Python code from a path or module the profile names"
REMOTE_CODE = (
    "it makes vLLM run the Python code that comes with the model's files (as root on the node); "
    "serve models that need no code of their own"
)
LOGS_TEXT = (
    "it makes the engine write prompts or answers into its log, which the dashboard's viewers and "
    "'llmgw ctl logs' read (llmgw keeps no prompt); leave the engine's log level as the agent sets it"
)
SENDS_DATA = "it makes the engine send request data (traces with prompts) to an address the profile names"
PATHS = (
    "it moves the engine's API under another path, where the agent's readiness probe and the "
    "gateway do not look; remove it from the profile"
)

LLAMACPP: dict[str, str] = {
    # owned by the agent (llamacpp.AGENT_OWNED)
    **dict.fromkeys(("-m", "--model", "--host", "--port", "--api-key", "--api-key-file"), OWNED),
    **dict.fromkeys(("--reuse-port",), OWNED),
    **dict.fromkeys(("--api-prefix",), PATHS),
    # prompts and answers in the engine log: "-v" logs every request and response body
    **dict.fromkeys(
        ("-v", "--verbose", "--log-verbose", "-lv", "--verbosity", "--log-verbosity", "--verbose-prompt"),
        LOGS_TEXT,
    ),
    # other weights, from a path or the network
    **dict.fromkeys(
        ("-mu", "--model-url", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft", "--hf-token",
         "-mmu", "--mmproj-url", "--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft",
         "-hfv", "-hfrv", "--hf-repo-v", "-hffv", "--hf-file-v", "-dr", "--docker-repo",
         "--rpc", "--server-base", "--models-dir", "--models-preset"),
        FETCHES,
    ),
    # files read
    **dict.fromkeys(
        ("-mm", "--mmproj", "--lora", "--lora-scaled", "--control-vector", "--control-vector-scaled",
         "-md", "--model-draft", "--spec-draft-model", "-mv", "--model-vocoder",
         "--grammar-file", "-jf", "--json-schema-file", "--chat-template-file", "--ssl-key-file",
         "--ssl-cert-file", "--path", "--media-path", "--ui-config-file", "--webui-config-file",
         "--mcp-servers-config", "-f", "--file", "-sysf", "--system-prompt-file", "--in-file",
         "-bf", "--binary-file", "--context-file", "--positive-file", "--negative-file",
         "--tts-speaker-file", "--image", "--audio", "--video", "--video-ffmpeg-dir",
         "-lcs", "--lookup-cache-static"),
        READS_FILE,
    ),
    # files written
    **dict.fromkeys(
        ("--log-file", "--log-prompts-dir", "--slot-save-path", "-lcd", "--lookup-cache-dynamic",
         "--prompt-cache", "-o", "--output", "--output-file", "--save-all-logits",
         "--kl-divergence-base", "--logits-output-dir"),
        WRITES_FILE,
    ),
    # tools that act on the node
    **dict.fromkeys(
        ("--tools", "--tools-runtime", "-ag", "--agent", "--mcp-servers-json", "--ui-mcp-proxy",
         "--webui-mcp-proxy"),
        RUNS_TOOLS,
    ),
}
"""llama-server flags a profile may not carry: flag spelling -> reason."""

VLLM: dict[str, str] = {
    **dict.fromkeys(("--model", "--host", "--port", "--uds", "--api-key", "--served-model-name"), OWNED),
    **dict.fromkeys(
        ("--tokenizer", "--download-dir", "--hf-config-path", "--generation-config", "--chat-template",
         "--config", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--allowed-local-media-path",
         "--lora-modules", "--qlora-adapter-name-or-path", "--speculative-config",
         "--model-loader-extra-config"),
        READS_FILE,
    ),
    **dict.fromkeys(("--hf-token", "--load-format"), FETCHES),
    **dict.fromkeys(
        ("--middleware", "--tool-parser-plugin", "--reasoning-parser-plugin", "--logits-processors",
         "--worker-cls", "--worker-extension-cls"),
        RUNS_CODE,
    ),
    **dict.fromkeys(("--trust-remote-code",), REMOTE_CODE),
    **dict.fromkeys(("--enable-log-requests", "--enable-log-outputs", "--uvicorn-log-level"), LOGS_TEXT),
    **dict.fromkeys(("--otlp-traces-endpoint",), SENDS_DATA),
}
"""vLLM flags a profile may not carry: flag spelling -> reason."""

_MIN_ABBREV = 4
"""argparse takes ``--dow`` for ``--download-dir``; prefixes shorter than this many characters
after ``--`` are ambiguous among vLLM's flags and refused by vLLM itself."""


def _flag(token: str, engine: str) -> str:
    """The flag a token sets: ``--log_file=/x`` -> ``--log-file``; vLLM's ``--a.b=1`` -> ``--a``."""
    flag = token.split("=", 1)[0]
    if flag.startswith("--"):
        flag = flag.replace("_", "-")
        if engine == "vllm":
            flag = flag.split(".", 1)[0]
    return flag


def refused_args(engine: str, args: Sequence[str]) -> tuple[str, str] | None:
    """The first token of ``args`` that sets a refused flag, with the reason; None when all may pass.

    Every token is checked, values too (a value that is itself a refused flag is refused: it
    would be a flag if the one before it takes no value).

    Args:
        engine: ``"llamacpp"`` or ``"vllm"`` (another engine has no list and passes).

    Returns:
        ``("--log-file=/etc/x", "it makes the engine … write files …")`` or None.
    """
    table = LLAMACPP if engine == "llamacpp" else VLLM if engine == "vllm" else {}
    for token in args:
        if not token.startswith("-"):
            continue
        flag = _flag(token, engine)
        reason = table.get(flag)
        if reason is None and engine == "vllm" and flag.startswith("--") and len(flag) >= 2 + _MIN_ABBREV:
            reason = next((r for f, r in table.items() if f.startswith(flag)), None)
        if reason is not None:
            return token, reason
    return None
