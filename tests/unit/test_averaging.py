"""The controller's CPU average (cpu_* modes) in place: the same numbers, no new vector."""

from __future__ import annotations

import torch

from flodl.runtime.sync.averaging import weighted_mean


def test_in_place_mean_equals_the_allocating_one_and_reuses_the_first_snapshot():
    torch.manual_seed(0)
    flats = [torch.randn(10) for _ in range(3)]
    weights, bweights = [0.5, 0.3, 0.2], [0.0, 0.5, 0.5]
    expected = weighted_mean(flats, weights, bweights, n_params=7)
    first = flats[0]
    got = weighted_mean(flats, weights, bweights, 7, in_place=True)
    assert got is first  # the first snapshot became the mean
    assert torch.equal(got, expected)
    assert torch.equal(got[7:], 0.5 * flats[1][7:] + 0.5 * flats[2][7:])
