"""Corpora, tokenizers, the token cache and batching.

May import: safeio, model.
"""
