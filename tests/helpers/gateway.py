"""Helpers for the gateway and chat tests (no tests here): a fake llama-server and a server thread.

The fake imitates llama-server's ``/v1/chat/completions`` as the gateway sees it: ``--api-key``
checked (401 in llama-server's error shape otherwise), a ``chat.completion`` JSON that echoes the
request's ``model``, and an SSE stream of several ``data:`` events ending ``data: [DONE]``, each
written and flushed on its own so the gateway sees separate network chunks. The last user message
picks a misbehaviour: ``fail`` (500 naming the replica's own address), ``cut`` (connection closed
without an answer), ``cut-stream`` (stream dies after two events); ``echo-body`` answers with the
request body it received as the message's content (to see what the gateway forwards).

:class:`ServerThread` runs aiohttp apps on 127.0.0.1 ephemeral ports in a background event loop, so
the tests themselves are plain sync code using httpx, the ``openai`` client and the CLI.

:class:`FakeJudge` imitates a Qwen3Guard judge served by llama-server (its ``Safety:`` lines; a word
in the text picks the verdict or a failure) and records what it was asked.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")


def stream_events(model: str, replica: str) -> list[bytes]:
    """The exact SSE events the fake sends for a streamed answer: compact JSON, as llama-server writes."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": model}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": None}]
    deltas += [{"content": piece} for piece in ("Hello", " from", f" {replica}", "!")]
    chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    events = [b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks]
    done = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    events.append(b"data: " + json.dumps(done, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def completion(model: str, replica: str) -> dict[str, Any]:
    """The fake's non-streamed answer."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"Hello from {replica}!"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
    }


def fake_llama(
    replica: str, key: str, notes: list[str] | None = None, model_path: str | None = None
) -> web.Application:
    """A llama-server stand-in named ``replica`` that requires ``Authorization: Bearer <key>``.

    With ``model_path`` it reports that as every answer's ``model``, as the real llama-server does
    with its ``-m`` path; without, it echoes the request's ``model`` (so relays can be byte-exact).

    A stream asked with ``stream_options.include_usage`` ends with llama-server's usage event;
    ``echo-request-id`` answers the ``x-request-id`` header it got.

    ``slow-stream`` streams for ~10 s and appends ``"aborted"`` to ``notes`` when its client (the
    gateway) closes the connection first, as llama-server then stops generating; ``slow-plain``
    does the same for a non-streamed answer (it watches the connection while it "generates"), and
    first appends ``"generating"``, so a test knows the request reached it. ``think-first`` sends
    its stream's headers at once and its first event 0.3 s later, as llama-server does while it
    reads the prompt. ``linger-after-done`` ends its response 2 s after its ``data: [DONE]`` event,
    so a client that closes on reading that event leaves before the replica is done.
    """

    async def chat(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {key}":
            err = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
            return web.json_response(err, status=401)
        body = await request.json()
        text = body["messages"][-1]["content"]
        model = model_path or body.get("model", "gpt-3.5-turbo")
        if text == "fail":
            where = f"{request.host}"
            err = {"error": {"code": 500, "message": f"slot failed at {where}", "type": "server_error"}}
            return web.json_response(err, status=500)
        if text == "echo-request-id":
            answer = completion(model, replica)
            answer["choices"][0]["message"]["content"] = request.headers.get("x-request-id", "")
            return web.json_response(answer)
        if text == "echo-body":
            answer = completion(model, replica)
            answer["choices"][0]["message"]["content"] = json.dumps(body)
            return web.json_response(answer)
        if text == "slow-plain":
            if notes is not None:
                notes.append("generating")
            for _ in range(500):
                await asyncio.sleep(0.02)
                if request.transport is None or request.transport.is_closing():
                    if notes is not None:
                        notes.append("aborted")
                    return web.Response()
            return web.json_response(completion(model, replica))
        if text == "cut":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if not body.get("stream"):
            return web.json_response(completion(model, replica))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if text == "think-first":  # the headers at once, the first token 0.3 s later (a prompt to read)
            await asyncio.sleep(0.3)
        if text == "slow-stream":
            try:
                for _ in range(500):
                    await resp.write(stream_events(model, replica)[1])
                    await asyncio.sleep(0.02)
            except ConnectionResetError:
                pass
            finally:
                if notes is not None and (request.transport is None or request.transport.is_closing()):
                    notes.append("aborted")
            return resp
        for i, event in enumerate(stream_events(model, replica)):
            if text == "cut-stream" and i == 2:
                assert request.transport is not None
                request.transport.close()
                return resp
            if event == b"data: [DONE]\n\n" and (body.get("stream_options") or {}).get("include_usage"):
                # llama-server's usage event: no choices, the answer's usage (asked with include_usage)
                usage = {"choices": [], "model": model, "object": "chat.completion.chunk",
                         "usage": {"completion_tokens": 4, "prompt_tokens": 5, "total_tokens": 9}}
                await resp.write(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n")
            await resp.write(event)
            await asyncio.sleep(0.003)  # separate network chunks, as tokens are
        if text == "linger-after-done":
            await asyncio.sleep(2)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


class ServerThread:
    """An event loop in a daemon thread serving aiohttp apps; :meth:`close` cleans every one up."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._runners: list[web.AppRunner] = []

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the server loop and wait for its result (10 s at most)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def serve(self, app: web.Application, host: str = "127.0.0.1", *, handler_cancellation: bool = False) -> int:
        """Serve ``app`` on ``host`` at an ephemeral port; return the port. ``handler_cancellation``:
        cancel a handler when its client disconnects (as the control plane serves the gateway)."""

        async def start() -> int:
            runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=handler_cancellation)
            await runner.setup()
            site = web.TCPSite(runner, host, 0)
            await site.start()
            self._runners.append(runner)
            port: int = runner.addresses[-1][1]
            return port

        return self.run(start())

    def close(self) -> None:
        """Stop every app and the loop."""

        async def stop() -> None:
            for runner in reversed(self._runners):
                await runner.cleanup()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


JUDGE_KEY = "judge-secret-key"


@dataclass
class FakeJudge:
    """Records what it was asked: ``asked`` (judged texts), ``templates`` (apply-template calls)."""

    chatml: bool = False
    asked: list[str] = field(default_factory=list)
    templates: int = 0

    def app(self) -> web.Application:
        async def template(request: web.Request) -> web.Response:
            self.templates += 1
            body = await request.json()
            text = "\n".join(m["content"] for m in body["messages"])
            if self.chatml:
                return web.json_response({"prompt": f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"})
            return web.json_response({"prompt": f"<|im_start|>user\n# Task:\n<BEGIN SAFETY POLICY>\n{text}"})

        async def chat(request: web.Request) -> web.StreamResponse:
            if request.headers.get("Authorization") != f"Bearer {JUDGE_KEY}":
                return web.json_response({"error": {"code": 401, "message": "Invalid API Key"}}, status=401)
            body = await request.json()
            assert body["temperature"] == 0
            assert body["cache_prompt"] is True
            msgs = body["messages"]
            text = msgs[-1]["content"]
            self.asked.append(text)
            out = msgs[-1]["role"] == "assistant"
            refusal = "\nRefusal: No" if out else ""
            answer = "Safety: Safe\nCategories: None" + refusal
            if "bomb" in text:
                answer = "Safety: Unsafe\nCategories: Violent" + refusal
            elif "edgy" in text:
                answer = "Safety: Controversial\nCategories: Unethical Acts" + refusal
            elif "slowjudge" in text:
                await asyncio.sleep(1.5)
            elif "garbage" in text:
                answer = "I am not sure about this one."
            elif "threelines" in text:
                answer = "Safety: Safe\r\nCategories: None\r\nRefusal: No\r\n"
            elif "judge500" in text:
                return web.json_response({"error": {"message": "slot crashed at 10.0.0.9:8123"}}, status=500)
            elif "cutjudge" in text:
                assert request.transport is not None
                request.transport.close()
                return web.Response()
            timings = {"prompt_ms": 1.0, "predicted_ms": 2.0, "cache_n": 5}
            if body.get("stream"):  # as llama-server streams: a few characters an event
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                for i in range(0, len(answer), 4):
                    event = {"choices": [{"index": 0, "delta": {"content": answer[i:i + 4]}}], "timings": timings}
                    await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "timings": timings}
                await out.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
                return out
            return web.json_response(
                {
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}
                    ],
                    "timings": timings,
                }
            )

        app = web.Application()
        app.router.add_post("/apply-template", template)
        app.router.add_post("/v1/chat/completions", chat)
        return app
