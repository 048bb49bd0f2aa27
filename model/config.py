"""Typed configuration of the network and of its attention layer.

These dataclasses are the schema Hydra validates `conf/model/*.yaml` and `conf/attention/*.yaml`
against: a misspelt key or a value of the wrong type fails at start-up, before any work is done.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional


class Scale(str, Enum):
    """What the raw scores QK^T are divided by."""

    d_k = "d_k"          # correct: sqrt(d_model / n_head), the per-head size
    d_model = "d_model"  # pitfall: sqrt of the full width, softmax too flat by sqrt(n_head)
    none = "none"        # pitfall: no division, softmax saturates when q.k is large


class MaskMode(str, Enum):
    """How the causal pattern is applied to the scores (or weights)."""

    add = "add"                      # scores + mask_value at future positions, then softmax
    fill = "fill"                    # scores[future] = mask_value, then softmax
    after_softmax = "after_softmax"  # softmax over all keys, then weights[future] = 0


class Activation(str, Enum):
    """The MLP's nonlinearity."""

    gelu = "gelu"            # exact GELU, x * Phi(x) with erf
    gelu_tanh = "gelu_tanh"  # the tanh approximation that OpenAI's GPT-2 was trained with


class AttentionImpl(str, Enum):
    """Which code computes the correct causal attention (results agree to rounding)."""

    auto = "auto"            # fused on CUDA (if Triton is installed), reference elsewhere
    reference = "reference"  # the step-by-step layer of model/attention.py
    fused = "fused"          # our Triton kernel, model/fused_attention.py


@dataclass
class AttentionConfig:
    """One attention variant. The default is the correct layer; `conf/attention/` names the pitfalls."""

    name: str = "correct"
    scale: Scale = Scale.d_k
    mask_mode: MaskMode = MaskMode.add
    # -inf makes exp(score) exactly 0 for the future; 0 is the classic bug; a large finite
    # negative value is what some fp16 code uses.
    mask_value: float = float("-inf")
    out_proj: bool = True
    # Standard deviation for W_Q and W_K at init; null means the model's init_std. The no_scale
    # pitfall only shows when q and k entries have unit variance (std = 1/sqrt(n_embd)).
    qk_init_std: Optional[float] = None
    # Speed only, never the result: queries are processed in blocks of this many rows, and each
    # block leaves out the keys after its last query (they would get weight exactly 0). Used when
    # the mask is exact (is_causal); 0 = all rows at once over every key; null = by device: 64 on
    # a CPU, where skipping work pays, 0 on a GPU, where each block costs kernel launches.
    query_block: Optional[int] = None
    # Which code computes the correct attention: the readable `reference` (model/attention.py),
    # our `fused` Triton kernel (model/fused_attention.py), or `auto`: fused on CUDA when Triton
    # is there, reference elsewhere. The pitfall variants always run the reference code.
    impl: AttentionImpl = AttentionImpl.auto

    def is_causal(self) -> bool:
        """True when no weight can reach a future position (the generation-time condition)."""
        if self.mask_mode is MaskMode.after_softmax:
            return False  # future weights are zeroed, but they still took mass in the softmax
        return self.mask_value == float("-inf")


@dataclass
class ModelConfig:
    """Size and regularisation of the decoder-only transformer."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    dropout: float = 0.0
    # Dropout on the attention weights; null = the same as `dropout`. 0 lets the fused attention
    # kernel, which has no dropout, train a model that keeps dropout everywhere else.
    attn_dropout: Optional[float] = None
    bias: bool = True
    # GPT-2's init: N(0, init_std) for every weight, residual output projections scaled down by
    # 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth.
    init_std: float = 0.02
    mlp_ratio: int = 4
    activation: Activation = Activation.gelu

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def validate_attention(cfg: AttentionConfig) -> None:
    """The attention's values, checked as every value is (guard/limits.py), for code that builds
    a layer from a config of its own."""
    from guard.limits import check_attention  # the checks stand above the model

    check_attention(cfg)
