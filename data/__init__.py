"""Corpora, tokenizers, the token cache and batching."""
