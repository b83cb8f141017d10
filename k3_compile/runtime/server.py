"""OpenAI-compatible HTTP server over one loaded model (``k3 serve``).

Endpoints (the OpenAI API's shapes, as vLLM and MLC-LLM serve them):

- ``GET /v1/models`` — the one served model.
- ``POST /v1/completions`` — ``prompt`` (a string, or a list holding one string) → text.
- ``POST /v1/chat/completions`` — ``messages`` rendered with the model's chat template.
- ``GET /health`` — 200 once the model is loaded.

Both generation endpoints take ``max_tokens`` (chat also ``max_completion_tokens``),
``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``seed``, ``stop`` (string or
list), ``ignore_eos`` and ``stream`` (server-sent events ending with ``data: [DONE]``); other
OpenAI fields are accepted and ignored, except ``n`` > 1 (refused). Unset sampling fields take
the model's ``generation_config.json`` values, as ``k3 generate`` does (greedy when it does not
ask for sampling); ``max_tokens`` defaults to 16 for completions (the OpenAI default) and 512
for chat.

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed body, a bad field or a prompt that does not fit the context window, 404 for an
unknown model, 500 (logged) for a failure inside the runtime; the server stays up.

Requests are served one at a time (a lock around the engine; the others wait), each on its own
engine sequence. A streaming request whose client goes away stops at its next token.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .model_runner import LoadedModel, ModelLoadError
from .sampler import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 512


class _Cancelled(Exception):
    """Raised from the stream callback when the client of a streaming request went away."""


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, err_type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Sampling(BaseModel):
    """Fields common to both generation endpoints (unknown OpenAI fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def sampling_params(req, defaults: dict, default_max: int) -> SamplingParams:
    """SamplingParams of a request: its fields, else the model's generation_config.json values
    (``defaults``), else greedy; ``max_tokens`` (or chat's ``max_completion_tokens``) else
    ``default_max``.

    Raises:
        APIError(400): a value SamplingParams rejects.
    """
    temperature = req.temperature
    if temperature is None:
        temperature = float(defaults.get("temperature", 1.0)) if defaults.get("do_sample") else 0.0
    max_tokens = req.max_tokens or getattr(req, "max_completion_tokens", None) or default_max
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=req.top_p if req.top_p is not None else float(defaults.get("top_p", 1.0)),
            top_k=req.top_k if req.top_k is not None else int(defaults.get("top_k", 0)),
            repetition_penalty=(req.repetition_penalty if req.repetition_penalty is not None
                                else float(defaults.get("repetition_penalty", 1.0))),
            seed=req.seed, max_tokens=max_tokens, stop=tuple(stop), ignore_eos=req.ignore_eos)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def create_app(model: LoadedModel, model_name: str = "k3"):
    """The FastAPI application serving ``model`` under the name ``model_name``."""

    app = FastAPI(title="k3-compile", description=f"OpenAI-compatible server for {model.model_dir}")
    lock = threading.Lock()  # the engine serves one request at a time

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

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "model", code="model_not_found")

    def precheck(prompt_ids: list[int]) -> None:
        """400 before anything runs (a stream has already answered 200 when it starts)."""
        if not prompt_ids:
            raise APIError(400, "the prompt is empty: nothing to condition on", "prompt")
        try:
            model.check_prompt(len(prompt_ids))
        except ModelLoadError as e:
            raise APIError(400, str(e), "prompt") from None

    def run(prompt_ids: list[int], params: SamplingParams, stream=None):
        with lock:
            try:
                return model.generate(prompt_ids, params, stream)
            except ModelLoadError as e:  # prompt empty or too long for the context window
                raise APIError(400, str(e), "prompt") from None

    def usage(res) -> dict:
        return {"prompt_tokens": res.prompt_tokens, "completion_tokens": len(res.token_ids),
                "total_tokens": res.prompt_tokens + len(res.token_ids)}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream_response(prompt_ids: list[int], params: SamplingParams, chunk):
        """Run the generation in a worker thread; its text pieces become SSE events."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()

        def piece(text: str) -> None:
            if gone.is_set():
                raise _Cancelled()
            loop.call_soon_threadsafe(queue.put_nowait, ("piece", text))

        def work():
            try:
                res = run(prompt_ids, params, piece)
                loop.call_soon_threadsafe(queue.put_nowait, ("done", res))
            except _Cancelled:
                loop.call_soon_threadsafe(queue.put_nowait, ("cancelled", None))
            except APIError as e:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))
            except Exception as e:  # noqa: BLE001 - reported to the client, the server stays up
                loop.call_soon_threadsafe(queue.put_nowait, ("error", APIError(500, f"generation failed: {e}",
                                                                                   err_type="server_error")))

        async def events():
            threading.Thread(target=work, daemon=True).start()
            head = chunk(None, None, first=True)
            if head is not None:  # chat: the role comes first
                yield sse(head)
            try:
                while True:
                    kind, val = await queue.get()
                    if kind == "piece":
                        yield sse(chunk(val, None))
                    elif kind == "done":
                        yield sse(chunk(None, val.finish_reason, res=val))
                        break
                    elif kind == "error":
                        yield sse(val.body())
                        break
                    else:
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
    async def completions(req: CompletionRequest):
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        params = sampling_params(req, model.generation_defaults, COMPLETION_DEFAULT_MAX_TOKENS)
        ids = model.encode_prompt(prompt)
        precheck(ids)
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
            return stream_response(ids, params, chunk)
        res = await asyncio.to_thread(run, ids, params)
        body = chunk(res.text, res.finish_reason, res=res)
        return body

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        check_model(req.model)
        params = sampling_params(req, model.generation_defaults, CHAT_DEFAULT_MAX_TOKENS)
        ids = model.tokenizer.encode_chat([m.model_dump() for m in req.messages])
        precheck(ids)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish, first=False, res=None) -> dict[str, Any]:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if res is not None:
                out["usage"] = usage(res)
            return out

        if req.stream:
            return stream_response(ids, params, chunk)
        res = await asyncio.to_thread(run, ids, params)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                             "finish_reason": res.finish_reason}],
                "usage": usage(res)}

    return app


def serve(model: LoadedModel, host: str, port: int, model_name: str = "k3") -> None:
    """Run the server until interrupted (uvicorn, one worker: the model lives in this process)."""
    import uvicorn

    uvicorn.run(create_app(model, model_name), host=host, port=port, log_level="info")
