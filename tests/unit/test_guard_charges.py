"""What a guarded request costs its key when the guard blocks it: the real gateway over HTTP, a fake
engine, the fake judge (``bomb`` is Unsafe) and a stored key with a ``tpm``."""

from __future__ import annotations

import httpx

from llmgw.control.gateway.app import build_gateway_app
from llmgw.control.gateway.callers import Callers
from llmgw.control.gateway.guard import GuardInspector
from llmgw.control.gateway.inspect import Exchange
from llmgw.control.gateway.keys import GatewayKeys, digest
from llmgw.control.gateway.limits import Limiter
from llmgw.control.store.rows import ApiKeyRow
from llmgw.guard.config import GuardConfig, Policy
from llmgw.guard.judge import JudgeClient, JudgeRoute
from llmgw.routing import Route, StaticRouter, Upstream
from tests.helpers.gateway import JUDGE_KEY, FakeJudge, ServerThread, fake_llama


def test_a_blocked_prompt_is_charged_what_its_judge_read() -> None:
    """A security tester's finding: a prompt the judge read whole and blocked was charged nothing, so
    a key of 1,000 tokens a minute had 800-token prompts judged as often as its rpm allowed (the
    judge's work unpaid, and under ``fail: closed`` a judge kept busy for everyone else). Now the
    second such prompt in the minute is a 429 before the judge is asked again."""
    servers = ServerThread()
    judge = FakeJudge()
    try:
        jport = servers.serve(judge.app())
        eport = servers.serve(fake_llama("replica-a", "key-a"))
        routes = {"chat": Route("chat", (Upstream("r-a", f"127.0.0.1:{eport}", "key-a"),))}
        judges = {"judge": JudgeRoute("judge", "qwen3guard", (Upstream("j-1", f"127.0.0.1:{jport}", JUDGE_KEY),))}
        guard = GuardInspector(GuardConfig(policies=[Policy(name="p", judge="judge", models=["chat"])]),
                               JudgeClient(judges.get))
        callers = Callers(GatewayKeys(None, initial=set()))
        callers.set_rows([ApiKeyRow("small", "sk-llmgw-small0", digest("sk-small").hex(), tpm=1000)])
        seen: list[Exchange] = []
        app = build_gateway_app(StaticRouter(routes=routes), keys=(), allow_loopback_without_key=False,
                                inspector=guard, observe=seen.append, callers=callers, limiter=Limiter())
        url = f"http://127.0.0.1:{servers.serve(app)}/v1/chat/completions"
        body = {"model": "chat", "max_tokens": 1, "messages": [{"role": "user", "content": "bomb " + "x" * 3200}]}
        codes = []
        for _ in range(3):
            r = httpx.post(url, json=body, headers={"Authorization": "Bearer sk-small"}, timeout=10)
            codes.append((r.status_code, r.json()["error"]["code"]))
        assert codes[0] == (400, "content_blocked")
        assert codes[1:] == [(429, "rate_limit_exceeded")] * 2, codes
        assert len(judge.asked) == 1
        blocked = [e for e in seen if e.code == "content_blocked"]
        usage = blocked[0].usage
        assert usage is not None
        assert usage["prompt_tokens"] >= 800
        servers.run(guard.client.close())
    finally:
        servers.close()
