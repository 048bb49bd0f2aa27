"""A submission that does not parse (a missing colon), as a folder of students' files has: graded,
it must be a row whose diagnosis names the syntax error and its line, and the other files must
still be checked.

Test material for tests/test_check_grading.py; not part of the package.
"""
import torch.nn as nn


class CausalSelfAttention(nn.Module)
    def forward(self, x):
        return x
