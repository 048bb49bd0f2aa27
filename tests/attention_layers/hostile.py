"""A file that tries to change the project and to fool the checker.

On import it tries to create a file in the repository and to open model/attention.py for
writing (it writes nothing, so a failed sandbox cannot damage the checkout), and it patches
math.sqrt to return 1: a checker that imported this file into its own process would compute
its "correct" reference without the scaling and call the unscaled layer below right.

Test material for tests/test_check_attention.py; not part of the package.
"""
import math
import os
from pathlib import Path

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[2]
for target in (REPO / "planted.txt", REPO / "model" / "attention.py"):
    try:
        open(target, "a").close()
    except OSError:
        pass
math.sqrt = lambda x: 1.0


class Unscaled(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=-1))
        att = (q @ k.transpose(-2, -1)).masked_fill(
            torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def leaves():
    """A factory whose layer ends its process when it runs."""
    class Quits(nn.Module):
        def forward(self, x):
            os._exit(0)
    return Quits()


def hangs():
    class Hangs(nn.Module):
        def forward(self, x):
            while True:
                pass
    return Hangs()
