"""Load the tokenizer that goes with ServerArgs (HF directory or GGUF metadata), once per process."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_METASPACE = "\u2581"  # SentencePiece's space in its pieces


def tokenizer_source(server_args: Any) -> str:
    if server_args.tokenizer_path:
        return server_args.tokenizer_path
    if server_args.model_path:
        return server_args.model_path
    from radixserve.model_loader.default_model import ensure_default_model

    return ensure_default_model()


def from_a_character_start(
    tokenizer: Any, ids: list[int], text: str, **decode_kw: Any
) -> tuple[list[int], str]:
    """`ids`, decoded as `text`, without the leading tokens (3 at most: a UTF-8 character has
    4 bytes) that end a character begun before them, and their text: where the prompt's last
    tokens, the output's decode context, start. A byte-fallback decoder (Llama 2, Mistral,
    Gemma) makes a byte run that is not UTF-8 as a whole all U+FFFD, so the output's characters
    that continued it read U+FFFD, and stop strings in them never matched. The scheduler and
    the detokenizer both start there. Unchanged where no such start is found."""
    if not text.startswith("\ufffd"):
        return ids, text
    for k in range(1, min(3, len(ids)) + 1):
        rest = tokenizer.decode(ids[k:], **decode_kw)
        if not rest.startswith("\ufffd"):
            return ids[k:], rest
    return ids, text


def before_a_cut_character(
    decode: Callable[[list[int]], str], ids: list[int], most: int = 3
) -> tuple[int, str] | None:
    """The fewest last tokens of `ids` (up to `most`, and 3: a UTF-8 character has 4 bytes at
    most) whose removal leaves text, as `decode` reads it, that does not end inside a
    character: how many, and that text; None where there are none. A byte-fallback decoder
    (Llama 2, Mistral, Gemma) makes a whole byte run U+FFFD where it ends inside a character,
    the complete characters before it too. The scheduler's stop match and the detokenizer both
    read the text up to there."""
    for k in range(1, min(3, most, len(ids)) + 1):
        head = decode(ids[:-k])
        if not head.endswith("\ufffd"):
            return k, head
    return None


class TokenStrings:
    """Token id → its text inside a text (cached; at most the vocabulary): the text of
    logprob entries."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        """Its bytes where they are UTF-8 (a SentencePiece word keeps the leading space it
        loses decoded alone: legacy `tokens` join to the text, and `text_offset` counts it),
        else (part of a character) as it decodes alone."""
        s = self._cache.get(token_id)
        if s is None:
            try:
                s = bytes(self.token_bytes(token_id)).decode("utf-8")
            except UnicodeDecodeError:
                s = self.alone(token_id)
            self._cache[token_id] = s
        return s

    def alone(self, token_id: int) -> str:
        """Its text decoded alone: a text's first token's (a SentencePiece decoder strips the
        text's leading space)."""
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own UTF-8 bytes (OpenAI's logprob `bytes`): a token holding part of a
        character decodes alone to U+FFFD, and a SentencePiece token alone loses its leading
        space, so its bytes come from its vocabulary piece (a byte-level BPE's byte alphabet,
        a SentencePiece byte token, a piece's ▁ as a space)."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._token_bytes(token_id)
        return b

    def _token_bytes(self, token_id: int) -> list[int]:
        text = self.alone(token_id)
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # (a tokenizer without pieces)
            piece = None
        if "\ufffd" not in text:
            if isinstance(piece, str) and _METASPACE in piece:
                # SentencePiece: decoded alone, a word's leading space is stripped ('▁the'
                # reads 'the', '▁' reads ''); the bytes a client joins into the text keep it.
                spaced = piece.replace(_METASPACE, " ")
                if spaced != text and spaced.lstrip(" ") == text.lstrip(" "):
                    return list(spaced.encode("utf-8"))
            return list(text.encode("utf-8"))
        if isinstance(piece, str):
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return [int(m.group(1), 16)]
            table = _byte_level_decoder()
            if piece and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(text.encode("utf-8"))


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for
    themselves, the others for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def load_tokenizer_for(server_args: Any) -> Any:
    from radixserve.model_loader.weights import load_tokenizer

    trust = bool(getattr(server_args, "trust_remote_code", False))
    return load_tokenizer(tokenizer_source(server_args), trust_remote_code=trust)


def exported_tokenizer_dir(server_args: Any, tokenizer: Any) -> str:
    """A directory holding the tokenizer, for clients that load it from the path a worker
    reports (SGLang's router does): the tokenizer's own directory where there is one, else (a
    GGUF file, whose tokenizer lives in its metadata) a copy saved once next to the model
    cache. Falls back to the source path when saving fails."""
    import hashlib
    import os
    import tempfile

    from radixserve.model_loader.default_model import default_cache_dir

    source = tokenizer_source(server_args)
    if os.path.isdir(source):
        return source
    # Named by the file's name and a digest of where it is and its version: two files both
    # called ggml-model-Q4_1.gguf (llama.cpp's default name) shared one copy, and a server
    # reported the other model's tokenizer and chat template.
    stat = os.stat(source)
    key = f"{os.path.abspath(source)}:{stat.st_size}:{stat.st_mtime_ns}"
    name = os.path.splitext(os.path.basename(source))[0]
    name += "-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    target = os.path.join(os.path.dirname(default_cache_dir()), "tokenizers", name)
    if os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return target
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=f".{name}-")
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another server saved it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:
        return source
    return target if os.path.isdir(target) else source
