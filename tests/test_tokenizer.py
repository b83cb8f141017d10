"""Tests for k3_compile.tokenizer against independent references.

* Kimi (tiktoken.model): ids are checked against a pure-Python BPE written here, fed
  with chunks from the spec §4 regex *verbatim* (class intersections run by the ``regex``
  module in V1 mode) and ranks parsed here from the file. Neither tiktoken nor the
  rewritten pattern of the module is involved in the reference.
* k3-nano (tokenizer.json): ids and chat prompts are checked against transformers.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import regex

from k3_compile.tokenizer import (
    KIMI_PAT_STR,
    KIMI_PAT_STR_SPEC,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)

KIMI_DIR = Path("/work/shared/tokenizers/kimi")
NANO_DIR = Path("/work/shared/models/k3-nano")

needs_kimi = pytest.mark.skipif(not (KIMI_DIR / "tiktoken.model").is_file(), reason="Kimi tokenizer not available")
needs_nano = pytest.mark.skipif(not (NANO_DIR / "tokenizer.json").is_file(), reason="k3-nano not available")

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 2024; we'll see, they've said.",
    "chinese": "月之暗面发布了新模型。你好，世界！今天天气很好，我们去公园散步吧。",
    "code": 'def fib(n: int) -> int:\n    """Return F(n)."""\n    if n < 2:\n        return n\n'
    "    return fib(n - 1) + fib(n - 2)\n\n\nprint({k: v for k, v in zip(\"ab\", [1, 22, 333, 4444])})\r\n",
    "emoji": "Party 🎉🎊 family 👨‍👩‍👧‍👦 flags 🇯🇵🇨🇳 skin 👍🏽 ✨",
    "mixed": "Kimi K3模型uses KDA注意力 and MoE专家 (896个experts)。Café naïve Ünïcödé — "
    "Москва ĲsselMeer ǅemal テスト 한국어 हिन्दी 々〇⺀ 1234567 \t\n\n  end   ",
}


# ----------------------------------------------------------------- independent reference


def _read_ranks_reference(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split(" ")
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _reference_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Byte-pair merging: repeatedly merge the adjacent pair whose merge has the lowest rank."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return [ranks[p] for p in parts]


def _spec_chunks(text: str) -> list[str]:
    """The spec §4 regex exactly as written; ``(?V1)`` turns on ``&&`` set intersection."""
    return regex.findall("(?V1)" + KIMI_PAT_STR_SPEC, text)


@pytest.fixture(scope="module")
def kimi() -> Tokenizer:
    return load_tokenizer(KIMI_DIR)


@pytest.fixture(scope="module")
def kimi_ranks() -> dict[bytes, int]:
    return _read_ranks_reference(KIMI_DIR / "tiktoken.model")


@pytest.fixture(scope="module")
def nano() -> Tokenizer:
    return load_tokenizer(NANO_DIR)


# ----------------------------------------------------------------- regex


def test_regex_classes_equal_spec_intersections_on_every_code_point():
    """The negated-class rewrite selects exactly the code points of the spec's A && [^Han]."""
    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    pairs = [
        (r"[^\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{Han}]", r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"),
        (r"[^\p{Lu}\p{Lt}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{Han}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"),
    ]
    for mine, spec in pairs:
        assert mine in KIMI_PAT_STR
        assert regex.findall(mine, every) == regex.findall("(?V1)" + spec, every)
    upper_spec = regex.compile("(?V1)" + pairs[0][1])
    # Sanity of the reference itself: V1 really intersects (Han letters are out, others in).
    assert upper_spec.match("É") and upper_spec.match("テ") and upper_spec.match("ǅ")
    assert not upper_spec.match("中") and not upper_spec.match("々") and not upper_spec.match("&")


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_pattern_chunks_equal_spec_regex(name):
    text = TEXTS[name]
    assert regex.findall(KIMI_PAT_STR, text) == _spec_chunks(text)


def test_han_splits_from_latin():
    assert _spec_chunks("Hello世界abc") == ["Hello", "世界", "abc"]
    assert regex.findall(KIMI_PAT_STR, "Hello世界abc") == ["Hello", "世界", "abc"]
    assert regex.findall(KIMI_PAT_STR, "KDA注意力 Kimi's") == ["KDA", "注意力", " Kimi's"]
    # The plain cl100k-style letter class would keep them together.
    assert regex.findall(r"\p{L}+", "Hello世界abc") == ["Hello世界abc"]


def _tiktoken_chunks(pat_str: str, text: str) -> list[str]:
    """How tiktoken's own regex engine splits ``text`` under ``pat_str``.

    The rank table holds every byte substring of ``text``, so BPE maps each regex chunk
    to a single token and the tokens show the chunks.
    """
    import tiktoken

    data = text.encode()
    ranks = {bytes([b]): b for b in range(256)}
    for length in range(2, len(data) + 1):
        for start in range(len(data) - length + 1):
            ranks.setdefault(data[start : start + length], len(ranks))
    enc = tiktoken.Encoding(name="chunks", pat_str=pat_str, mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(t).decode() for t in enc.encode(text)]


@needs_kimi
@pytest.mark.parametrize("name", ["chinese", "mixed"])
def test_tiktoken_engine_chunks_equal_spec_regex(kimi, name):
    """The pattern the Kimi tokenizer actually hands tiktoken splits like the spec regex."""
    text = TEXTS[name]
    assert _tiktoken_chunks(kimi._enc._pat_str, text) == _spec_chunks(text)
    assert _tiktoken_chunks(kimi._enc._pat_str, "Hello世界abc 中文") == ["Hello", "世界", "abc", " ", "中文"]


@needs_kimi
def test_tiktoken_tokens_respect_han_boundaries(kimi):
    text = "Hello世界abc中文KDA"
    ids = kimi.encode(text)
    offsets, pos = set(), 0
    for i in ids:
        pos += len(kimi.token_bytes(i))
        offsets.add(pos)
    for boundary in ("Hello", "Hello世界", "Hello世界abc", "Hello世界abc中文"):
        assert len(boundary.encode()) in offsets, boundary


# ----------------------------------------------------------------- Kimi tiktoken


@needs_kimi
def test_kimi_file_is_the_spec_file():
    digest = hashlib.sha256((KIMI_DIR / "tiktoken.model").read_bytes()).hexdigest()
    assert digest.startswith("b6c497a7") and digest.endswith("0c5103")


@needs_kimi
def test_kimi_sizes_and_special_ids(kimi):
    assert kimi.backend == "tiktoken"
    assert kimi.vocab_size == 163_840
    expected = {
        "[BOS]": 163584,
        "[EOS]": 163585,
        "<|im_end|>": 163586,
        "<|im_user|>": 163587,
        "<|im_assistant|>": 163588,
        "<|im_system|>": 163594,
        "<|im_middle|>": 163601,
        "[PAD]": 163839,
    }
    for token, token_id in expected.items():
        assert kimi.token_to_id(token) == token_id
        assert kimi.id_to_token(token_id) == token
    assert kimi.bos_id == 163584
    assert kimi.eos_ids == [163585, 163586]
    assert kimi.pad_id == 163839
    assert kimi.id_to_token(163589) == "<|reserved_token_163589|>"
    assert kimi.id_to_token(163837) == "<|reserved_token_163837|>"
    assert kimi.add_bos_token is False
    assert kimi.encode("hi") == kimi.encode("hi", add_bos=False)
    assert kimi.encode("hi", add_bos=True)[0] == 163584
    with pytest.raises(IndexError):
        kimi.id_to_token(163840)
    with pytest.raises(KeyError):
        kimi.token_to_id("<|no_such_token|>")


@needs_kimi
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_kimi_ids_equal_reference_bpe(kimi, kimi_ranks, name):
    text = TEXTS[name]
    expected = [i for chunk in _spec_chunks(text) for i in _reference_bpe(chunk.encode(), kimi_ranks)]
    ids = kimi.encode(text)
    assert ids == expected
    assert kimi.decode(ids) == text


@needs_kimi
def test_kimi_round_trips_and_byte_tokens(kimi, kimi_ranks):
    for text in TEXTS.values():
        assert kimi.decode(kimi.encode(text)) == text
    assert kimi.decode(kimi.encode("".join(TEXTS.values()))) == "".join(TEXTS.values())
    # id_to_token uses the byte-level alphabet; token_to_id inverts it.
    space_the = kimi_ranks[b" the"]
    assert kimi.id_to_token(space_the) == "Ġthe"
    assert kimi.token_to_id("Ġthe") == space_the
    assert kimi.encode(" the") == [space_the]


@needs_kimi
def test_kimi_tiktoken_accepts_verbatim_spec_pattern_with_same_result(kimi, kimi_ranks):
    """tiktoken's own engine runs the intersection form; ids agree with the rewrite."""
    import tiktoken

    enc = tiktoken.Encoding(
        name="spec-verbatim", pat_str=KIMI_PAT_STR_SPEC, mergeable_ranks=kimi_ranks, special_tokens={}
    )
    for text in TEXTS.values():
        assert enc.encode(text) == kimi.encode(text)


@needs_kimi
def test_kimi_special_text_is_plain_unless_allowed(kimi):
    text = "x<|im_end|>y[BOS]"
    plain = kimi.encode(text)
    assert 163586 not in plain and 163584 not in plain
    assert kimi.decode(plain) == text
    special = kimi.encode(text, allow_special=True)
    assert special == kimi.encode("x") + [163586] + kimi.encode("y") + [163584]
    assert kimi.decode(special) == text
    assert kimi.decode(special, skip_special=True) == "xy"


@needs_kimi
def test_kimi_chat_template(kimi):
    prompt = kimi.apply_chat_template([{"role": "user", "content": "你好"}])
    assert prompt == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
        "<|im_user|>user<|im_middle|>你好<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    ids = kimi.encode_chat([{"role": "user", "content": "你好"}])
    assert ids[:1] == [163594] and ids[-3:] == [163588, kimi.encode("assistant")[0], 163601]


@needs_kimi
def test_kimi_long_runs_are_split_and_round_trip(kimi):
    text = "a" * 30_000 + " " * 30_000 + "b"
    assert kimi.decode(kimi.encode(text)) == text


# ----------------------------------------------------------------- k3-nano (HF tokenizers)


NANO_TEXTS = [
    "import os\n\ndef main(argv=None):\n    return os.path.join('a', \"b\")\n",
    ".. versionadded:: 3.3\n\n   The :func:`open` function now accepts *mode*.",
    "你好，世界！ emoji 🎉👍🏽 mixed Ünïcödé",
    "   leading spaces\t\ttabs\r\nCRLF   ",
    "",
]


@needs_nano
def test_nano_special_ids(nano):
    assert nano.backend == "tokenizers"
    assert nano.vocab_size == 8192
    expected = {
        "[BOS]": 8184,
        "[EOS]": 8185,
        "<|im_end|>": 8186,
        "<|im_user|>": 8187,
        "<|im_assistant|>": 8188,
        "<|im_system|>": 8189,
        "<|im_middle|>": 8190,
        "[PAD]": 8191,
    }
    for token, token_id in expected.items():
        assert nano.token_to_id(token) == token_id
        assert nano.id_to_token(token_id) == token
    assert nano.bos_id == 8184
    assert nano.eos_ids == [8185, 8186]
    assert nano.pad_id == 8191


@needs_nano
def test_nano_ids_equal_transformers(nano):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(NANO_DIR / "tokenizer.json"))
    for text in NANO_TEXTS:
        reference = hf(text, add_special_tokens=False)["input_ids"]
        # add_bos_token is true in tokenizer_config.json: BOS first, by default.
        assert nano.encode(text) == [8184] + reference
        assert nano.encode(text, add_bos=False) == reference
        assert nano.decode(reference) == hf.decode(reference)
    # Special-token text: parsed as special only when allowed.
    text = "a<|im_end|>b"
    assert nano.encode(text, add_bos=False, allow_special=True) == hf(text, add_special_tokens=False)["input_ids"]
    plain = nano.encode(text, add_bos=False)
    assert 8186 not in plain and nano.decode(plain) == text
    assert plain == hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


@needs_nano
def test_nano_chat_template_equals_transformers(nano):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(NANO_DIR))
    chats = [
        [{"role": "user", "content": "Write a list comprehension."}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "你好 🎉"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Again\n  with  spaces "},
        ],
    ]
    for chat in chats:
        for gen in (True, False):
            expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert nano.apply_chat_template(chat, add_generation_prompt=gen) == expected
        expected_ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert nano.encode_chat(chat) == list(expected_ids)
    assert nano.apply_chat_template(chats[0]).endswith("<|im_assistant|>assistant<|im_middle|>")


@needs_nano
def test_chat_template_environment_follows_transformers(tmp_path):
    """trim/lstrip blocks, raise_exception, non-escaping tojson, as transformers' environment."""
    from transformers import PreTrainedTokenizerFast

    shutil.copy(NANO_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    template = (
        "{% for m in messages %}\n"
        "    {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
        "    [{{ m['role'] }}|{{ m['content'] | tojson }}]\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ bos_token }}{% endif %}"
    )
    config = {"bos_token": "[BOS]", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    mine = load_tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="[BOS]")
    chat = [{"role": "user", "content": "<b>&\"é\""}, {"role": "assistant", "content": "ok", "tool_calls": None}]
    assert mine.apply_chat_template(chat) == hf.apply_chat_template(
        chat, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="bad role system"):
        mine.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError):
        mine.apply_chat_template([])


# ----------------------------------------------------------------- streaming


@needs_kimi
def test_stream_decoder_kimi(kimi):
    for text in (TEXTS["chinese"], TEXTS["emoji"], TEXTS["mixed"]):
        ids = kimi.encode(text)
        decoder = StreamDecoder(kimi)
        pieces = [decoder.feed(i) for i in ids]
        pieces.append(decoder.flush())
        assert "".join(pieces) == kimi.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    # An emoji split across byte tokens only appears once complete.
    ids = kimi.encode("🎉")
    assert len(ids) > 1
    decoder = kimi.stream_decoder()
    assert [decoder.feed(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]
    # An unfinished character at the end flushes as U+FFFD, like decode().
    decoder = kimi.stream_decoder()
    assert decoder.feed(ids[0]) == "" and decoder.pending
    assert decoder.flush() == kimi.decode(ids[:1]) == "\ufffd"


@needs_kimi
def test_stream_decoder_skip_special(kimi):
    ids = kimi.encode("<|im_user|>你好<|im_end|>", allow_special=True)
    decoder = kimi.stream_decoder(skip_special=True)
    assert decoder.feed_many(ids) + decoder.flush() == kimi.decode(ids, skip_special=True) == "你好"


@needs_nano
def test_stream_decoder_nano(nano):
    for text in NANO_TEXTS + ["<|im_user|>月之暗面 🎉👨‍👩‍👧<|im_end|>"]:
        ids = nano.encode(text, allow_special=True)
        decoder = nano.stream_decoder()
        streamed = "".join(decoder.feed(i) for i in ids) + decoder.flush()
        assert streamed == nano.decode(ids)
        decoder = nano.stream_decoder(skip_special=True)
        streamed = "".join(decoder.feed(i) for i in ids) + decoder.flush()
        assert streamed == nano.decode(ids, skip_special=True)


# ----------------------------------------------------------------- bad input


def test_missing_files(tmp_path):
    with pytest.raises(TokenizerError, match="tiktoken.model.*tokenizer.json") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "nope")


def _small_tiktoken_dir(tmp_path: Path, extra_lines: list[str]) -> Path:
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines + extra_lines) + "\n")
    return tmp_path


def test_small_tiktoken_dir_loads(tmp_path):
    d = _small_tiktoken_dir(tmp_path, [f"{base64.b64encode(b'ab').decode()} 256"])
    tok = load_tokenizer(d)
    assert tok.vocab_size == 257 + 256
    assert tok.encode("abab") == [256, 256]
    assert tok.bos_id is None and tok.eos_ids == []
    assert tok.id_to_token(257) == "<|reserved_token_257|>"


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("YWI= 256 extra", "expected '<base64 token> <rank>'"),
        ("@@notbase64@@ 256", "not valid base64"),
        ("YWI= x256", "not a non-negative integer"),
        ("YQ== 256", "already has rank"),
        ("YWI= 7", "rank 7 already used on line 8"),
        ("YWI= 300", "rank 256 is missing"),
    ],
)
def test_corrupt_tiktoken_line(tmp_path, bad_line, message):
    d = _small_tiktoken_dir(tmp_path, [bad_line])
    with pytest.raises(TokenizerError, match=regex.escape(message)) as info:
        load_tokenizer(d)
    text = str(info.value)
    assert "tiktoken.model" in text
    if "missing" not in message:
        assert "tiktoken.model:257:" in text  # the bad line's number


def test_bad_tokenizer_config(tmp_path):
    d = _small_tiktoken_dir(tmp_path, [])
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "[X]"}}}))
    with pytest.raises(TokenizerError, match=r"added_tokens_decoder\['5'\].*reserved special range"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[NOPE]"}))
    with pytest.raises(TokenizerError, match="'bos_token' names '\\[NOPE\\]'"):
        load_tokenizer(d)


def test_bad_ids(tmp_path):
    d = _small_tiktoken_dir(tmp_path, [])
    tok = load_tokenizer(d)
    with pytest.raises(ValueError, match="outside"):
        tok.decode([0, 10_000])
    with pytest.raises(TypeError):
        tok.decode(["a"])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_split_long_runs():
    from k3_compile.tokenizer import _split_long_runs

    text = "a" * 7 + " " * 3 + "bb" + "\n" * 8
    pieces = list(_split_long_runs(text, 3))
    assert pieces == ["aaa", "aaa", "a   bb\n\n\n", "\n\n\n", "\n\n"]
    assert list(_split_long_runs("ab  c", 3)) == ["ab  c"]
