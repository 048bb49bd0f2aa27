"""The weight average's arithmetic (training/ema.py)."""
from __future__ import annotations

import torch

from training.ema import WeightAverage


def test_the_average_copies_the_weights_before_its_start_then_decays_towards_them():
    model = torch.nn.Linear(2, 1)
    average = WeightAverage(model, decay=0.9, start=2)
    weights = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]]), torch.tensor([[0.0, 5.0]])]
    with torch.no_grad():
        model.weight.copy_(weights[0])
    average.update(model, step=1)  # before `start`: the weights themselves
    assert torch.equal(average.average["weight"], weights[0])
    expected = weights[0]
    for step, w in enumerate(weights[1:], start=2):
        with torch.no_grad():
            model.weight.copy_(w)
        average.update(model, step)
        expected = 0.9 * expected + 0.1 * w
        assert torch.allclose(average.average["weight"], expected)
    with average.swapped_in(model) as own:  # the average in the model, its weights handed out
        assert torch.equal(model.weight, average.average["weight"])
        assert torch.equal(own["weight"], weights[-1])
    assert torch.equal(model.weight, weights[-1])  # and back
