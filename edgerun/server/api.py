"""The routes: OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions``
(``stream: true`` as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``.

Every refusal is a JSON error in OpenAI's shape whose ``param`` names the field. Extensions
beyond OpenAI (as vLLM spells them): ``top_k``, ``ignore_eos``, and ``return_token_ids`` (the
generated token ids beside the text).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgerun.engine.request import RequestError, check_request
from edgerun.errors import ConfigError
from edgerun.server.engine_worker import Engine, EngineWorker, Job, JobFailed, QueueFull
from edgerun.server.http import Exchange, HTTPError, Request, error_body, hide_dirs
from edgerun.server.metrics import Metrics, render

if TYPE_CHECKING:  # torch comes with the engine; by the first request it is loaded
    from edgerun.engine.params import SamplingParams
    from edgerun.engine.runner import Event

log = logging.getLogger(__name__)

LOADING, READY, STOPPING, FAILED = "loading", "ready", "stopping", "failed"
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # each held-back tail is checked against them every token
# A stream writes at most this often: tokens that arrive meanwhile share one write and one chunk.
# On a small CPU, a loop wake-up, a write and the client's parsing per token cost several percent.
STREAM_FLUSH_S = 0.02
# The tokenizer thread's niceness: a client posting long prompts back to back keeps it busy, and
# under CPU contention that time should come from the attackers' share, not the engine's or the
# loop's. Raising one's own niceness needs no privilege (Linux: per thread).
TOKENIZE_NICE = 10
# Text longer than the context x the longest token's bytes cannot fit; x4 more for normalizers
# that shorten text (NFC composes up to three code points into one).
BYTES_MARGIN = 4


@dataclass(frozen=True)
class ApiOptions:
    default_max_tokens: int = 256  # when a request gives none (clipped to the context left)
    request_timeout: float = 300.0  # seconds from arrival to the last token, queueing included
    retry_after: int = 1  # seconds, in 429 and 503 answers


@dataclass
class Aborted:
    """Ends a request from the loop's side: the client left, time ran out, or the daemon stops."""

    status: int  # 499: client gone, nothing to send
    message: str


class Channel:
    """One request's items, from the engine thread (``put``) or the loop (``put_here``) to its
    handler. The engine wakes the loop only for a final item, or for a token while the handler
    waits for one (a stream between writes): a whole answer costs the loop one wake-up, a stream
    one per write, not one per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[Any] = deque()
        self.wake_on_token = False
        self.ended = False  # a final item has come (tokens may still follow an abort)
        self.waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:  # engine thread
        self.items.append(item)
        if _final(item):
            self.ended = True
        if self.wake_on_token or self.ended:
            self.wake_on_token = False
            self.loop.call_soon_threadsafe(self._wake)

    def put_here(self, item: Any) -> None:  # loop thread
        self.items.append(item)
        self.ended = self.ended or _final(item)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _ready(self, any_item: bool) -> bool:
        return bool(self.items) and (any_item or self.ended)

    async def take(self, any_item: bool, timeout: float | None = None) -> list[Any]:
        """Everything so far, once there is a final item (or, with ``any_item``, any item), or
        when ``timeout`` seconds have passed."""
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            self._wake()

        timer = self.loop.call_later(timeout, expire) if timeout is not None else None
        try:
            while not self._ready(any_item) and not expired:
                self.waiter = self.loop.create_future()
                self.wake_on_token = any_item
                if self._ready(any_item):  # it came while we set up: the engine may not have seen the flag
                    break
                await self.waiter  # a wake-up may be stale (meant for an earlier take): check again
        finally:
            self.wake_on_token = False
            if timer is not None:
                timer.cancel()
        out = []
        while self.items:  # popleft: the engine may append meanwhile
            out.append(self.items.popleft())
        return out


@dataclass(eq=False)
class _Active:
    job: Job
    channel: Channel
    done: bool = False


class App:
    def __init__(self, worker: EngineWorker, metrics: Metrics, opts: ApiOptions) -> None:
        self.worker = worker
        self.metrics = metrics
        self.opts = opts
        self.state = LOADING
        self.message = "starting"  # loading progress, or why the engine failed
        self.engine: Engine | None = None
        self.info: dict[str, Any] = {}
        self.started = int(time.time())
        self.active: set[_Active] = set()
        # one thread: tokenizing never takes more than one core from the engine, and at a lower
        # priority (TOKENIZE_NICE)
        self.tokenizing = ThreadPoolExecutor(
            1, thread_name_prefix="edgerun-tokenize", initializer=lower_priority, initargs=(TOKENIZE_NICE,)
        )
        self.routes: dict[str, tuple[str, Callable]] = {
            "/health": ("GET", self.health),
            "/metrics": ("GET", self.metrics_text),
            "/v1/models": ("GET", self.models),
            "/v1/completions": ("POST", self.completions),
            "/v1/chat/completions": ("POST", self.chat_completions),
        }

    # ---- lifecycle hooks (the daemon calls these on the loop) ------------------------------

    def set_ready(self, engine: Engine, info: dict[str, Any]) -> None:
        self.engine, self.info, self.state = engine, info, READY

    def abort_all(self, status: int, message: str) -> None:
        for active in list(self.active):
            self._abort(active, Aborted(status, message))

    def _abort(self, active: _Active, why: Aborted) -> None:
        if not active.done:
            active.done = True
            self.worker.cancel(active.job)
            active.channel.put_here(why)

    # ---- routing ----------------------------------------------------------------------------

    async def handle(self, req: Request, ex: Exchange) -> None:
        path = req.path
        if path.startswith("/v1/models/"):
            path = "/v1/models"
        if path not in self.routes:
            raise HTTPError(404, f"no such endpoint: {req.path[:100]}")
        method, handler = self.routes[path]
        if req.method != method and not (method == "GET" and req.method == "HEAD"):
            raise HTTPError(405, f"{req.path} accepts {method} only", headers=(("Allow", method),))
        await handler(req, ex)

    async def health(self, req: Request, ex: Exchange) -> None:
        if self.state == READY:
            body = {"status": "ok", "model": self.engine.model_id, "queue_depth": self.worker.depth}
            await ex.send_json(200, body)
        else:  # loading or stopping: worth asking again, as a 503 from the API says (Retry-After)
            body = {"status": self.state, "message": hide_dirs(self.message)}
            await ex.send_json(503, body, _retry(503, self.opts) if self.state == LOADING else ())

    async def metrics_text(self, req: Request, ex: Exchange) -> None:
        stats = await self.worker.engine_stats(self.engine)
        text = render(self.metrics, self.worker, len(self.active), stats, self.state, self.info)
        await ex.send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    async def models(self, req: Request, ex: Exchange) -> None:
        engine = self._require_ready()
        card = {
            "id": engine.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "edgerun",
            "max_model_len": engine.limits.max_context,
            "edgerun": self.info,
        }
        if req.path.startswith("/v1/models/"):
            name = req.path.removeprefix("/v1/models/")
            if name != engine.model_id:
                raise _unknown_model(name, engine.model_id)
            await ex.send_json(200, card)
        else:
            await ex.send_json(200, {"object": "list", "data": [card]})

    # ---- generation -------------------------------------------------------------------------

    async def completions(self, req: Request, ex: Exchange) -> None:
        engine = self._require_ready()
        body = _json_object(req.body)
        _check_model(body, engine.model_id)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = await self._tokenize(engine, "prompt", prompt)
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise HTTPError(
                400, f"'prompt' holds {len(prompt)} prompts; send one per request", param="prompt"
            )
        elif prompt is None:
            raise HTTPError(400, "'prompt' is required", param="prompt")
        else:
            raise HTTPError(
                400, f"'prompt' must be a string or a list of token ids, got {_show(prompt)}", param="prompt"
            )
        await self._generate(ex, body, ids, "prompt", chat=False)

    async def chat_completions(self, req: Request, ex: Exchange) -> None:
        engine = self._require_ready()
        body = _json_object(req.body)
        _check_model(body, engine.model_id)
        if engine.tokenizer is None:
            raise HTTPError(400, "this model has no tokenizer, so no chat template", param="messages")
        messages = _messages(body.get("messages"), engine.tokenizer.roles)
        ids = await self._tokenize(engine, "messages", messages)
        await self._generate(ex, body, ids, "messages", chat=True)

    async def _tokenize(self, engine: Engine, param: str, text: str | list[dict[str, str]]) -> list[int]:
        """A prompt's ids (``text``: a string, or chat messages through the template), in the
        tokenizer thread once its size in bytes has shown it could fit the context: a long
        prompt costs the loop nothing, one that cannot fit costs nothing at all."""
        tok = engine.tokenizer
        if tok is None:
            raise HTTPError(
                400, "this model has no tokenizer: send the prompt as a list of token ids", param=param
            )
        chat = not isinstance(text, str)
        for where, t in (
            [(f"{param}[{i}].content", m["content"]) for i, m in enumerate(text)] if chat else [(param, text)]
        ):
            _check_unicode(where, t)
        size = sum(_utf8_len(m["content"]) for m in text) if chat else _utf8_len(text)
        context = engine.limits.max_context
        most = context * tok.max_token_bytes * BYTES_MARGIN
        if size > most:
            raise HTTPError(
                400,
                f"'{param}' is {size} bytes of text; no text over {most} bytes fits the context of "
                f"{context} tokens (a token stands for at most {tok.max_token_bytes} bytes)",
                param=param,
                code="context_length_exceeded",
            )
        encode = tok.encode_chat if chat else tok.encode
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenizing, encode, text)
        except ConfigError as exc:  # the chat template refused
            raise HTTPError(400, str(exc), param=param) from None
        except Exception as exc:  # e.g. lone surrogates from a JSON "\ud800"
            raise HTTPError(400, f"'{param}' could not be tokenized: {exc}", param=param) from None

    async def _generate(
        self, ex: Exchange, body: dict, ids: list[int], prompt_field: str, chat: bool
    ) -> None:
        engine = self.engine
        params, max_tokens_field = _sampling(body, chat, len(ids), engine.limits.max_context, self.opts)
        try:
            request = check_request(ids, params, engine.limits, prompt_field, max_tokens_field)
        except RequestError as exc:
            raise HTTPError(400, str(exc), param=exc.param, code=exc.code) from None
        stream = _field(body, "stream", bool, False)
        options = _field(body, "stream_options", dict, {})
        include_usage = _field(options, "include_usage", bool, False, "stream_options.include_usage")
        return_ids = _field(body, "return_token_ids", bool, False)

        loop = asyncio.get_running_loop()
        channel = Channel(loop)

        def deliver(item: Any) -> None:  # engine thread -> loop
            try:
                channel.put(item)
            except RuntimeError:  # the loop is gone: nobody wants the rest
                job.cancelled = True

        answer_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        job = Job(request, deliver, answer_id, arrived=ex.request.received)
        reply = _Reply(engine.model_id, chat, return_ids, job)
        try:
            self.worker.submit(job)
        except QueueFull as exc:
            raise HTTPError(
                429,
                f"server busy: {exc}; retry later",
                headers=(("Retry-After", str(self.opts.retry_after)),),
            ) from None
        active = _Active(job, channel)
        self.active.add(active)
        timeout = self.opts.request_timeout
        timer = loop.call_later(
            timeout, self._abort, active, Aborted(504, f"request exceeded the timeout of {timeout:g} s")
        )
        ex.watch_disconnect(lambda: self._abort(active, Aborted(499, "client disconnected")))
        try:
            if stream:
                await self._stream(ex, active, reply, include_usage)
            else:
                await self._collect(ex, active, reply)
        finally:
            timer.cancel()
            active.done = True
            self.active.discard(active)
            self.worker.cancel(job)  # no-op when it finished; stops it when we leave early

    async def _collect(self, ex: Exchange, active: _Active, reply: _Reply) -> None:
        for item in await active.channel.take(any_item=False):
            if isinstance(item, (JobFailed, Aborted)):
                active.done = True
                if item.status == 499:
                    ex.keep_alive = False
                    return
                raise HTTPError(item.status, item.message, headers=_retry(item.status, self.opts))
            reply.add(item)  # an Event
            if item.finish_reason is not None:
                active.done = True
                await ex.send_json(200, reply.whole())
                return

    async def _stream(self, ex: Exchange, active: _Active, reply: _Reply, include_usage: bool) -> None:
        await ex.start_stream()
        if reply.chat:
            await ex.write(_sse(reply.chunk(role=True)))
        loop = asyncio.get_running_loop()
        last_write = 0.0
        while True:
            # within STREAM_FLUSH_S of the last write, tokens gather; an end comes at once
            wait = last_write + STREAM_FLUSH_S - loop.time()
            items = await active.channel.take(any_item=wait <= 0, timeout=wait if wait > 0 else None)
            text, ids, tail = [], [], []
            for item in items:
                if isinstance(item, (JobFailed, Aborted)):
                    if item.status == 499:
                        ex.keep_alive = False
                        return
                    tail.append(_sse(error_body(item.status, item.message)))
                    break
                reply.add(item)  # an Event
                text.append(item.text)
                if item.token_id is not None:
                    ids.append(item.token_id)
                if item.finish_reason is not None:
                    tail.append(_sse({**reply.chunk(finish=item.finish_reason), "timings": reply.timings()}))
                    if include_usage:
                        tail.append(_sse(reply.usage_chunk()))
                    break
            out = [_sse(reply.chunk("".join(text), ids))] if any(text) or (reply.return_ids and ids) else []
            if tail:
                active.done = True
                await ex.write(b"".join(out + tail) + b"data: [DONE]\n\n")
                await ex.end_stream()
                return
            if out:
                await ex.write(b"".join(out))
                last_write = loop.time()

    def _require_ready(self) -> Engine:
        if self.state == READY:
            return self.engine
        if self.state == LOADING:
            raise HTTPError(503, f"the model is loading ({self.message})", headers=_retry(503, self.opts))
        raise HTTPError(503, f"the server is {self.state}: {self.message}")


class _Reply:
    """Accumulates one request's tokens and shapes the OpenAI objects for it. Beside ``usage``,
    an answer (or a stream's last chunk) carries ``timings``, as llama.cpp's server does: queue,
    TTFT, prefill (prompt_*) and decode (predicted_*) times and rates."""

    def __init__(self, model: str, chat: bool, return_ids: bool, job: Job) -> None:
        self.id, self.job = job.id, job  # the job's timeline gives the timings
        self.created = int(time.time())
        self.model, self.chat, self.return_ids = model, chat, return_ids
        self.object = "chat.completion" if chat else "text_completion"
        self.text: list[str] = []
        self.ids: list[int] = []
        self.prompt_tokens = len(job.request.prompt_ids)
        self.completion_tokens = 0
        self.finish: str | None = None
        self.stats: Any = None  # the engine's GenerationStats, with the final event

    def add(self, event: Event) -> None:
        self.text.append(event.text)
        if event.token_id is not None:
            self.ids.append(event.token_id)
        if event.finish_reason is not None:
            self.finish, self.stats = event.finish_reason, event.stats
            self.completion_tokens = event.stats.generated_tokens if event.stats else len(self.ids)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def _wrap(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(self) -> dict[str, Any]:
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": self.finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.return_ids:
            choice["token_ids"] = self.ids
        return {**self._wrap(self.object, [choice]), "usage": self.usage(), "timings": self.timings()}

    def timings(self) -> dict[str, Any]:
        return self.job.timings(self.stats)

    def chunk(
        self,
        text: str = "",
        token_ids: list[int] | None = None,
        finish: str | None = None,
        role: bool = False,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = (
                {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
            )
        else:
            choice["text"] = text
        if self.return_ids and token_ids:
            choice["token_ids"] = list(token_ids)
        return self._wrap(self.object + (".chunk" if self.chat else ""), [choice])

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._wrap(self.object + (".chunk" if self.chat else ""), []), "usage": self.usage()}


def lower_priority(nice: int) -> int | None:
    """Raise the calling thread's niceness by ``nice`` (Linux: niceness is per thread); its new
    niceness, or None where it could not be changed (then said in the log)."""
    if sys.platform != "linux":  # elsewhere PRIO_PROCESS with a thread id names another process
        log.warning(
            "thread %s keeps its priority: per-thread niceness is Linux only", threading.current_thread().name
        )
        return None
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as exc:
        log.warning("thread %s keeps its priority: %s", threading.current_thread().name, exc)
        return None


# ---- request parsing: every error names its field --------------------------------------------


def _final(item: Any) -> bool:
    return isinstance(item, (JobFailed, Aborted)) or item.finish_reason is not None


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _retry(status: int, opts: ApiOptions) -> tuple[tuple[str, str], ...]:
    return (("Retry-After", str(opts.retry_after)),) if status in (429, 503) else ()


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise HTTPError(400, f"request body is not UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object"}


def _field(body: dict, name: str, typ: type, default: Any = None, param: str | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = (
        _is_int(value)
        if typ is int
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if typ is float
        else isinstance(value, typ)
    )
    if not ok:
        raise HTTPError(
            400, f"'{param or name}' must be {_TYPES[typ]}, got {_show(value)}", param=param or name
        )
    return value


def _unknown_model(name: str, served: str) -> HTTPError:
    return HTTPError(
        404,
        f"model {name[:100]!r} does not exist; this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


def _check_model(body: dict, served: str) -> None:
    name = _field(body, "model", str)
    if name is not None and name != served:
        raise _unknown_model(name, served)


def _check_unicode(where: str, text: str) -> None:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"), which is no character: refused by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise HTTPError(
            400, f"'{where}' holds an unpaired UTF-16 surrogate at character {exc.start}", param=where
        ) from None


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _messages(value: Any, roles: frozenset[str]) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise HTTPError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HTTPError(400, f"'{where}' must be an object with 'role' and 'content'", param=where)
        role = _field(m, "role", str, param=f"{where}.role")
        if not role:
            raise HTTPError(400, f"'{where}.role' is required", param=f"{where}.role")
        if role not in roles:
            raise HTTPError(
                400,
                f"'{where}.role' {_show(role)} is not a role of this model's chat template "
                f"({', '.join(sorted(roles))})",
                param=f"{where}.role",
            )
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise HTTPError(
                        400,
                        f"'{where}.content[{j}]' must be a text part {{'type': 'text', 'text': ...}}",
                        param=f"{where}.content",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise HTTPError(
                400, f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content"
            )
        out.append({"role": role, "content": content})
    return out


_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None}

# OpenAI (and vLLM) fields the engine does not implement, each with the values that ask for
# nothing: any other value would change the output, so it is refused by name, not ignored
_NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "min_p": (0,),
    "min_tokens": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
}


def _asks_nothing(value, neutral: tuple) -> bool:
    return not isinstance(value, bool) and value in neutral  # True == 1, but a flag is no number


def _sampling(
    body: dict, chat: bool, prompt_len: int, context: int, opts: ApiOptions
) -> tuple[SamplingParams, str]:
    """The sampling parameters, and how the request spelled max_tokens. Limits against the
    prompt and the context are :func:`check_request`'s, not checked here."""
    for name, default in _UNSUPPORTED.items():
        value = body.get(name)
        same = value == default and type(value) is type(default)  # True == 1, but n=true is no count
        if value is not None and not same and not (name == "logprobs" and value is False):
            raise HTTPError(400, f"'{name}' = {_show(value)} is not supported (only {default!r})", param=name)
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not _asks_nothing(value, neutral):
            only = " or ".join(_show(n) for n in neutral)
            raise HTTPError(400, f"'{name}' = {_show(value)} is not supported (only {only})", param=name)
    name = "max_tokens"
    max_tokens = _field(body, name, int)
    if chat and body.get("max_completion_tokens") is not None:  # OpenAI's newer name for it
        newer = _field(body, "max_completion_tokens", int)  # checked even beside max_tokens
        if max_tokens is not None and newer != max_tokens:
            raise HTTPError(
                400,
                f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({newer}) disagree; give one",
                param="max_completion_tokens",
            )
        name, max_tokens = "max_completion_tokens", newer
    if (
        max_tokens is None
    ):  # the default, clipped to the context left (the prompt's own limit is checked later)
        max_tokens = max(min(opts.default_max_tokens, context - prompt_len), 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop == []:  # OpenAI's API takes an empty list: no stop strings
        stop = None
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise HTTPError(
            400, f"'stop' must be a string or a list of non-empty strings, got {_show(stop)}", param="stop"
        )
    if stop is not None and len(stop) > MAX_STOP:
        raise HTTPError(400, f"'stop' has {len(stop)} strings; at most {MAX_STOP}", param="stop")
    if stop is not None and (longest := max(len(s) for s in stop)) > MAX_STOP_CHARS:
        raise HTTPError(
            400, f"a 'stop' string has {longest} characters; at most {MAX_STOP_CHARS}", param="stop"
        )
    seed = _field(body, "seed", int)
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise HTTPError(400, f"'seed' must fit in 64 bits, got {seed}", param="seed")
    top_k = _field(body, "top_k", int, 0)
    from edgerun.engine.params import SamplingError, SamplingParams

    kw = dict(
        max_tokens=max_tokens,
        temperature=float(_field(body, "temperature", float, 1.0)),
        top_p=float(_field(body, "top_p", float, 1.0)),
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
        seed=seed,
        stop=tuple(stop or ()),
        ignore_eos=_field(body, "ignore_eos", bool, False),
    )
    try:
        return SamplingParams(**kw), name
    except SamplingError as exc:
        param = next((k for k in kw if str(exc).startswith(k)), None)
        raise HTTPError(400, str(exc), param=name if param == "max_tokens" else param) from None
