"""Faster code for the reading path: the same numbers as the code it stands beside.

Most of it computes the equation of model/attention.py, a path chosen once per layer; the last
section computes the MLP's ReLU^2 (model/gpt.py), `relu_squared`.

Each path is a function (layer, q, k, v, mask) -> y [B, h, T, d_k], with q [B, h, T, d_k],
k, v [B, h_kv, m, d_k] and mask None (the layer's causal pattern, right-aligned) or a boolean
pattern after a KV cache: [T, m] (a static cache's) or [B, 1, T, m] (a left-padded batch's).
`choose` picks one when the layer is built, moved, set to train or eval, or given another
variant (`FastPathChoice`, the layer's mixin), never per call:

    1. `one_pass`: the whole batch shares one [T, m] pattern, so the mask is added inside the
       score matmul (one fused `baddbmm`), and grouped heads share their keys without copies;
    2. `query_blocks` (on a CPU, by default): each block of query rows leaves out the keys after
       its last query, which would get weight exactly 0, so about half the work is never done;
    3. `kernel` (on a GPU whose kernel passed its self-check, or attention.impl=fused): our fused
       Triton kernel (model/fused_attention.py) computes the same equation without writing the
       T x T scores to memory.

Paths 1-3 need the exact causal mask (is_causal: future weights exactly 0); a leaky pitfall
runs `equation`, the layer's own equation with its steps. The tests hold each path equal to the
equation (tests/test_attention.py, tests/test_fused_attention.py). Whether the kernel may run
is decided here too, after the paths: `fused_refusal` (what it cannot compute) and
`trust_fused_attention` (impl=auto uses it only where its self-check passed).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from model.config import AttentionConfig, AttentionImpl

# Query rows per block on a CPU when attention.query_block is null (by device); twice that from
# 1,024 queries on.
CPU_QUERY_BLOCK = 64


def choose(layer, device: torch.device):
    """The path that computes `layer`'s attention on `device` (see the module docstring)."""
    attn = layer.attn
    if attn.impl is not AttentionImpl.reference and (
            attn.impl is AttentionImpl.fused or (device.type == "cuda" and layer.fused_trusted)):
        refusal = fused_refusal(attn, layer.head_dim, layer.dropout if layer.training else 0.0,
                                device, window=layer.window)
        if refusal is None:
            return kernel
        if attn.impl is AttentionImpl.fused:  # asked for by name: never a silent fallback
            return _refuse(refusal)
    if not attn.is_causal():  # a leaky pitfall: only its own equation computes it
        return equation
    if attn.query_block is not None:
        return _blocks(attn.query_block, attn.query_block) if attn.query_block else one_pass
    # by device: rows per block measured on a CPU (docs/model.md), none on a GPU
    return _blocks(CPU_QUERY_BLOCK, 2 * CPU_QUERY_BLOCK) if device.type == "cpu" else one_pass


class FastPathChoice:
    """The attention layer's `fast_path`, chosen again whenever what `choose` reads changes: the
    layer built, moved (`.to()`), set to train or eval (the kernel has no dropout), given another
    variant (GPT.attention_variant), or its kernel trusted (`trust_fused_attention`)."""

    fused_trusted = False  # may impl=auto use our kernel here? (set once its check passed)

    @property
    def attn(self) -> AttentionConfig:  # the variant (model/config.py)
        return self._attn

    @attn.setter
    def attn(self, attn: AttentionConfig) -> None:
        self._attn = attn
        if "qkv" in self._modules:  # (not while the layer is being built)
            self.select_fast_path()

    def select_fast_path(self) -> None:
        self.fast_path = choose(self, self.qkv.weight.device)

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self.select_fast_path()
        return result

    def train(self, mode: bool = True):
        result = super().train(mode)
        self.select_fast_path()
        return result


# One object per choice, so that choosing again (train / eval) gives torch.compile's guards
# the same path to see.
@functools.lru_cache(maxsize=None)
def _blocks(block: int, long_block: int):
    return functools.partial(query_blocks, block=block, long_block=long_block)


@functools.lru_cache(maxsize=None)
def _refuse(refusal: str):
    return functools.partial(refuse, refusal)


def equation(layer, q, k, v, mask):
    """The layer's equation itself (model/attention.py), every step in the open."""
    return layer.equation(q, k, v, mask)[0]


def one_pass(layer, q, k, v, mask):
    """The equation over all queries at once, with the shared [T, m] pattern."""
    return shared_mask_attention(q, k, v, layer.visible(q.size(2), k.size(2), mask),
                                 layer.scale(), layer.dropout if layer.training else 0.0)


def shared_mask_attention(q, k, v, visible, scale: float, dropout_p: float = 0.0):
    """softmax(q k^T * scale + M) v with one [n, m] boolean pattern for every batch element and
    head (the model's case; or one [B, 1, n, m] per sequence of a left-padded batch): the same
    numbers as the equation, in fewer passes over memory.

    - Score, scale and mask in one `baddbmm(M, q, k^T)`: the [n, m] scores written once, not 3x.
    - Grouped heads without copies: the g = h / h_kv query heads of one key/value head are the
      rows of one matrix, [..., h_kv, g * n, d_k], so one matmul serves them all.
    q [..., h, n, d_k], k [..., h_kv, m, d_k], v [..., h_kv, m, d_v] -> [..., h, n, d_v].
    """
    *batch, h, n, d_k = q.shape
    h_kv, m, d_v = k.size(-3), k.size(-2), v.size(-1)
    g = h // h_kv
    assert g * h_kv == h, f"{h_kv} key/value heads cannot serve {h} query heads"
    q3 = q.reshape(-1, g * n, d_k)  # [batch * h_kv, g * n, d_k]: head i = kv head i // g
    k3, v3 = k.reshape(-1, m, d_k), v.reshape(-1, m, d_v)  # [batch * h_kv, m, d]
    # [g * n, m] (or [B, 1, g * n, m]): the pattern for each query head of a group
    rows = visible.repeat(*[1] * (visible.dim() - 2), g, 1)
    M = torch.zeros(rows.shape, dtype=q.dtype, device=q.device).masked_fill_(~rows, float("-inf"))
    if M.dim() > 2:  # a pattern per sequence: [batch * h_kv, g * n, m], as q3's rows
        M = M.expand(*batch, h_kv, g * n, m).reshape(-1, g * n, m)
    scores = torch.baddbmm(M, q3, k3.transpose(1, 2), alpha=scale)  # [batch * h_kv, g * n, m]
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    blend = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return torch.bmm(blend, v3).view(*batch, h, n, d_v)


def query_blocks(layer, q, k, v, mask, *, block: int, long_block: int):
    """The same output as `one_pass`, skipping the work the causal mask throws away.

    Queries r0..r1 see keys 0..m - T + r1 only (every later key gets weight exactly 0), so each
    block of query rows attends over its visible prefix alone: about half the work when T is
    long (T^2 / 2 + T * block / 2 entries instead of T^2); `long_block` rows from T = 1,024 on.

    The keys and values are cut into chunks at the blocks' ends, and block i reads chunks
    0..i joined: autograd then hands each chunk its share of the gradient, where taking a
    slice k[:, :, :end] per block would make a zero-filled gradient of the whole of k for
    every block (at T = 1024, more memory traffic than the scores themselves).
    """
    T, m = q.size(2), k.size(2)
    block = block if T < 1024 else long_block
    if T <= block:
        return one_pass(layer, q, k, v, mask)
    visible = layer.visible(T, m, mask)  # [T, m] (or [B, 1, T, m])
    scale, dropout_p = layer.scale(), layer.dropout if layer.training else 0.0
    starts = range(0, T, block)
    ends = [m - T + min(r0 + block, T) for r0 in starts]  # keys visible to each block
    sizes = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
    k_chunks, v_chunks = k.split(sizes, dim=2), v.split(sizes, dim=2)
    outputs = []
    for i, (r0, q_block) in enumerate(zip(starts, q.split(block, dim=2))):
        keys = torch.cat(k_chunks[:i + 1], dim=2)  # [B, h_kv, ends[i], d_k]
        values = torch.cat(v_chunks[:i + 1], dim=2)
        y = shared_mask_attention(q_block, keys, values,
                                  visible[..., r0:r0 + q_block.size(2), :ends[i]], scale,
                                  dropout_p)
        outputs.append(y.transpose(1, 2))  # [B, rows, h, d_k]
    # joined in the layout the heads are concatenated in, so that the caller's
    # transpose back and reshape copy nothing
    return torch.cat(outputs, dim=1).transpose(1, 2)  # [B, h, T, d_k]


def kernel(layer, q, k, v, mask):
    """Our Triton kernel (model/fused_attention.py): the right-aligned causal mask is built in.
    A static cache's masked buffer goes to `one_pass`. k, v keep their n_kv_head heads (the
    kernel maps query head i to kv head i // g); a KV cache keeps the weights' dtype, and under
    autocast q is already bf16."""
    if mask is not None:
        return one_pass(layer, q, k, v, mask)
    import model.fused_attention as fused  # imported already by fused_refusal, when chosen
    return fused.fused_causal_attention(q, k.to(q.dtype), v.to(q.dtype), scale=layer.scale())


def refuse(refusal: str, layer, q, k, v, mask):
    """attention.impl=fused where the kernel cannot compute this attention."""
    raise ValueError(refusal)


# ----------------------------------------------------------------------------- may the kernel run?
# Its facts (head sizes, dtypes, where Triton runs, the self-check) are model/fused_attention.py's,
# imported only when a CUDA device or attention.impl=fused asks: importing Triton takes a second.


def fused_refusal(attn: AttentionConfig, head_dim: Optional[int] = None, dropout: float = 0.0,
                  device=None, dtype: Optional[torch.dtype] = None,
                  window: Optional[int] = None) -> Optional[str]:
    """Why our Triton kernel cannot compute this attention, or None when it can: the correct
    causal attention only, without a sliding window or dropout on the weights, for the head
    sizes and dtypes it is built for, on a device it runs on. The one decision, made by the
    config checks with what a config knows (guard/limits.py) and by `choose` with the layer in
    hand."""
    if not attn.is_correct():
        return (f"attention.impl=fused computes the correct attention only; the pitfall "
                f"{attn.name!r} always runs the reference code")
    if window is not None:
        return "attention.impl=fused has no sliding window: set model.window=null"
    if dropout > 0:
        return ("attention.impl=fused has no dropout on the attention weights: set "
                "model.attn_dropout=0 (dropout elsewhere stays)")
    if head_dim is None and dtype is None and device is None:
        return None
    import model.fused_attention as fused
    if head_dim is not None and head_dim not in fused.HEAD_DIMS:
        return f"attention.impl=fused supports head sizes {fused.HEAD_DIMS}, not {head_dim}"
    if dtype is not None and dtype not in fused.DTYPES:
        return f"attention.impl=fused takes {[str(d) for d in fused.DTYPES]}, not {dtype}"
    if device is not None and torch.device(device).type == "mps":  # even under the interpreter
        return "attention.impl=fused needs Triton and a CUDA device, not mps (no Metal target)"
    if device is not None and not fused.fused_available(device):
        return (f"attention.impl=fused needs Triton and a CUDA device (or TRITON_INTERPRET=1), "
                f"not {torch.device(device).type}")
    return None


def trust_fused_attention(model: torch.nn.Module, device, dtype: torch.dtype):
    """Run the kernel's self-check for model's attention on device in dtype (the dtype q has:
    autocast's, or the weights'), and let impl=auto use the kernel only if it passes. Returns
    the verdict (model/fused_attention.py's KernelCheck), or None when no layer would use the
    kernel there (not a CUDA device, impl=reference, a pitfall variant). Call it after the model
    is on its device and before torch.compile traces it."""
    layers = [m for m in model.modules() if isinstance(m, FastPathChoice)]  # attention layers
    if not layers or torch.device(device).type != "cuda":
        return None
    first = layers[0]
    if first.attn.impl is AttentionImpl.reference or not first.attn.is_correct():
        return None
    import model.fused_attention as fused
    if not fused.fused_available(device):
        return None
    verdict = fused.self_check(device, first.head_dim, dtype, first.n_head // first.n_kv_head)
    for layer in layers:
        layer.fused_trusted = verdict.ok
        layer.select_fast_path()
    return verdict


# ----------------------------------------------------------------------------- the MLP's ReLU^2


def relu_squared(h: torch.Tensor) -> torch.Tensor:
    """F.relu(h).square(): the same numbers and gradient, by `ReLUSquare`."""
    return ReLUSquare.apply(h)


class ReLUSquare(torch.autograd.Function):
    """relu(x)^2, with d/dx = 2 relu(x), in two passes over the [B, T, hidden] activations each
    way instead of five (relu, square, and backward's square, mask and product), and one saved
    tensor instead of two (docs/budget.md, round 7)."""

    @staticmethod
    def forward(ctx, x):
        h = F.relu(x)
        ctx.save_for_backward(h)
        return h * h

    @staticmethod
    def backward(ctx, grad):
        h, = ctx.saved_tensors
        return (h + h).mul_(grad)
