"""The OpenAI-compatible server (k3_compile/runtime/server.py) on k3-nano (CPU library), through
FastAPI's test client: the answers equal the runtime's own generation, streaming gives the same
text, bad requests get 4xx with an OpenAI-style error and the server keeps answering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3_compile.cli import main

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "models" / "k3-nano"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from k3_compile.runtime.model_runner import load_model

    lib = tmp_path_factory.mktemp("srv") / "lib.so"
    assert main(["compile", str(NANO), "--target", "llvm", "-o", str(lib), "--dtype", "float32", "--quiet"]) == 0
    return load_model(NANO, lib, "cpu", context_window=256)


@pytest.fixture(scope="module")
def client(model):
    from fastapi.testclient import TestClient

    from k3_compile.runtime.server import create_app

    return TestClient(create_app(model, "nano"))


def _events(resp) -> list:
    lines = [ln for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["nano"]


def test_completion_equals_the_runtime_and_streams_the_same_text(client, model):
    from k3_compile.runtime.sampler import SamplingParams

    want = model.generate(model.encode_prompt(PROMPT), SamplingParams(temperature=0, max_tokens=12))
    r = client.post("/v1/completions", json={"model": "nano", "prompt": PROMPT, "max_tokens": 12,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == want.text
    assert body["choices"][0]["finish_reason"] == want.finish_reason
    assert body["usage"] == {"prompt_tokens": len(model.encode_prompt(PROMPT)),
                             "completion_tokens": len(want.token_ids),
                             "total_tokens": len(model.encode_prompt(PROMPT)) + len(want.token_ids)}
    r = client.post("/v1/completions", json={"prompt": [PROMPT], "max_tokens": 12, "temperature": 0,
                                              "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = _events(r)
    assert "".join(e["choices"][0]["text"] for e in ev) == want.text
    assert ev[-1]["choices"][0]["finish_reason"] == want.finish_reason and "usage" in ev[-1]


def test_chat_completion_and_stream(client, model):
    from k3_compile.runtime.sampler import SamplingParams

    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Say hi."}]
    want = model.generate(model.tokenizer.encode_chat(msgs), SamplingParams(temperature=0, max_tokens=8))
    r = client.post("/v1/chat/completions", json={"model": "nano", "messages": msgs, "max_tokens": 8,
                                                   "temperature": 0, "user": "ignored-field"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 8,
                                                   "temperature": 0, "stream": True})
    ev = _events(r)
    assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev) == want.text


@pytest.mark.parametrize("body,status,field", [
    ("{not json", 400, None),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ('{"prompt": "a\\ud800b"}', 400, "prompt"),  # a lone surrogate, as JSON allows
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": [5, 10 ** 9]}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": "word " * 400}, 400, "prompt"),  # over the 256-token context window
    ({"prompt": "word " * 400, "stream": True}, 400, "prompt"),
])
def test_bad_completion_requests_get_4xx_and_the_server_stays_up(client, body, status, field):
    if isinstance(body, str):
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if field:
        assert field in (err["param"] or "") or field in err["message"]
    ok = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_bad_chat_requests(client):
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_openai_client_variants(client, model):
    """What OpenAI clients send besides the basics: token-id prompts, text parts, the developer
    role, explicit nulls, max_completion_tokens; extreme sampling values stay finite."""
    from k3_compile.runtime.sampler import SamplingParams

    ids = model.encode_prompt(PROMPT)
    a = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0}).json()
    b = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0, "n": None,
                                              "stream": None, "ignore_eos": None}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    want = model.generate(model.tokenizer.encode_chat(msgs), SamplingParams(temperature=0, max_tokens=5))
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": "Hello"}]
    r = client.post("/v1/chat/completions", json={"messages": parts, "max_completion_tokens": 5, "max_tokens": 99,
                                                   "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want.text
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 1,
                                              "top_p": 1e-300, "repetition_penalty": 1e-300, "seed": 1})
    assert r.status_code == 200, r.text


def test_unknown_route_gets_an_openai_error(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_concurrent_requests_are_batched_and_answer_as_alone(client, model):
    """Four requests at once: the scheduler decodes them together (continuous batching) and
    each gets the text it gets alone (greedy)."""
    import threading

    from k3_compile.runtime.sampler import SamplingParams

    prompts = ["def fibonacci(n):", "import os\n", "class Path:", "The json module"]
    want = [model.generate(model.encode_prompt(p), SamplingParams(temperature=0, max_tokens=10)).text
            for p in prompts]
    got = [None] * len(prompts)

    def ask(i):
        r = client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 10, "temperature": 0})
        got[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert client.app.state.scheduler.largest_batch > 1


def test_chunked_prefill_does_not_stall_decoding(model):
    """A long prompt arriving while another request decodes is prefilled a chunk per step, the
    other request's decode steps running in between (not after its whole prefill), and both
    answer as alone (greedy)."""
    import time

    from k3_compile.runtime.sampler import SamplingParams
    from k3_compile.runtime.server import BatchScheduler

    short, long_ = model.encode_prompt("import os\n"), model.encode_prompt("def parse(path):\n    " * 8)
    assert len(long_) > 3 * 16
    params = SamplingParams(temperature=0, max_tokens=12)
    want = [model.generate(ids, params).text for ids in (short, long_)]
    calls = []
    eng = model.engine
    prefill, decode = eng.prefill, eng.decode
    eng.prefill = lambda sids, chunks, **kw: (calls.append(("prefill", list(sids))), prefill(sids, chunks, **kw))[1]
    eng.decode = lambda sids, toks: (calls.append(("decode", list(sids))), decode(sids, toks))[1]
    try:
        sched = BatchScheduler(model, max_batch=2, prefill_chunk=16)
        first_tok = []
        f_short = sched.submit(short, params, stream=lambda piece: first_tok.append(piece))
        while not first_tok and not f_short.done():
            time.sleep(0.001)
        f_long = sched.submit(long_, params)
        got = [f.result(timeout=120).text for f in (f_short, f_long)]
    finally:
        eng.prefill, eng.decode = prefill, decode
    assert got == want
    long_sid = [c[1][0] for c in calls if c[0] == "prefill" and len(c[1]) == 1][-1]
    chunks = [i for i, c in enumerate(calls) if c[0] == "prefill" and long_sid in c[1]]
    assert len(chunks) >= 3  # a chunk of at most 16 tokens per step
    between = [c for c in calls[chunks[0]:chunks[-1]] if c[0] == "decode"]
    assert between and all(long_sid not in c[1] for c in between)  # the short one kept decoding


def test_short_prompt_behind_a_long_one_starts_first(model):
    """A short request arriving while a long prompt is being prefilled is prefilled first
    (shortest remaining prompt first): its first token comes before the long prompt's
    prefill ends, and both answer as alone."""
    import time

    from k3_compile.runtime.sampler import SamplingParams
    from k3_compile.runtime.server import BatchScheduler

    short, long_ = model.encode_prompt("import os\n"), model.encode_prompt("def parse(path):\n    " * 8)
    params = SamplingParams(temperature=0, max_tokens=4)
    want = [model.generate(ids, params).text for ids in (long_, short)]
    calls = []
    eng = model.engine
    prefill = eng.prefill
    sched = BatchScheduler(model, max_batch=2, prefill_chunk=16)

    def logged(sids, chunks, **kw):
        calls.append((list(sids), [len(c) for c in chunks]))
        if len(calls) == 1:  # the short request arrives during the long prompt's first chunk
            futures.append(sched.submit(short, params))
        return prefill(sids, chunks, **kw)

    futures = []
    eng.prefill = logged
    try:
        futures.insert(0, sched.submit(long_, params))
        while len(futures) < 2:
            time.sleep(0.001)
        got = [f.result(timeout=120).text for f in futures]
    finally:
        eng.prefill = prefill
    assert got == want
    short_sid = calls[1][0][0]
    assert calls[1][1][0] == len(short)          # the whole short prompt in the next call
    assert sum(n for sids, ns in calls for s, n in zip(sids, ns) if s != short_sid) == len(long_)
    long_calls = [i for i, (sids, _) in enumerate(calls) if short_sid not in sids]
    assert long_calls[-1] > 1                    # the long prompt was still prefilling then
