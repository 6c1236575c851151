"""``tile.rows.row_sliced``: a row-wise function over slices of the rows equals the function over all of them,
values and gradients (input, weight, bias), on plain PyTorch RMSNorm and LayerNorm in fp32; each slice's forward
and backward see that slice's rows alone, and the output is one tensor written slice by slice."""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.tile.rows import row_sliced, slice_length

S, B, H = 13, 3, 8


def _norm(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(H, eps=1e-5) if kind == "rms" else torch.nn.LayerNorm(H, eps=1e-5)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p))
    return norm


def _run(norm: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, max_rows: int | None):
    norm.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = norm(x) if max_rows is None else row_sliced(norm, x, max_rows)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in norm.named_parameters()}


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("max_rows", [3, 5, 12, 15, 38, S * B, 10 * S * B])
def test_row_sliced_equals_the_whole(kind, max_rows):
    """Slices of 1 position (max_rows 3, 5: 3 rows each), 4 and 5 positions (12, 15: 13 is no multiple), 12 + 1
    (38), one slice (all rows, or more allowed than there are)."""
    norm = _norm(kind)
    torch.manual_seed(1)
    x, g = torch.randn(S, B, H) * 3 + 1, torch.randn(S, B, H)
    ref = _run(norm, x, g, None)
    got = _run(norm, x, g, max_rows)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-6)
    assert got[2].keys() == ref[2].keys() and len(ref[2]) == (1 if kind == "rms" else 2)
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], rtol=1e-6, atol=1e-5)


def test_a_slice_of_one_row():
    """A 2-D input [rows, hidden]: one row a slice."""
    norm = _norm("rms")
    x, g = torch.randn(5, H), torch.randn(5, H)
    ref, got = _run(norm, x, g, None), _run(norm, x, g, 1)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2]["weight"], ref[2]["weight"], rtol=1e-6, atol=1e-5)


class _Counted(torch.autograd.Function):
    """The identity, recording the rows each forward and backward call sees."""
    calls: list[tuple[str, int]] = []

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001
        _Counted.calls.append(("forward", x.shape[0] * x.shape[1]))
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        _Counted.calls.append(("backward", g.shape[0] * g.shape[1]))
        return g


def test_forward_and_backward_run_per_slice():
    """The function's backward is called once per slice with that slice's rows (the TE norm's backward kernel has
    the forward's limit), never over all rows."""
    norm = _norm("rms")
    _Counted.calls = []
    x = torch.randn(S, B, H, requires_grad=True)
    y = row_sliced(lambda t: norm(_Counted.apply(t)), x, 4 * B)
    y.sum().backward()
    fwd = [r for k, r in _Counted.calls if k == "forward"]
    bwd = [r for k, r in _Counted.calls if k == "backward"]
    assert fwd == [12, 12, 12, 3] and sorted(bwd) == sorted(fwd), _Counted.calls
    assert y.grad_fn is not None and y._base is None  # one output tensor, no view


def test_the_output_is_written_in_place_and_the_slices_freed():
    """Nothing keeps a slice's output alive once written: the write saves no tensor (peak: output + one slice)."""
    import weakref

    norm = _norm("layer")
    refs = []

    def fn(t):  # noqa: ANN001
        y = norm(t)
        refs.append(weakref.ref(y))
        return y

    x = torch.randn(S, B, H, requires_grad=True)
    y = row_sliced(fn, x, 2 * B)
    assert len(refs) == 7 and all(r() is None for r in refs)
    y.sum().backward()
    assert x.grad is not None


def test_no_grad_and_errors():
    norm = _norm("rms")
    x = torch.randn(S, B, H)
    with torch.no_grad():
        torch.testing.assert_close(row_sliced(norm, x, 7), norm(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="3 rows, past the 2 rows"):
        row_sliced(norm, x, 2)
    with pytest.raises(ValueError, match="row-wise"):
        row_sliced(lambda t: t.sum(0, keepdim=True), x, 6)
    assert slice_length(3, 10) == 3
