"""A layer that attends in chunks of 64 queries (to bound the [n, n] scores' memory) and builds
each chunk's mask without the chunk's offset: query s + i of the chunk starting at s sees keys
0..i instead of 0..s + i. Right for the first 64 queries, wrong after them; the checklist's 8
positions never reach the second chunk.

Test material for tests/test_check_probes.py; not part of the package.
"""
import torch

from separate import MultiHeadSelfAttention


class Chunked64(MultiHeadSelfAttention):
    chunk = 64
    offset = 0    # the chunk's mask offset, as a multiple of its start (1 is right)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (self.split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        outs = []
        for s in range(0, n, self.chunk):
            e = min(s + self.chunk, n)
            scores = q[:, :, s:e] @ k[:, :, :e].transpose(-2, -1) / self.d_head ** 0.5
            keep = torch.ones(e - s, e, dtype=torch.bool, device=x.device).tril(self.offset * s)
            outs.append(scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v[:, :, :e])
        out = torch.cat(outs, dim=2).permute(0, 2, 1, 3).reshape(b, n, self.d_model)
        return self.output_proj(out)


class Chunked64Leak(Chunked64):
    """Each chunk's mask offset by twice the chunk's start: query s + i sees keys up to 2s + i,
    the future, from the second chunk on (the first is right, so 8 positions never show it)."""
    offset = 2
