"""The Nesterov outer step, in place: DiLoCo's formula, no new vector."""

from __future__ import annotations

import torch

from flodl.runtime.sync.outer import NesterovOuter


def _reference(rounds: list[torch.Tensor], n: int, lr: float, mu: float) -> list[torch.Tensor]:
    """The textbook form: g = w_prev - w_avg; m = mu m + g; w = w_prev - lr (g + mu m)."""
    out, prev, m = [], None, torch.zeros(n)
    for avg in rounds:
        if prev is None:
            prev = avg[:n].clone()
            out.append(avg.clone())
            continue
        g = prev - avg[:n]
        m = mu * m + g
        prev = prev - lr * (g + mu * m)
        out.append(torch.cat([prev, avg[n:]]))
    return out


def test_in_place_step_matches_the_formula_and_allocates_no_vector() -> None:
    torch.manual_seed(0)
    n = 50
    rounds = [torch.randn(n + 3) for _ in range(5)]  # 3 float buffers pass through
    expected = _reference(rounds, n, lr=0.7, mu=0.9)
    outer = NesterovOuter(0.7, 0.9, n)
    for avg, want in zip(rounds, expected, strict=True):
        given = avg.clone()
        got = outer.step(given)
        assert got is given  # the caller's vector became the result
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert outer.previous is not None
        torch.testing.assert_close(outer.previous, want[:n], rtol=1e-5, atol=1e-6)
