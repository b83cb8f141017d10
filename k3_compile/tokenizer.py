"""Tokenizers for Kimi K3 checkpoints: Kimi's tiktoken BPE and HF ``tokenizers`` JSON.

:func:`load_tokenizer` picks the backend from what a model directory holds:

* ``tiktoken.model`` → the Kimi byte-level BPE (spec §4): 163,584 ranks read from the
  file, then 256 reserved special ids (163584..163839). Named special tokens come from
  ``tokenizer_config.json`` ``added_tokens_decoder``; the unnamed reserved ids are called
  ``<|reserved_token_N|>`` (N = the id). Pre-tokenization uses :data:`KIMI_PAT_STR`.
* ``tokenizer.json`` → a HF ``tokenizers`` tokenizer (k3-nano's byte-level BPE).

Both share one API (:class:`Tokenizer`): ``encode``/``decode``, the special ids
(``bos_id``, ``eos_ids``, ``pad_id``), ``token_to_id``/``id_to_token``, a Jinja2 chat
template renderer that follows ``transformers``' conventions, and :class:`StreamDecoder`
for streaming detokenization.

The pre-tokenization regex
--------------------------
Moonshot's ``tokenization_kimi.py`` hands the regex of spec §4, whose letter classes are
written as set intersections (``[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]``), to
``tiktoken.Encoding`` verbatim. That works only because tiktoken's Rust engine
(fancy-regex over regex-syntax) implements ``&&`` class intersection; Python's ``re``
reads ``&&`` as two literal ampersands, and the ``regex`` module needs ``(?V1)``.
:data:`KIMI_PAT_STR` states the same sets without set operations, as negated classes
over the General Category partition of Unicode (every code point is in exactly one of
Lu Ll Lt Lm Lo M N P S Z C, with unassigned code points in C):

* (Lu ∪ Lt ∪ Lm ∪ Lo ∪ M) ∖ Han = ``[^\\p{Ll}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{Han}]``
* (Ll ∪ Lm ∪ Lo ∪ M) ∖ Han      = ``[^\\p{Lu}\\p{Lt}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{Han}]``

so it runs unchanged in tiktoken, the ``regex`` module, Rust ``regex`` and Oniguruma.
The test suite checks the two forms select the same code points and split text the same.

Errors: every problem with the files raises :class:`TokenizerError` naming the file
(and line or field); bad arguments raise ``TypeError``/``ValueError``.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import functools
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "KIMI_PAT_STR",
    "KIMI_PAT_STR_SPEC",
    "NUM_RESERVED_SPECIAL_TOKENS",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]

# --------------------------------------------------------------------------- regex

_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
# (Lu | Lt | Lm | Lo | M) minus Han, written as the complement of the other categories.
_UPPERISH_NOT_HAN = r"[^\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{Han}]"
# (Ll | Lm | Lo | M) minus Han.
_LOWERISH_NOT_HAN = r"[^\p{Lu}\p{Lt}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{Han}]"
_NOT_LETTER_DIGIT_NEWLINE = r"[^\r\n\p{L}\p{N}]"

#: Kimi's pre-tokenization regex (spec §4) without class intersections; see module doc.
KIMI_PAT_STR: str = "|".join(
    [
        r"[\p{Han}]+",
        f"{_NOT_LETTER_DIGIT_NEWLINE}?{_UPPERISH_NOT_HAN}*{_LOWERISH_NOT_HAN}+{_CONTRACTION}",
        f"{_NOT_LETTER_DIGIT_NEWLINE}?{_UPPERISH_NOT_HAN}+{_LOWERISH_NOT_HAN}*{_CONTRACTION}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

#: The regex exactly as spec §4 writes it (needs ``&&`` class intersection support:
#: tiktoken's engine, Rust ``regex``, or the ``regex`` module with ``(?V1)``).
#: Kept as the reference the tests compare :data:`KIMI_PAT_STR` with.
KIMI_PAT_STR_SPEC: str = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

#: Special-token slots that follow the BPE ranks in a Kimi tiktoken vocabulary.
NUM_RESERVED_SPECIAL_TOKENS = 256

# Long inputs are cut before they reach tiktoken, as Moonshot's tokenizer does: into
# pieces of at most this many characters ...
_MAX_ENCODE_CHARS = 400_000
# ... and wherever a run of only-whitespace or only-non-whitespace characters grows past
# this length (tiktoken's regex/BPE get slow or overflow on huge single pieces).
_MAX_SAME_KIND_RUN = 25_000

TIKTOKEN_FILE = "tiktoken.model"
HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
IM_END = "<|im_end|>"


class TokenizerError(ValueError):
    """A tokenizer file that is missing, malformed or inconsistent.

    The message names the directory or file, and the line or field at fault.
    """


# --------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: each byte → one printable character.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves;
    the other 68 bytes get the characters U+0100, U+0101, ... in byte order. This is the
    token-string convention of HF byte-level BPE and of ``tokenization_kimi.py``.
    """
    kept = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_unicode().items()}


def _bytes_to_token_string(data: bytes) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in data)


def _token_string_to_bytes(token: str) -> bytes | None:
    table = _unicode_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return None


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    """Read a JSON object from ``path``; ``None`` if absent and not ``required``.

    Raises:
        TokenizerError: the file is required but missing, is not valid JSON, or is not
            a JSON object.
    """
    if not path.is_file():
        if required:
            raise TokenizerError(f"{path}: file not found")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, path: Path, field: str) -> str | None:
    """A special-token field of tokenizer_config.json: a string, an AddedToken dict or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: field {field!r} must be a string or {{'content': str}}, got {value!r}")


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Cut ``text`` wherever a run of same-kind characters (whitespace or not) exceeds ``max_run``.

    Each yielded piece contains no run of more than ``max_run`` characters that are all
    whitespace or all non-whitespace; the pieces concatenate back to ``text``.
    """
    if not _long_run_re(max_run).search(text):  # fast path: nothing to cut
        yield text
        return
    start = 0
    run_len = 0
    run_is_space: bool | None = None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if is_space == run_is_space:
            run_len += 1
        else:
            run_is_space = is_space
            run_len = 1
        if run_len > max_run:
            yield text[start:i]
            start = i
            run_len = 1
    yield text[start:]


@functools.lru_cache(maxsize=4)
def _long_run_re(max_run: int) -> re.Pattern[str]:
    # Python's str-pattern \s matches exactly the characters for which str.isspace() is true.
    return re.compile(rf"\s{{{max_run + 1}}}|\S{{{max_run + 1}}}")


def _plain_copy(value: Any) -> Any:
    """Deep copy of JSON-like chat data (dicts, lists, tuples, scalars) for the template."""
    if isinstance(value, Mapping):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_copy(v) for v in value)
    return value


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str):
    """Compile a chat template the way ``transformers`` does.

    A sandboxed, immutable Jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``,
    the ``loopcontrols`` extension, a ``{% generation %}`` block (rendered as its body),
    a ``tojson`` filter that does not HTML-escape (``ensure_ascii=False``), and the globals
    ``raise_exception(msg)`` (raises ``jinja2.TemplateError``) and ``strftime_now(fmt)``.
    """
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# --------------------------------------------------------------------------- API


class Tokenizer:
    """Common tokenizer API over the tiktoken and HF ``tokenizers`` backends.

    Build one with :func:`load_tokenizer`. Attributes:

    * ``backend`` (str): ``"tiktoken"`` or ``"tokenizers"``.
    * ``model_dir`` (Path): the directory it was loaded from.
    * ``bos_id`` (int | None), ``eos_ids`` (list[int], stop ids in order: config
      ``eos_token``, ``<|im_end|>``, then generation_config ``eos_token_id``),
      ``pad_id`` (int | None), ``vocab_size`` (int, including special ids).
    * ``add_bos_token`` (bool): tokenizer_config ``add_bos_token`` (default False).
    * ``chat_template`` (str | None): tokenizer_config ``chat_template``.
    """

    backend: str = ""

    def __init__(self, model_dir: Path, config: dict[str, Any], generation_config: dict[str, Any] | None):
        self.model_dir = model_dir
        self._config = config
        self._config_path = model_dir / TOKENIZER_CONFIG_FILE
        self._gen_path = model_dir / GENERATION_CONFIG_FILE
        self._generation_config = generation_config or {}
        add_bos = config.get("add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise TokenizerError(f"{self._config_path}: field 'add_bos_token' must be true/false, got {add_bos!r}")
        self.add_bos_token: bool = add_bos
        template = config.get("chat_template")
        if template is not None and not isinstance(template, (str, list)):
            raise TokenizerError(
                f"{self._config_path}: field 'chat_template' must be a string or a list of named templates"
            )
        self.chat_template: str | list | None = template

    # -- to be provided by backends -------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, special ids included (ids are ``0 .. vocab_size-1``)."""
        raise NotImplementedError

    def _lookup(self, token: str) -> int | None:
        raise NotImplementedError

    def _encode_plain(self, text: str, allow_special: bool) -> list[int]:
        raise NotImplementedError

    def _decode_checked(self, ids: list[int], skip_special: bool) -> str:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str:
        """The token string of ``token_id``.

        BPE tokens use the byte-level alphabet (a leading space shows as ``Ġ``), special
        tokens their content (``[BOS]``, ``<|im_end|>``, ``<|reserved_token_N|>``).

        Raises:
            IndexError: ``token_id`` is outside ``0 .. vocab_size-1``.
        """
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes ``token_id`` contributes to decoded text (special tokens: their content).

        Raises:
            IndexError: ``token_id`` is outside ``0 .. vocab_size-1``.
        """
        raise NotImplementedError

    def is_special(self, token_id: int) -> bool:
        """Whether ``decode(..., skip_special=True)`` drops ``token_id``."""
        return token_id in self._skip_ids

    _skip_ids: frozenset[int] = frozenset()

    # -- shared -----------------------------------------------------------------------

    def _finish_init(self) -> None:
        """Resolve bos/eos/pad from tokenizer_config.json and generation_config.json."""
        cfg, path = self._config, self._config_path
        gen, gpath = self._generation_config, self._gen_path

        def config_token_id(field: str) -> int | None:
            content = _token_content(cfg.get(field), path, field)
            if content is None:
                return None
            token_id = self._lookup(content)
            if token_id is None:
                raise TokenizerError(f"{path}: field {field!r} names {content!r}, which is not in the vocabulary")
            return token_id

        def gen_ids(field: str) -> list[int]:
            value = gen.get(field)
            if value is None:
                return []
            values = value if isinstance(value, list) else [value]
            for v in values:
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < self.vocab_size:
                    raise TokenizerError(
                        f"{gpath}: field {field!r} must be token ids in [0, {self.vocab_size}), got {value!r}"
                    )
            return list(values)

        bos = config_token_id("bos_token")
        if bos is None and gen_ids("bos_token_id"):
            bos = gen_ids("bos_token_id")[0]
        self.bos_id: int | None = bos

        eos: list[int] = []
        first = config_token_id("eos_token")
        if first is not None:
            eos.append(first)
        im_end = self._lookup(IM_END)
        if im_end is not None:
            eos.append(im_end)
        eos.extend(gen_ids("eos_token_id"))
        self.eos_ids: list[int] = list(dict.fromkeys(eos))

        pad = config_token_id("pad_token")
        if pad is None and gen_ids("pad_token_id"):
            pad = gen_ids("pad_token_id")[0]
        self.pad_id: int | None = pad

        if self.add_bos_token and self.bos_id is None:
            raise TokenizerError(f"{path}: 'add_bos_token' is true but no 'bos_token' is set")

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        out = []
        n = self.vocab_size
        for pos, token_id in enumerate(ids):
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                # numpy integers are fine; anything else is not
                try:
                    import numpy as np

                    if isinstance(token_id, np.integer):
                        token_id = int(token_id)
                    else:
                        raise TypeError
                except (ImportError, TypeError):
                    raise TypeError(f"token id at position {pos} is {type(token_id).__name__}, expected int") from None
            if not 0 <= token_id < n:
                raise ValueError(f"token id {token_id} at position {pos} is outside [0, {n})")
            out.append(token_id)
        return out

    def encode(self, text: str, add_bos: bool | None = None, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text to encode.
            add_bos: prepend ``bos_id``; ``None`` follows tokenizer_config ``add_bos_token``.
            allow_special: if True, special-token text in ``text`` (``<|im_end|>``, ``[BOS]``,
                ...) becomes the special id; if False (default) it is encoded as plain text.

        Returns:
            list[int]: the ids.

        Raises:
            TypeError: ``text`` is not a string.
            ValueError: ``add_bos`` is requested but the tokenizer has no BOS token.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        if add_bos is None:
            add_bos = self.add_bos_token
        ids = self._encode_plain(text, allow_special)
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self.model_dir}: add_bos requested but the tokenizer has no bos_token")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD.

        Args:
            ids: token ids (ints in ``0 .. vocab_size-1``).
            skip_special: drop special tokens (those with ``special: true``, and the
                unnamed reserved ids) instead of writing their content.

        Raises:
            TypeError: an id is not an integer.
            ValueError: an id is out of range.
        """
        return self._decode_checked(self._check_ids(ids), skip_special)

    def token_to_id(self, token: str) -> int:
        """Id of a token string (byte-level form for BPE tokens, content for special tokens).

        Raises:
            KeyError: ``token`` is not in the vocabulary.
        """
        token_id = self._lookup(token)
        if token_id is None:
            raise KeyError(f"token {token!r} is not in the vocabulary of {self.model_dir}")
        return token_id

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` over this tokenizer."""
        return StreamDecoder(self, skip_special=skip_special)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """``bos_token``/``eos_token``/``unk_token``/``pad_token``/... strings, as transformers passes
        them to chat templates."""
        out = {}
        for field in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
            content = _token_content(self._config.get(field), self._config_path, field)
            if content is not None:
                out[field] = content
        return out

    def _select_template(self, tools: Any) -> str:
        template = self.chat_template
        if template is None:
            raise TokenizerError(f"{self._config_path}: no 'chat_template' field; cannot render a chat")
        if isinstance(template, str):
            return template
        named = {}
        for entry in template:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(
                    f"{self._config_path}: 'chat_template' list entries must be {{'name': str, 'template': str}}"
                )
            named[entry["name"]] = entry["template"]
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise TokenizerError(f"{self._config_path}: 'chat_template' list has no 'default' template")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with tokenizer_config's ``chat_template``, as transformers does.

        Same environment and variables as ``PreTrainedTokenizerBase.apply_chat_template(...,
        tokenize=False)``: ``messages`` (keys whose value is None dropped), ``tools``,
        ``documents``, ``add_generation_prompt``, the special-token strings (``bos_token``,
        ``eos_token``, ...) and any extra ``kwargs``.

        Args:
            messages: dicts with at least ``role``; ``content`` a string or content blocks.
            add_generation_prompt: append the assistant header.
            tools: JSON-schema tool descriptions (dicts), or None.
            documents: dicts for RAG templates, or None.

        Returns:
            str: the prompt text (special tokens as text; encode it with ``allow_special=True``).

        Raises:
            TokenizerError: the tokenizer has no chat template.
            TypeError: ``messages`` is not a list of dicts.
            ValueError: ``messages`` is empty.
            jinja2.TemplateError: the template rejected the conversation (``raise_exception``).
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
        if len(messages) == 0:
            raise ValueError("cannot apply a chat template to an empty conversation")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise TypeError(f"message {i} is {type(message).__name__}, expected a dict")
            chat.append({k: _plain_copy(v) for k, v in message.items() if v is not None})
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise TypeError("tools must be a list of JSON-schema dicts")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TypeError("documents must be a list of dicts")
        template = _compile_chat_template(self._select_template(tools))
        variables = {**self.special_tokens_map, **kwargs}
        return template.render(
            messages=chat,
            tools=_plain_copy(list(tools)) if tools is not None else None,
            documents=_plain_copy(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Ids of the rendered chat: ``encode(apply_chat_template(...), add_bos=False, allow_special=True)``.

        Matches transformers' ``apply_chat_template(tokenize=True)``: no BOS is added
        beyond what the template writes, and special-token text in the rendered prompt
        (including any inside message contents) becomes special ids.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_bos=False, allow_special=True)

    def __repr__(self) -> str:
        return f"<Tokenizer {self.backend} {self.model_dir} vocab={self.vocab_size}>"


class _TiktokenTokenizer(Tokenizer):
    backend = "tiktoken"

    def __init__(self, model_dir: Path, config: dict[str, Any], generation_config: dict[str, Any] | None):
        super().__init__(model_dir, config, generation_config)
        import tiktoken

        model_path = model_dir / TIKTOKEN_FILE
        ranks = _read_tiktoken_ranks(model_path)
        n_ranks = len(ranks)
        n_total = n_ranks + NUM_RESERVED_SPECIAL_TOKENS

        named: dict[int, tuple[str, bool]] = {}
        decoder = config.get("added_tokens_decoder", {})
        if not isinstance(decoder, dict):
            raise TokenizerError(f"{self._config_path}: field 'added_tokens_decoder' must be an object")
        for key, entry in decoder.items():
            where = f"{self._config_path}: added_tokens_decoder[{key!r}]"
            try:
                token_id = int(key)
            except ValueError:
                raise TokenizerError(f"{where}: key is not an integer id") from None
            if not n_ranks <= token_id < n_total:
                raise TokenizerError(
                    f"{where}: id outside the reserved special range [{n_ranks}, {n_total}) of {model_path.name}"
                )
            if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
                raise TokenizerError(f"{where}: expected an object with a non-empty string 'content'")
            named[token_id] = (entry["content"], bool(entry.get("special", True)))

        specials: dict[str, int] = {}
        skip: set[int] = set()
        for token_id in range(n_ranks, n_total):
            content, is_special = named.get(token_id, (f"<|reserved_token_{token_id}|>", True))
            if content in specials:
                raise TokenizerError(
                    f"{self._config_path}: special token {content!r} is used for ids {specials[content]} and {token_id}"
                )
            specials[content] = token_id
            if is_special:
                skip.add(token_id)

        self._ranks = ranks
        self._specials = specials
        self._special_by_id = {i: s for s, i in specials.items()}
        self._skip_ids = frozenset(skip)
        self._n_vocab = n_total
        self._id_to_bytes: list[bytes] | None = None
        self._enc = tiktoken.Encoding(
            name=f"kimi:{model_path}",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=specials,
            explicit_n_vocab=n_total,
        )
        self._finish_init()

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    def _bytes_table(self) -> list[bytes]:
        if self._id_to_bytes is None:
            table = [b""] * len(self._ranks)
            for data, rank in self._ranks.items():
                table[rank] = data
            self._id_to_bytes = table
        return self._id_to_bytes

    def _lookup(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        data = _token_string_to_bytes(token)
        return None if data is None else self._ranks.get(data)

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._special_by_id:
            return self._special_by_id[token_id]
        if not isinstance(token_id, int) or not 0 <= token_id < len(self._ranks):
            raise IndexError(f"token id {token_id!r} is outside [0, {self._n_vocab})")
        return _bytes_to_token_string(self._bytes_table()[token_id])

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_by_id:
            return self._special_by_id[token_id].encode("utf-8")
        if not isinstance(token_id, int) or not 0 <= token_id < len(self._ranks):
            raise IndexError(f"token id {token_id!r} is outside [0, {self._n_vocab})")
        return self._bytes_table()[token_id]

    def _encode_plain(self, text: str, allow_special: bool) -> list[int]:
        allowed = "all" if allow_special else set()
        ids: list[int] = []
        for start in range(0, len(text), _MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[start : start + _MAX_ENCODE_CHARS], _MAX_SAME_KIND_RUN):
                if piece:
                    ids.extend(self._enc.encode(piece, allowed_special=allowed, disallowed_special=()))
        return ids

    def _decode_checked(self, ids: list[int], skip_special: bool) -> str:
        if skip_special:
            ids = [i for i in ids if i not in self._skip_ids]
        return self._enc.decode_bytes(ids).decode("utf-8", errors="replace")


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one ``<base64 token> <rank>`` per line.

    Returns:
        dict[bytes, int]: token bytes → rank; ranks are exactly ``0 .. n-1``.

    Raises:
        TokenizerError: unreadable file, a malformed line (named by line number), a
            duplicate token or rank, missing ranks, or a missing single-byte token.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read: {exc}") from exc
    ranks: dict[bytes, int] = {}
    by_rank: dict[int, int] = {}  # rank -> line number
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        line = line.strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise TokenizerError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {line[:80]!r}")
        token_b64, rank_text = fields
        try:
            token = base64.b64decode(token_b64, validate=True)
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{path}:{lineno}: token {token_b64[:60]!r} is not valid base64") from None
        if not token:
            raise TokenizerError(f"{path}:{lineno}: empty token")
        if not rank_text.isdigit():
            raise TokenizerError(f"{path}:{lineno}: rank {rank_text[:40]!r} is not a non-negative integer")
        rank = int(rank_text)
        if token in ranks:
            raise TokenizerError(f"{path}:{lineno}: token {token!r} already has rank {ranks[token]}")
        if rank in by_rank:
            raise TokenizerError(f"{path}:{lineno}: rank {rank} already used on line {by_rank[rank]}")
        ranks[token] = rank
        by_rank[rank] = lineno
    if not ranks:
        raise TokenizerError(f"{path}: no ranks found")
    if max(by_rank) != len(ranks) - 1:
        missing = next(r for r in range(len(ranks)) if r not in by_rank)
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps; rank {missing} is missing")
    for b in range(256):
        if bytes([b]) not in ranks:
            raise TokenizerError(f"{path}: no token for the single byte 0x{b:02x} (byte-level BPE needs all 256)")
    return ranks


class _HFTokenizer(Tokenizer):
    backend = "tokenizers"

    def __init__(self, model_dir: Path, config: dict[str, Any], generation_config: dict[str, Any] | None):
        super().__init__(model_dir, config, generation_config)
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / HF_TOKENIZER_FILE
        try:
            self._tok = HFTokenizer.from_file(str(path))
            # A second copy that encodes special-token text as plain text.
            self._tok_plain = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{path}: cannot load HF tokenizer: {exc}") from exc
        self._tok_plain.encode_special_tokens = True
        added = self._tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self._skip_ids = frozenset(i for i, t in added.items() if t.special)
        self._n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self._finish_init()

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    def _lookup(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        token = self._tok.id_to_token(token_id) if isinstance(token_id, int) and token_id >= 0 else None
        if token is None:
            raise IndexError(f"token id {token_id!r} is outside [0, {self._n_vocab})")
        return token

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        token = self.id_to_token(token_id)
        data = _token_string_to_bytes(token)
        if data is None:  # not a byte-level token; fall back to its text
            return token.encode("utf-8")
        return data

    def _encode_plain(self, text: str, allow_special: bool) -> list[int]:
        tok = self._tok if allow_special else self._tok_plain
        return tok.encode(text, add_special_tokens=False).ids

    def _decode_checked(self, ids: list[int], skip_special: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)


class StreamDecoder:
    """Incremental detokenizer for streaming: feed ids one by one, get finished text.

    Token bytes are run through an incremental UTF-8 decoder, so a character whose bytes
    are split across tokens is emitted once all its bytes have arrived; invalid byte
    sequences become U+FFFD as in :meth:`Tokenizer.decode`. The concatenation of every
    :meth:`feed` result and the final :meth:`flush` equals ``decode(ids, skip_special)``.

    Args:
        tokenizer: the :class:`Tokenizer` whose ids are fed.
        skip_special: drop special tokens, as ``decode(..., skip_special=True)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still partial).

        Raises:
            TypeError / ValueError: ``token_id`` is not a valid id of the tokenizer.
        """
        (token_id,) = self.tokenizer._check_ids([token_id])
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def feed_many(self, ids: Iterable[int]) -> str:
        """Feed several ids; return the text they complete."""
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """End of stream: return what is left (U+FFFD for an unfinished character) and reset."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return tail

    @property
    def pending(self) -> bool:
        """Whether bytes of an unfinished character are buffered."""
        return bool(self._utf8.getstate()[0])


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of a model directory.

    ``tiktoken.model`` (Kimi BPE) is used if present, else ``tokenizer.json`` (HF
    ``tokenizers``). ``tokenizer_config.json`` (special tokens, ``add_bos_token``,
    ``chat_template``) and ``generation_config.json`` (extra ``eos_token_id``) are read if
    present.

    Args:
        model_dir: the directory.

    Returns:
        Tokenizer: the loaded tokenizer.

    Raises:
        TokenizerError: the directory does not exist, holds neither tokenizer file, or a
            file is malformed (the message names the file and line/field).
    """
    directory = Path(model_dir)
    if not directory.is_dir():
        raise TokenizerError(f"{directory}: tokenizer directory not found")
    config = _read_json(directory / TOKENIZER_CONFIG_FILE, required=False) or {}
    generation_config = _read_json(directory / GENERATION_CONFIG_FILE, required=False)
    if (directory / TIKTOKEN_FILE).is_file():
        return _TiktokenTokenizer(directory, config, generation_config)
    if (directory / HF_TOKENIZER_FILE).is_file():
        return _HFTokenizer(directory, config, generation_config)
    raise TokenizerError(
        f"{directory}: no tokenizer found; looked for {TIKTOKEN_FILE} (tiktoken BPE) and "
        f"{HF_TOKENIZER_FILE} (HF tokenizers)"
    )
