"""Residual dropout written as F.dropout(y, 0.1), whose `training` defaults to True: model.eval()
does not turn it off, so evaluation is random.

Test material for tests/test_check_probes.py; not part of the package.
"""
import torch.nn.functional as F

from separate import MultiHeadSelfAttention


class DropoutInEval(MultiHeadSelfAttention):
    def forward(self, x):
        return F.dropout(super().forward(x), 0.1)  # should pass training=self.training
