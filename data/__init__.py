"""Corpora, tokenizers, the token cache and batching."""


class CorpusError(RuntimeError):
    """A corpus cannot be fetched, read or tokenized; the message says why and what to do."""
