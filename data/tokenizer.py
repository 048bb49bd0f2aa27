"""Character-level and byte-level BPE tokenizers, both built with Hugging Face `tokenizers`.

Either is saved as one `tokenizer.json`, which is all generate.py needs to turn ids back into
text. Both are fitted on the training split only.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data.config import TokenizerConfig, TokenizerKind
from safeio.corpus import load_tokenizer

UNK = "[UNK]"
EOS = "<|endoftext|>"
# Texts are encoded in pieces of about this many characters so that `encode_batch` can use every
# core and no single Encoding (which stores offsets per token) gets huge; and in calls of this
# many pieces, each a fraction of a second.
ENCODE_CHUNK_CHARS = 1 << 16
ENCODE_CALL_CHUNKS = 32


def build_char_tokenizer(train_text: str | Iterable[str]) -> Tokenizer:
    """One token per distinct character of the training text, plus [UNK] (id 0).

    A BPE model with an empty merge list is exactly a character tokenizer; the Fuse decoder joins
    the characters back without spaces.
    """
    chars: set[str] = set()
    for text in [train_text] if isinstance(train_text, str) else train_text:
        chars.update(text)
    vocab = {UNK: 0}
    for ch in sorted(chars):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    return tok


def build_bpe_tokenizer(train_text: str | Iterable[str], vocab_size: int,
                        min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): any text is encodable, no unknown tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    assert vocab_size >= len(alphabet) + 1, \
        f"vocab_size must be at least {len(alphabet) + 1} for byte-level BPE, got {vocab_size}"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  initial_alphabet=alphabet, special_tokens=[EOS],
                                  show_progress=False)
    texts = [train_text] if isinstance(train_text, str) else train_text
    in_worker(tok.train_from_iterator, (piece for text in texts for piece in stream_chunks([text])),
              trainer=trainer)
    return tok


def build_tokenizer(cfg: TokenizerConfig, train_text: str | Iterable[str]) -> Tokenizer:
    """Fit the configured tokenizer on the training text (one string or an iterable of them)."""
    if cfg.kind is TokenizerKind.char:
        return build_char_tokenizer(train_text)
    if cfg.kind is TokenizerKind.file:
        return load_tokenizer(Path(cfg.path))
    return build_bpe_tokenizer(train_text, cfg.vocab_size, cfg.min_frequency)


def _chunks(text: str) -> list[str]:
    """Split at line ends near every ENCODE_CHUNK_CHARS, so no word is cut in two."""
    return list(stream_chunks([text]))


def stream_chunks(blocks: Iterable[str]) -> Iterator[str]:
    """The pieces of a text given as blocks (a file read a block at a time): each of at most
    ENCODE_CHUNK_CHARS characters, cut after the last line end before that. The pieces are the
    same whichever the blocks, and only a block and a piece are held at once."""
    buffer, start = "", 0
    for block in blocks:
        buffer, start = buffer[start:] + block, 0
        while len(buffer) - start > ENCODE_CHUNK_CHARS:
            end = start + ENCODE_CHUNK_CHARS
            newline = buffer.rfind("\n", start, end)
            end = newline + 1 if newline > start else end
            yield buffer[start:end]
            start = end
    if start < len(buffer):
        yield buffer[start:]


def token_dtype(vocab_size: int) -> type:
    """The smallest unsigned integer type that holds every id of the vocabulary."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def encode(tok: Tokenizer, text: str) -> np.ndarray:
    """Token ids of a long text, as the smallest unsigned dtype that holds the vocabulary."""
    dtype = token_dtype(tok.get_vocab_size())
    chunks = _chunks(text)
    ids = []
    for start in range(0, len(chunks), ENCODE_CALL_CHUNKS):
        call = chunks[start:start + ENCODE_CALL_CHUNKS]
        encodings = (in_worker(tok.encode_batch, call, add_special_tokens=False)
                     if len(chunks) > 1 else tok.encode_batch(call, add_special_tokens=False))
        ids += [np.asarray(e.ids, dtype=dtype) for e in encodings]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)


def in_worker(fn, *args, **kwargs):
    """fn(*args, **kwargs), run in a thread while this one waits. Python runs signal handlers
    only in the main thread, between its own steps: a long call into `tokenizers` (which lets go
    of the GIL) would hold a SIGTERM or a Ctrl-C back until it returned. Waiting here instead,
    the handler runs within a fraction of a second and the call is abandoned (a daemon thread)."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    box = {}

    def call():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["value"]


def unknown_characters(tok: Tokenizer, text: str) -> list[str]:
    """The characters of text that a char tokenizer maps to [UNK] (empty for byte-level BPE)."""
    vocab = tok.get_vocab()
    if UNK not in vocab:
        return []
    return sorted({ch for ch in text if ch not in vocab})


class IncrementalDecoder:
    """The text of a growing sequence of ids, piece by piece, in time linear in its length.

    Decoding every id so far at each new token makes streaming quadratic, so this decodes a
    short window, from the start of the last piece it gave out (where a complete character
    ended) to the newest id. A byte-level token can be part of a multi-byte UTF-8
    character; while the window's text ends in an incomplete one (decoded as U+FFFD), the piece
    is held back until the next ids complete it, or for at most `max_held` ids (invalid bytes
    stay U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, ids: Iterable[int] = (), context: int = 5,
                 max_held: int = 8):
        self.tokenizer, self.max_held = tokenizer, max_held
        self.ids = [int(i) for i in ids]
        self.start = max(len(self.ids) - context, 0)  # the window decoded at each id
        self.read = len(self.ids)                     # ids before this are given out
        self.shown = self._decode(self.start, self.read)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end]) if end > start else ""

    def add(self, token_id: int) -> str:
        """The text that token_id completes ('' while a character is incomplete)."""
        self.ids.append(int(token_id))
        text = self._decode(self.start, len(self.ids))
        incomplete = text.endswith("\ufffd")
        if incomplete and len(self.ids) - self.read < self.max_held:
            return ""
        piece = text[len(self.shown):] if text.startswith(self.shown) else text
        if incomplete:  # held long enough: give it out and start afresh after it
            self.start = self.read = len(self.ids)
        else:
            self.start, self.read = self.read, len(self.ids)
        self.shown = self._decode(self.start, self.read)
        return piece

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character, as U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        text = self._decode(self.start, len(self.ids))
        piece = text[len(self.shown):] if text.startswith(self.shown) else text
        self.start = self.read = len(self.ids)
        self.shown = ""
        return piece
