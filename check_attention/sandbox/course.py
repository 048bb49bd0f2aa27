"""A course's adapter functions as layers: Stanford CS336's signatures, recognised as they are.

CS336 (assignment 1) tests attention through adapters that take the weights as arguments,
run_multihead_self_attention(d_model, num_heads, q_proj_weight, k_proj_weight, v_proj_weight,
o_proj_weight, in_features) and its `_with_rope` twin (max_seq_len, theta after num_heads;
token_positions last): weights [d_out, d_in], in_features [..., seq, d_in], causal. The checker
makes the weights itself (seeded, nn.Linear's initialisation) and wraps the function in a module
holding them, so the adapter is judged by the same checklist as a layer: the Linears are only
holders, named as the course names them. (`run_scaled_dot_product_attention(Q, K, V, mask)` is a
scaled dot-product function, judged as one.) Runs in the sandboxed child, like runner.py.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

ROPE_THETA = 10000.0  # the theta the checker passes to a `_with_rope` adapter (CS336's tests too)
WEIGHTS = ("q_proj_weight", "k_proj_weight", "v_proj_weight", "o_proj_weight")
SIGNATURES = {  # the parameters each adapter must have, in the course's order
    "mha": ("d_model", "num_heads", *WEIGHTS, "in_features"),
    "mha_rope": ("d_model", "num_heads", "max_seq_len", "theta", *WEIGHTS, "in_features"),
}


def adapter_kind(fn) -> str | None:
    """'mha', 'mha_rope' or None: which course adapter fn's parameters say it is."""
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return None
    for kind in ("mha_rope", "mha"):
        if list(names[:len(SIGNATURES[kind])]) == list(SIGNATURES[kind]):
            return kind
    return None


class AdapterLayer(nn.Module):
    """x [B, T, d_model] -> fn(d_model, num_heads, [max_seq_len, theta,] W_Q, W_K, W_V, W_O, x
    [, token_positions]): the adapter, holding the weights the checker made for it."""

    def __init__(self, fn, kind: str, d_model: int, num_heads: int, max_seq_len: int):
        super().__init__()
        self.fn, self.kind = fn, kind
        self.d_model, self.num_heads, self.max_seq_len = d_model, num_heads, max_seq_len
        if kind == "mha_rope":
            self.theta = ROPE_THETA  # an attribute: the checker's reference reads it from here
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (
            nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                   self.output_proj.weight)
        if self.kind == "mha":
            return self.fn(self.d_model, self.num_heads, *weights, x)
        positions = torch.arange(x.size(-2), device=x.device)[None, :]  # [1, T], as CS336 passes
        return self.fn(self.d_model, self.num_heads, self.max_seq_len, self.theta, *weights, x,
                       token_positions=positions)


def adapter_words(fn, kind: str, d_model: int, num_heads: int) -> str:
    """How the checker calls the adapter, for the report's `layer:` line."""
    rope = f"max_seq_len, theta={ROPE_THETA:g}, " if kind == "mha_rope" else ""
    positions = ", token_positions=[[0, 1, ...]]" if kind == "mha_rope" else ""
    return (f"the CS336 adapter {getattr(fn, '__name__', 'adapter')}(d_model={d_model}, "
            f"num_heads={num_heads}, {rope}W_Q, W_K, W_V, W_O [{d_model}, {d_model}] made by the "
            f"checker, in_features{positions})")


def adapter_factory(fn, kind: str):
    """A factory the runner builds (and rebuilds with other head counts) like a layer class."""
    def make(d_model: int, num_heads: int, max_seq_len: int) -> AdapterLayer:
        return AdapterLayer(fn, kind, d_model, num_heads, max_seq_len)
    make.__name__ = getattr(fn, "__name__", "adapter")
    return make
