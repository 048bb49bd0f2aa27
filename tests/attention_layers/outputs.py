"""Layers whose outputs the checker cannot compare, and layers that forge the checker's answers
(issue 28): each must be refused with one sentence, never judged and never a traceback.

The forging layers write a frame of the sandbox's protocol (an 8-byte little-endian length and
a torch.save'd dict) straight onto the pipe the checker reads, as a hostile file could.

Test material for tests/test_check_attention.py; not part of the package.
"""
import fcntl
import io
import os
import stat
import struct

import torch

from fused import CausalSelfAttention


class ComplexOutput(CausalSelfAttention):
    def forward(self, x):
        return torch.complex(super().forward(x), 1e-3 * torch.ones_like(x))


class SparseOutput(CausalSelfAttention):
    def forward(self, x):
        return super().forward(x).to_sparse()


class QuantizedOutput(CausalSelfAttention):
    def forward(self, x):
        return torch.quantize_per_tensor(super().forward(x).float(), 0.01, 0, torch.qint32)


def forge(answer: dict, then_exit: bool = True) -> None:
    """Write `answer` onto every pipe this process may write to (the checker reads one)."""
    buf = io.BytesIO()
    torch.save(answer, buf)
    frame = struct.pack("<Q", len(buf.getbuffer())) + buf.getvalue()
    for fd in range(3, 64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode) and \
                    fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
                os.write(fd, frame)
        except OSError:
            pass
    if then_exit:
        os._exit(0)


class ForgedShortAnswer(CausalSelfAttention):
    """Answers four probes with one output."""
    def forward(self, x):
        forge({"ys": [torch.zeros(1)], "errors": [None], "captures": [{}]})


class ForgedSparseAnswer(CausalSelfAttention):
    """A sparse tensor where runner.py would never send one."""
    def forward(self, x):
        y = super().forward(x).to_sparse()
        forge({"ys": [y] * 4, "errors": [None] * 4, "captures": [{}] * 4})


class ForgedExit(CausalSelfAttention):
    """Claims its process has exited, then goes on answering."""
    def forward(self, x):
        forge({"exited": 0, "timed_out": False}, then_exit=False)
        return super().forward(x)
