"""Attention through a custom autograd.Function whose forward is right and whose backward is
not: it forgets the softmax Jacobian's second term (dS = P * dP, not P * (dP - rowsum(P * dP))).
The forward matches the equation at every length; only the gradients are wrong. `right_*` is
the same Function with the correct backward (it must pass).

Test material for tests/test_check_probes.py; not part of the package.
"""
import math

import torch

from separate import MultiHeadSelfAttention


class Attention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, keep):
        scale = 1 / math.sqrt(q.size(-1))
        p = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~keep, float("-inf")).softmax(-1)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return p @ v

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        dp = dout @ v.transpose(-2, -1)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True)) if getattr(ctx, "right", False) else p * dp
        return ds @ k * ctx.scale, ds.transpose(-2, -1) @ q * ctx.scale, \
            p.transpose(-2, -1) @ dout, None


class RightAttention(Attention):
    @staticmethod
    def forward(ctx, q, k, v, keep):
        ctx.right = True
        return Attention.forward(ctx, q, k, v, keep)


def wrong_backward(q, k, v, mask):
    """mask: True = may attend."""
    return Attention.apply(q, k, v, mask.bool())


def right_backward(q, k, v, mask):
    return RightAttention.apply(q, k, v, mask.bool())


class WrongBackward(MultiHeadSelfAttention):
    core = Attention

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (self.split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        out = self.core.apply(q, k, v, keep).permute(0, 2, 1, 3).reshape(b, n, self.d_model)
        return self.output_proj(out)


class RightBackward(WrongBackward):
    core = RightAttention
