"""Tokenizers for target models: from an HF directory (its own tokenizer files), or rebuilt from
a GGUF file's vocabulary, merges and chat template with the `tokenizers` library (no torch)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from jaxspec.loading.common import WeightsError

# tokenizer.ggml.token_type values (llama.cpp `llama_token_type`).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes of llama.cpp's BPE pre-tokenizer types beyond GPT-2's own (the ByteLevel default).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


class Tokenizer:
    """A thin wrapper over a `transformers` fast tokenizer with the few calls the engine needs."""

    def __init__(self, hf_tokenizer, extra_eos_ids: Iterable[int] = ()):
        self.hf = hf_tokenizer
        eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        self.eos_token_ids: Tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_ids]))
        # The `tokenizers` backend decodes as the wrapper does when it cleans up no spaces, and
        # the wrapper's own handling of the ids costs about as much as the decode (once per
        # finished request).
        self._backend = (None if getattr(hf_tokenizer, "clean_up_tokenization_spaces", False)
                         else getattr(hf_tokenizer, "backend_tokenizer", None))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_token_id(self):
        return self.hf.bos_token_id

    @property
    def pad_token_id(self):
        return self.hf.pad_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> Optional["StreamDecoder"]:
        """A fresh incremental decoder for one request's tokens (its text that of
        `decode(ids, skip_special_tokens)`), or None where its text could differ from `decode`'s
        (a tokenizer that cleans up spaces after decoding, or one without a `tokenizers`
        backend): the engine then decodes windows of the output instead."""
        backend = self._backend
        if backend is None:
            return None
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:          # tokenizers < 0.21
            return None
        return StreamDecoder(backend, DecodeStream(skip_special_tokens=bool(skip_special_tokens)))

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The chat template's text of a conversation, ending with the assistant's turn opened.
        Messages are checked first (`check_messages`); a template that refuses them (roles out
        of order, say) is a ValueError that says so."""
        check_messages(messages)
        try:
            from jinja2 import TemplateError
        except ImportError:          # transformers renders templates with jinja2
            TemplateError = ()       # noqa: N806
        try:
            return self.hf.apply_chat_template(list(messages), tokenize=False,
                                               add_generation_prompt=True)
        except TemplateError as e:
            raise ValueError(f"the model's chat template refused these messages: "
                             f"{type(e).__name__}: {e}") from None

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> List[int]:
        # The template writes any BOS itself; encoding it again would double it.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True
                     ) -> List[List[int]]:
        """`encode` of each text, in one call: a fast tokenizer encodes a batch on several
        threads, several times faster than one by one."""
        if not texts:
            return []
        out = self.hf(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
        return [list(ids) for ids in out]

    def apply_chat_templates(self, chats: Sequence[Sequence[Mapping[str, str]]]
                             ) -> List[List[int]]:
        """`apply_chat_template` of each chat: rendered one by one, encoded as one batch."""
        return self.encode_batch([self.render_chat(c) for c in chats], add_special_tokens=False)

    @classmethod
    def from_hf_dir(cls, model_dir, extra_eos_ids: Iterable[int] = ()) -> "Tokenizer":
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as e:
            raise WeightsError(f"{model_dir}: cannot load its tokenizer ({e})") from None
        return cls(tok, extra_eos_ids)

    @classmethod
    def from_gguf(cls, path, reader=None, extra_eos_ids: Iterable[int] = ()) -> "Tokenizer":
        from jaxspec.loading import gguf_file

        if reader is None:
            reader = gguf_file.open_gguf(Path(path))
        meta = gguf_file.metadata(reader, include_tokenizer=True)
        if meta.get("tokenizer.ggml.model") in _SENTENCEPIECE:
            return cls(_sentencepiece_from_gguf(Path(path)), extra_eos_ids)
        return cls(fast_tokenizer_from_gguf_metadata(meta, str(path)), extra_eos_ids)


# GGUF tokenizer models that are SentencePiece vocabularies (Llama 2, Mistral, Gemma):
# transformers' own GGUF reader builds them, with their scores and byte fallback.
_SENTENCEPIECE = ("llama",)


def _sentencepiece_from_gguf(path: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                             local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise WeightsError(f"{path}: cannot build its SentencePiece tokenizer ({e})") from None


def check_messages(messages, where: str = "chat") -> None:
    """A conversation is a non-empty list of messages, each a dict with a string "role" and a
    string "content" (what every chat template reads); TypeError or ValueError naming the first
    message that is not. where: how errors name the conversation."""
    if isinstance(messages, Mapping):
        raise TypeError(f"{where}: a conversation is a list of messages, got one message (a "
                        f"dict): wrap it in a list, [{{'role': 'user', 'content': ...}}]")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"{where}: a conversation is a list of {{'role': ..., 'content': ...}} "
                        f"message dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where}: a conversation needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"{where}, message {i}: a message is a dict with 'role' and "
                            f"'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"{where}, message {i}: no {key!r} (a message is a dict with "
                                 f"'role' and 'content' strings), got keys {sorted(map(str, m))}")
            if not isinstance(m[key], str):
                raise TypeError(f"{where}, message {i}: {key!r} must be a string, got "
                                f"{type(m[key]).__name__}")


class StreamDecoder:
    """`tokenizers`' DecodeStream over one request's tokens: feed(ids) -> the text they complete
    (a character whose bytes have not all arrived waits for the next tokens). Cheaper than two
    `decode` calls of a window per step; the text so far is always a prefix of
    decode(tokens so far) (tests/test_engine.py, test_incremental_detokenization_...)."""

    def __init__(self, backend, stream):
        self._backend, self._stream = backend, stream

    def feed(self, ids: Sequence[int]) -> str:
        step, backend = self._stream.step, self._backend
        return "".join(filter(None, (step(backend, int(i)) for i in ids)))


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def fast_tokenizer_from_gguf_metadata(meta: Mapping, origin: str = "GGUF"):
    """A `PreTrainedTokenizerFast` for a GGUF "gpt2" (byte-level BPE) vocabulary."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise WeightsError(f"{origin}: the GGUF file carries no tokenizer (tokenizer.ggml.*); "
                           f"use jaxspec.weights.load_params for the weights alone")
    if kind != "gpt2":
        raise WeightsError(f"{origin}: tokenizer model {kind!r} is not supported (only byte-level "
                           f"BPE, 'gpt2')")
    tokens: List[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise WeightsError(f"{origin}: byte-level BPE vocabulary without tokenizer.ggml.merges")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (written as raw text by some converters) are respelled so
    # the merges, which are in the alphabet, reach them.
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                  dropout=None, continuing_subword_prefix="",
                                  end_of_word_suffix="", fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    if pre in _SPLITS:
        raw.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":
        # SmolLM's own tokenizer (and llama.cpp's "smollm" pre-tokenizer) splits every digit.
        raw.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True)])
    else:
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True)
    raw.decoder = decoders.ByteLevel()

    def tok(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = tok("bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])])
    else:
        raw.post_processor = processors.ByteLevel(trim_offsets=False)
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
    raw.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    kwargs = {k: v for k, v in (("bos_token", bos), ("eos_token", tok("eos_token_id")),
                                ("unk_token", tok("unknown_token_id")),
                                ("pad_token", tok("padding_token_id"))) if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=meta.get("tokenizer.chat_template"),
                                   clean_up_tokenization_spaces=False, **kwargs)
