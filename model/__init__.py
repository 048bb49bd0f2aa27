"""The decoder-only transformer and its from-scratch attention."""
from model.attention import CausalSelfAttention, KVCache, causal_pattern, scaled_dot_product_attention
from model.config import AttentionConfig, MaskMode, ModelConfig, Scale
from model.gpt import GPT

__all__ = ["GPT", "CausalSelfAttention", "KVCache", "causal_pattern", "scaled_dot_product_attention",
           "AttentionConfig", "MaskMode", "ModelConfig", "Scale"]
