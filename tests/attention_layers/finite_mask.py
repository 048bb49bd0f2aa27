"""The causal mask as -1e4 added to the future scores (a value copied from float16 code): it
hides the future while the scores stay well below 1e4, and leaks once they do not.

Test material for tests/test_check_probes.py; not part of the package.
"""
import torch

from separate import MultiHeadSelfAttention


class MinusTenThousand(MultiHeadSelfAttention):
    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (self.split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = q @ k.transpose(-2, -1) / self.d_head ** 0.5 - 1e4 * future
        out = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(b, n, self.d_model)
        return self.output_proj(out)
