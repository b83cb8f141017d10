"""OpenAI-compatible HTTP server over one loaded model (``k3 serve``).

Endpoints (the OpenAI API's shapes, as vLLM and MLC-LLM serve them):

- ``GET /v1/models`` — the one served model.
- ``POST /v1/completions`` — ``prompt``: a string or token ids (or a list holding one of them).
- ``POST /v1/chat/completions`` — ``messages`` (roles system / developer / user / assistant;
  content a string or text parts) rendered with the model's chat template.
- ``GET /health`` — 200 once the model is loaded.

Both generation endpoints take ``max_tokens`` (chat: ``max_completion_tokens`` first),
``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``seed``, ``stop`` (string or
list), ``ignore_eos`` and ``stream`` (server-sent events ending with ``data: [DONE]``; the last
chunk carries ``finish_reason`` and ``usage``). Unset sampling fields take the model's
``generation_config.json`` values, as ``k3 generate`` does (greedy when it does not ask for
sampling); ``max_tokens`` defaults to 16 for completions (the OpenAI default) and 512 for
chat. Fields that would change a response's meaning and are not implemented (``n`` > 1,
``echo``, ``logprobs``, ``best_of``, ``suffix``, tools, ``logit_bias``, presence / frequency
penalties, non-text ``response_format``) are refused; other unknown fields are ignored.

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed body, a bad field, input the tokenizer or chat template cannot take, or a prompt
that does not fit the context window (``code: context_length_exceeded``); 404 for an unknown
model or route; 500 (logged) for a failure inside the runtime. The server stays up.

Requests are batched continuously (:class:`BatchScheduler`): up to the engine's batch size
(``--max-batch-size``) sequences decode together, one token per ``decode`` call, and a
request joins or leaves the batch between steps. A client that disconnects — streaming or not
— stops its generation before the next token (``finish_reason: "cancelled"``), freeing its
slot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import threading
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .model_runner import LoadedModel, ModelLoadError
from .sampler import SamplingParams, sampling_with_defaults

log = logging.getLogger("k3_compile.server")
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 512


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, err_type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Sampling(BaseModel):
    """Fields common to both generation endpoints. Unknown OpenAI fields are ignored; known
    ones this server cannot honour are refused (:func:`_refuse_unsupported`)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    n: int | None = Field(default=None, ge=1, le=1)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a text prompt, or token ids (one prompt per request)."""

    prompt: str | list[str] | list[int] | list[list[int]]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; ``developer`` is taken as ``system``; content may be text parts."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


# OpenAI fields that change what a response means; refused unless at their neutral value
_UNSUPPORTED = {"echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0),
                "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
                "tool_choice": (None, "none"), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
                "frequency_penalty": (None, 0, 0.0)}


def _refuse_unsupported(req) -> None:
    """Raises APIError(400) for a field in ``_UNSUPPORTED`` set to something else, or a
    ``response_format`` other than text."""
    extra = req.model_extra or {}
    for name, neutral in _UNSUPPORTED.items():
        if name in extra and extra[name] not in neutral:
            raise APIError(400, f"{name}: not supported by this server", name)
    fmt = extra.get("response_format")
    if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(400, "response_format: only text is supported", "response_format")
    if isinstance(req.stop, list) and any(not x for x in req.stop) or req.stop == "":
        raise APIError(400, "stop: empty stop strings are not allowed", "stop")


def sampling_params(req, defaults: dict, default_max: int) -> SamplingParams:
    """SamplingParams of a request (:func:`k3_compile.runtime.sampler.sampling_with_defaults`:
    unset fields from the model's generation_config.json); ``max_completion_tokens`` (chat),
    else ``max_tokens``, else ``default_max``.

    Raises:
        APIError(400): a value SamplingParams rejects.
    """
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return sampling_with_defaults(
            defaults, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            repetition_penalty=req.repetition_penalty, seed=req.seed,
            max_tokens=getattr(req, "max_completion_tokens", None) or req.max_tokens or default_max,
            stop=stop, ignore_eos=bool(req.ignore_eos))
    except ValueError as e:
        raise APIError(400, str(e)) from None


class _Job:
    """A request waiting for, being prefilled in, or decoding in the batch."""

    def __init__(self, prompt_ids, params, stream, should_stop):
        self.prompt_ids, self.params, self.stream, self.should_stop = prompt_ids, params, stream, should_stop
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.sid = None
        self.state = None
        self.tok = None
        self.cursor = 0          # prompt tokens prefilled so far
        self.t0 = 0.0            # when it joined the batch (time to first token counts from here)
        self.prefill_seconds = 0.0
        self.decode_s0 = 0.0


class BatchScheduler:
    """Continuous batching with chunked prefill over one engine (what vLLM and MLC-LLM
    schedule): a thread owns the engine. Each step it admits waiting requests while the batch
    has room, runs one ragged prefill call of at most ``prefill_chunk`` prompt tokens taken
    from the requests still prefilling (shortest remaining prompt first, so that a short
    request arriving behind a long prompt starts at once), then one ``decode`` call that
    advances every decoding sequence by a token (model_runner.Decoding keeps each one's
    sampling and stop state). A long prompt so delays running requests by one chunk per step
    instead of by its whole prefill. Finished or cancelled requests leave at once.

    ``max_batch``: sequences in the batch, prefilling or decoding (the engine's KDA slots
    hold one more, spare); ``prefill_chunk``: prompt tokens per step (default: the model's)."""

    def __init__(self, model: LoadedModel, max_batch: int, prefill_chunk: int | None = None):
        self.model, self.max_batch = model, max(1, max_batch)
        self.prefill_chunk = max(1, prefill_chunk or model.prefill_chunk)
        self.waiting: queue.Queue = queue.Queue()
        self.largest_batch = 0  # the most sequences one decode call has advanced
        self.largest_prefill = 0  # the most sequences one prefill call has taken a chunk of
        threading.Thread(target=self._loop, name="k3-batch", daemon=True).start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, stream=None,
               should_stop=None) -> concurrent.futures.Future:
        """Queue a request; the future gets its GenerationResult (or the exception)."""
        job = _Job(prompt_ids, params, stream, should_stop or (lambda: False))
        self.waiting.put(job)
        return job.future

    def _finish(self, job: _Job, exc: BaseException | None = None) -> None:
        eng = self.model.engine
        try:
            if exc is None:
                res = job.state.result(job.prefill_seconds, eng.stats.decode_seconds - job.decode_s0)
                self.model.generated_tokens += len(job.state.out)
        except BaseException as e:  # noqa: BLE001 - a stream callback may fail
            exc = e
        if job.sid is not None:
            eng.remove_sequence(job.sid)
            job.sid = None
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(res)

    def _start_decoding(self, job: _Job) -> None:
        from .model_runner import Decoding

        job.decode_s0 = self.model.engine.stats.decode_seconds
        job.state = Decoding(self.model, job.sid, len(job.prompt_ids), job.params, job.stream, job.t0)

    def _cancel(self, job: _Job) -> None:
        """A request whose client went away (or that asked to stop), prefilling or decoding."""
        try:
            if job.state is None:
                self._start_decoding(job)
            job.state.cancel()
        except BaseException as e:  # noqa: BLE001
            self._finish(job, e)
            return
        self._finish(job)

    def _prefill_step(self, prefilling: list[_Job]) -> list[_Job]:
        """One ragged prefill call over the prefilling requests, shortest remaining prompt
        first (at most ``prefill_chunk`` tokens in all); returns those whose prompt is now
        complete and whose first token was sampled (the others are finished or keep
        prefilling)."""
        eng, budget = self.model.engine, self.prefill_chunk
        taken: list[tuple[_Job, int]] = []
        for job in sorted(prefilling, key=lambda j: len(j.prompt_ids) - j.cursor):
            n = min(budget, len(job.prompt_ids) - job.cursor)
            taken.append((job, n))
            budget -= n
            if budget == 0:
                break
        self.largest_prefill = max(self.largest_prefill, len(taken))
        p0 = eng.stats.prefill_seconds
        try:
            logits = eng.prefill([j.sid for j, _ in taken], [j.prompt_ids[j.cursor:j.cursor + n] for j, n in taken])
        except BaseException as e:  # noqa: BLE001 - every request of the call gets the error
            for job, _ in taken:
                prefilling.remove(job)
                self._finish(job, e)
            return []
        started = []
        for row, (job, n) in zip(logits, taken):
            job.prefill_seconds += eng.stats.prefill_seconds - p0
            job.cursor += n
            if job.cursor < len(job.prompt_ids):
                continue
            prefilling.remove(job)
            try:
                self._start_decoding(job)
            except BaseException as e:  # noqa: BLE001
                self._finish(job, e)
                continue
            if self._sample(job, row):
                started.append(job)
        return started

    def _sample(self, job: _Job, row) -> bool:
        """The job's next token from its logits ``row``; False when it is finished (EOS, stop
        string, limits, or an error reported to the request), which frees its slot."""
        try:
            job.tok = job.state.step(row)
        except BaseException as e:  # noqa: BLE001
            self._finish(job, e)
            return False
        if job.tok is None:
            self._finish(job)
            return False
        return True

    def _loop(self) -> None:
        prefilling: list[_Job] = []
        decoding: list[_Job] = []
        while True:
            while len(prefilling) + len(decoding) < self.max_batch:
                try:
                    job = self.waiting.get(block=not (prefilling or decoding))
                except queue.Empty:
                    break
                job.t0 = time.perf_counter()
                try:
                    if not job.prompt_ids:
                        raise ValueError("the prompt has no tokens")
                    job.sid = self.model.engine.add_sequence()
                except BaseException as e:  # noqa: BLE001 - reported to the request, the loop goes on
                    self._finish(job, e)
                    continue
                prefilling.append(job)
            for group in (prefilling, decoding):
                for job in [j for j in group if j.should_stop()]:
                    group.remove(job)
                    self._cancel(job)
            if prefilling:
                decoding += self._prefill_step(prefilling)
            if not decoding:
                continue
            self.largest_batch = max(self.largest_batch, len(decoding))
            try:
                logits = self.model.engine.decode([j.sid for j in decoding], [j.tok for j in decoding])
            except BaseException as e:  # noqa: BLE001 - every request of the step gets the error
                for job in decoding:
                    self._finish(job, e)
                decoding = []
                continue
            decoding = [job for row, job in zip(logits, decoding) if self._sample(job, row)]


def create_app(model: LoadedModel, model_name: str = "k3"):
    """The FastAPI application serving ``model`` under the name ``model_name``."""

    app = FastAPI(title="k3-compile", description=f"OpenAI-compatible server for {model.model_dir}")
    scheduler = BatchScheduler(model, model.engine.max_slots - 1)  # one slot stays spare
    app.state.scheduler = scheduler

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            where, msg = "", f"the body is not valid JSON ({first.get('ctx', {}).get('error', msg)})"
        return JSONResponse(APIError(400, f"{where}: {msg}" if where else msg, where or None).body(),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):  # unknown route, method
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                     err_type="server_error").body(), status_code=500)

    def check(req) -> None:
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           "model", code="model_not_found")
        _refuse_unsupported(req)

    def encode(fn, *a) -> list[int]:
        """Tokenize (text or a chat) with errors as 400, then check the prompt fits."""
        try:
            ids = fn(*a)
        except (ValueError, TypeError, UnicodeError) as e:
            raise APIError(400, f"cannot tokenize the input: {e}", "prompt") from None
        except Exception as e:  # noqa: BLE001 - e.g. a chat template error (jinja2)
            raise APIError(400, f"cannot render the input: {type(e).__name__}: {e}", "messages") from None
        if not ids:
            raise APIError(400, "the prompt is empty: nothing to condition on", "prompt")
        try:
            model.check_prompt(len(ids))
        except ModelLoadError as e:
            raise APIError(400, str(e), "prompt", code="context_length_exceeded") from None
        return ids

    async def run_watched(request: Request, prompt_ids, params):
        """Generation in the batch; stopped if the client disconnects while it waits."""
        gone = threading.Event()
        fut = asyncio.wrap_future(scheduler.submit(prompt_ids, params, None, gone.is_set))
        while not fut.done():
            await asyncio.wait({fut}, timeout=0.25)
            if not fut.done() and await request.is_disconnected():
                gone.set()
        return fut.result()

    def usage(res) -> dict:
        return {"prompt_tokens": res.prompt_tokens, "completion_tokens": len(res.token_ids),
                "total_tokens": res.prompt_tokens + len(res.token_ids)}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream_response(request: Request, prompt_ids: list[int], params: SamplingParams, chunk):
        """Run the generation in a worker thread; its text pieces become SSE events. A client
        that goes away stops it (checked before every token)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()

        def piece(text: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("piece", text))

        def done(fut: concurrent.futures.Future) -> None:
            exc = fut.exception()
            if exc is None:
                item = ("done", fut.result())
            else:
                log.error("streaming generation failed: %s: %s", type(exc).__name__, exc)
                item = ("error", APIError(500, f"generation failed: {type(exc).__name__}: {exc}",
                                          err_type="server_error"))
            loop.call_soon_threadsafe(queue.put_nowait, item)

        async def events():
            scheduler.submit(prompt_ids, params, piece, gone.is_set).add_done_callback(done)
            head = chunk(None, None, first=True)
            if head is not None:  # chat: the role comes first
                yield sse(head)
            try:
                while True:
                    try:
                        kind, val = await asyncio.wait_for(queue.get(), timeout=0.25)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                    if kind == "piece":
                        yield sse(chunk(val, None))
                    elif kind == "done":
                        yield sse(chunk(None, val.finish_reason, res=val))
                        break
                    else:
                        yield sse(val.body())
                        break
                yield "data: [DONE]\n\n"
            finally:
                gone.set()  # a client that went away stops the generation at its next token

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "k3-compile"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        params = sampling_params(req, model.generation_defaults, COMPLETION_DEFAULT_MAX_TOKENS)
        if isinstance(prompt, list):  # token ids
            vocab = model.cfg.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
            ids = encode(lambda: list(prompt))
        else:
            ids = encode(model.encode_prompt, prompt)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish, first=False, res=None) -> dict[str, Any] | None:
            if first:
                return None
            out = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                   "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}
            if res is not None:
                out["usage"] = usage(res)
            return out

        if req.stream:
            return stream_response(request, ids, params, chunk)
        res = await run_watched(request, ids, params)
        return chunk(res.text, res.finish_reason, res=res)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check(req)
        params = sampling_params(req, model.generation_defaults, CHAT_DEFAULT_MAX_TOKENS)
        ids = encode(model.tokenizer.encode_chat, [m.as_template_message() for m in req.messages])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish, first=False, res=None) -> dict[str, Any]:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if res is not None:
                out["usage"] = usage(res)
            return out

        if req.stream:
            return stream_response(request, ids, params, chunk)
        res = await run_watched(request, ids, params)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                             "finish_reason": res.finish_reason}],
                "usage": usage(res)}

    return app


def serve(model: LoadedModel, host: str, port: int, model_name: str = "k3") -> None:
    """Run the server until interrupted (uvicorn, one worker: the model lives in this process)."""
    import uvicorn

    uvicorn.run(create_app(model, model_name), host=host, port=port, log_level="info")
