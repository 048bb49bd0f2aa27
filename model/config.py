"""Typed configuration of the network and of its attention layer.

These dataclasses are the schema Hydra validates `conf/model/*.yaml` and `conf/attention/*.yaml`
against: a misspelt key or a value of the wrong type fails at start-up, before any work is done.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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


class Positions(str, Enum):
    """How a token's position enters the network."""

    learned = "learned"  # GPT-2: a learned vector per position, added to the token embedding
    rope = "rope"        # rotary (RoPE): q and k of each head rotated by position-dependent angles


class Norm(str, Enum):
    """The normalisation before each sub-layer and before the head."""

    layernorm = "layernorm"  # GPT-2: subtract the mean, divide by the std, gain (and bias)
    rmsnorm = "rmsnorm"      # Llama: divide by the root mean square, gain; no mean, no bias


class MLPKind(str, Enum):
    """The feed-forward sub-layer: its nonlinearity, and whether it is gated."""

    gelu = "gelu"            # exact GELU, x * Phi(x) with erf
    gelu_tanh = "gelu_tanh"  # the tanh approximation that OpenAI's GPT-2 was trained with
    relu2 = "relu2"          # ReLU(x)^2 (Primer; modded-nanogpt)
    swiglu = "swiglu"        # SiLU(x W_gate) * (x W_up), then W_down (Llama): three matrices


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
    # --- the second study's pitfalls (rotary positions, grouped heads, the KV cache), then the
    # third's (the head split, the softmax axis, padding, windows, cache reuse; docs/ablations.md):
    # each false in the correct layer. Each one's story: conf/attention/<name>.yaml; its code, the
    # step it replaces: model/pitfalls.py.
    rope_on_values: bool = False            # v rotated too: outputs carry absolute positions
    cache_positions_restart: bool = False   # decoded tokens' positions restart at 0
    upper_left_mask: bool = False           # the mask aligned top-left: a decoded token sees key 0
    gqa_repeat_mismatch: bool = False       # query head i reads kv head i % h_kv, not i // g
    rotary_interleaved: bool = False        # rotary pairs (2j, 2j + 1) where (j, j + d_k/2) belong
    split_heads_no_transpose: bool = False  # heads cut by view(B, h, T, d_k): later positions seen
    softmax_over_queries: bool = False      # the softmax over dim=-2: each key's column sums to 1
    left_pad_positions: bool = False        # positions from the batch's first slot, not the row's
    pad_keys_visible: bool = False          # a left-padded row's queries see its pad keys
    cache_not_reset: bool = False           # a new sequence decoded after the last one's keys
    window_off_by_one: bool = False         # a window of w + 1 keys where model.window = w belongs
    window_cache_trim: bool = False         # the cache trimmed to w keys before a chunk attends

    def pitfalls(self) -> list[str]:
        """The second and third studies' switches that are on (none for the correct layer)."""
        return [name for name in PITFALL_SWITCHES if getattr(self, name)]

    def is_correct(self) -> bool:
        """The correct attention, which our fused kernel may compute: causal and no pitfall."""
        return self.is_causal() and not self.pitfalls()

    def is_causal(self) -> bool:
        """True when no weight can reach a future position (the generation-time condition)."""
        if self.mask_mode is MaskMode.after_softmax or self.softmax_over_queries:
            return False  # the future takes mass in the softmax (its denominator), then is zeroed
        # a head split without the transpose hands a head's rows slices of later positions
        return self.mask_value == float("-inf") and not self.split_heads_no_transpose

    def causal_variant(self) -> AttentionConfig:
        """The same layer without its leak: what a model can do at generation time.

        Only what leaks changes (the mask, the softmax's axis, the head split); scaling and W_O
        belong to the trained weights and stay as trained."""
        return replace(self, mask_mode=MaskMode.add, mask_value=float("-inf"),
                       split_heads_no_transpose=False, softmax_over_queries=False)


# The switches of AttentionConfig that each make one pitfall: the second study's (rotary
# positions, grouped heads, the KV cache), then the third's (docs/ablations.md).
DECODING_SWITCHES = ("rope_on_values", "cache_positions_restart", "upper_left_mask",
                     "gqa_repeat_mismatch", "rotary_interleaved")
BOOKKEEPING_SWITCHES = ("split_heads_no_transpose", "softmax_over_queries", "left_pad_positions",
                        "pad_keys_visible", "cache_not_reset", "window_off_by_one",
                        "window_cache_trim")
PITFALL_SWITCHES = DECODING_SWITCHES + BOOKKEEPING_SWITCHES


@dataclass
class ModelConfig:
    """The decoder-only transformer: its sizes, its regularisation and its architecture's
    switches, each defaulting to GPT-2's (conf/model/small.yaml sets the default model's)."""

    n_layer: int = 4               # transformer blocks
    n_head: int = 4                # query heads per layer (d_k = n_embd / n_head)
    n_embd: int = 128              # the width d_model of the residual stream
    block_size: int = 128          # the context: tokens a position can attend to
    dropout: float = 0.0           # on the attention weights and each block's outputs
    # Dropout on the attention weights; null = the same as `dropout`. 0 lets the fused attention
    # kernel, which has no dropout, train a model that keeps dropout everywhere else.
    attn_dropout: Optional[float] = None
    bias: bool = True              # biases in the linear layers and norms
    # GPT-2's init: N(0, init_std) for every weight, residual output projections scaled down by
    # 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth.
    init_std: float = 0.02
    # The MLP's hidden width is mlp_ratio * n_embd (see mlp_hidden).
    mlp_ratio: int = 4
    # --- the architecture's switches (docs/model.md). Each default is GPT-2's: `+arch=gpt2`
    # sets them back on top of another model, and interop/hf.py's gpt2_problems names a switch
    # GPT-2 does not have.
    positions: Positions = Positions.learned
    # RoPE's base: pair j of a head turns by position * rope_theta^(-2j / d_k) radians.
    rope_theta: float = 10000.0
    norm: Norm = Norm.layernorm
    # Epsilon of every norm (LayerNorm's 1e-5 by default; Llama's rms_norm_eps).
    norm_eps: float = 1e-5
    mlp: MLPKind = MLPKind.gelu
    # Hidden width of the MLP; null = mlp_ratio * n_embd, and for swiglu (three matrices instead
    # of two) 2/3 of that, rounded up to a multiple of 8, so that its parameters match.
    mlp_hidden: Optional[int] = None
    # Key/value heads (grouped-query attention): query head i reads key/value head
    # i // (n_head / n_kv_head). null = n_head (ordinary multi-head), 1 = multi-query.
    n_kv_head: Optional[int] = None
    # RMSNorm of each head's q and k (over d_k, one gain per dimension shared by the heads),
    # before the rotation: bounds the scores' size (Qwen3; modded-nanogpt).
    qk_norm: bool = False
    # The LM head is the token embedding (one matrix) or a matrix of its own.
    tie_embeddings: bool = True
    # Each head's output times sigmoid(x W_g), one gate per head and token, before W_O (gated
    # attention, Qwen 2025; on in the default model since round 4 of docs/budget.md).
    attn_gate: bool = False
    # Sliding-window attention: each query sees the last `window` keys, its own included (null:
    # every earlier key). The third study's window regime (docs/ablations.md); no exported
    # architecture has it.
    window: Optional[int] = None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is null."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def hidden(self) -> int:
        """The MLP's hidden width (see mlp_hidden)."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if MLPKind(self.mlp) is MLPKind.swiglu:
            return -(-2 * self.mlp_ratio * self.n_embd // 3 // 8) * 8
        return self.mlp_ratio * self.n_embd

