"""cp_rope.rms_norm: the fused RMSNorm kernels (Triton, under TRITON_INTERPRET=1 on CPU) against
float64; the backward's row loop, its partial weight gradients, and the PyTorch fallbacks."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close

import cp_rope.rms_norm as R
from cp_rope.rms_norm import rms_norm

DTYPES = [torch.float32, torch.float16]
"""On CPU: triton 3.6's interpreter stores bfloat16 by cutting a float32's low bits (one bf16
ulp off round-to-nearest), which is the interpreter's, not the kernel's; bfloat16 runs on the
GPU (tests/test_hf_norms.py's bf16 checks run the kernel there through patch_model)."""


def _reference(x, w, eps):
    x, w = x.double(), w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _grads(x, w, dy, eps):
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    y = _reference(xr, wr, eps)
    return (y, *torch.autograd.grad(y, (xr, wr), dy.double()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 96), (5, 3, 128), (2500, 64), (3, 1000), (4, 1), (0, 8)])
def test_kernel_matches_float64(dtype, shape):
    """Rows not a whole tile, row lengths not a power of two, a 3-D [T, H, D] input, and
    (2500, 64): more row tiles than the interpreter's backward programs (32 x 32 rows), so each
    program's row loop and its partial weight gradient run more than once."""
    eps = float(torch.empty(()).uniform_(1e-6, 1e-3))
    x = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    w = (torch.randn(shape[-1]) * 0.5 + 1).to(dtype).requires_grad_()
    y = rms_norm(x, w, eps, backend="triton")
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    dy = torch.randn(shape).to(dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    want, want_dx, want_dw = _grads(x, w, dy, eps)
    assert_close(y, want, dtype=dtype, name="y")
    assert_close(dx, want_dx, dtype=dtype, name="dx")
    if not shape[0]:
        assert torch.equal(dw, torch.zeros_like(w))
    else:  # a float32 sum of per-row terms dy * round(x * rstd), each rounded in the dtype as
        # transformers rounds it: the dtype's tolerance on the scale of the terms' absolute sum
        terms = (dy.double() * want / w.detach().double()).abs()
        scale = terms.sum(tuple(range(len(shape) - 1))).clamp_min(1e-30)
        assert_close(dw / scale, want_dw / scale, dtype=dtype, name="dw / sum |terms|")
    with torch.no_grad():  # the launcher alone: the same values
        assert torch.equal(rms_norm(x, w, eps, backend="triton"), y.detach())


def test_rounds_as_transformers():
    """y = round(round(x * rstd) * w), transformers' LlamaRMSNorm, float16: the kernel's
    ``round(x * rstd)`` (``rms_norm(x, 1)``: the product by one is exact) is within one ulp of
    PyTorch's (rsqrt's last float32 bits differ) and equal to it almost everywhere; its result
    is that times ``w`` rounded once, bit for bit (a float16 product is exact in float32)."""
    x = (torch.randn(64, 200) * 2).half()
    w = (torch.randn(200) * 0.5 + 1).half()
    x_hat = rms_norm(x, torch.ones_like(w), 1e-6, backend="triton")
    eager = R._torch_rms_norm(x, torch.ones_like(w), 1e-6)
    ulp = 2.0 ** (torch.floor(torch.log2(eager.double().abs().clamp_min(1e-30))) - 10)
    assert bool(((x_hat.double() - eager.double()).abs() <= ulp).all())
    assert (x_hat == eager).float().mean() > 0.99
    got = rms_norm(x, w, 1e-6, backend="triton")
    assert torch.equal(got, (x_hat.float() * w.float()).half())
    same = (x_hat == eager).all(-1)  # rows whose rstd rounds alike: eager's value exactly
    assert torch.equal(got[same], R._torch_rms_norm(x, w, 1e-6)[same])


def test_non_contiguous_input_and_frozen_weight():
    base = torch.randn(6, 2, 40, requires_grad=True)
    x = base.transpose(0, 1)  # [2, 6, 40], strided
    w = torch.randn(40) * 0.3 + 1  # frozen: no weight gradient asked or returned
    y = rms_norm(x, w, 1e-5, backend="triton")
    dy = torch.randn(2, 6, 40)
    (dbase,) = torch.autograd.grad(y, base, dy)
    want, want_dx, _ = _grads(x, w, dy, 1e-5)
    assert_close(y, want, dtype=torch.float32, name="y")
    assert_close(dbase, want_dx.transpose(0, 1), dtype=torch.float32, name="dx")


def test_float64_and_the_torch_backend_are_the_pytorch_expression(monkeypatch):
    x, w = torch.randn(5, 9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    assert torch.equal(rms_norm(x, w), R._torch_rms_norm(x, w, 1e-6))  # float64
    x32, w32 = x.float(), w.float()
    assert torch.equal(rms_norm(x32, w32), R._torch_rms_norm(x32, w32, 1e-6))  # auto on CPU
    monkeypatch.setattr(R, "MAX_KERNEL_COLS", 8)  # longer rows: PyTorch's, also with triton
    assert torch.equal(rms_norm(x32, w32, backend="triton"), R._torch_rms_norm(x32, w32, 1e-6))


def test_bad_input_names_the_argument(monkeypatch):
    x = torch.randn(4, 8)
    w = torch.ones(8)
    with pytest.raises(TypeError, match="x must be"):
        rms_norm(torch.ones(4, 8, dtype=torch.int64), w)
    with pytest.raises(TypeError, match="weight must be"):
        rms_norm(x, "w")
    with pytest.raises(ValueError, match=r"weight: must be \[8\]"):
        rms_norm(x, torch.ones(9))
    with pytest.raises(ValueError, match="weight: must be"):
        rms_norm(x, w.double())
    with pytest.raises(ValueError, match="x: must have at least one dimension"):
        rms_norm(torch.tensor(1.0), w)
    for eps in (0.0, -1e-6, float("nan"), float("inf"), "1e-6", True):
        with pytest.raises(ValueError, match="eps must be"):
            rms_norm(x, w, eps)
    import numpy as np

    assert torch.equal(rms_norm(x, w, np.float32(1e-5), backend="triton"),
                       rms_norm(x, w, float(np.float32(1e-5)), backend="triton"))
    with pytest.raises(ValueError, match="backend"):
        rms_norm(x, w, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' got CPU tensors"):
        rms_norm(x, w, backend="triton")


def test_double_backward_and_func_transforms():
    """create_graph through the kernel gives the second derivative (float64 reference), not a
    constant first one; vmap / torch.func.grad run the PyTorch expression. (Random linear
    functionals of y and of dx: the derivatives of sums of squares cancel to ~1e-5 relative in
    float32 itself, which is the float32 expression's conditioning, not the kernel's.)"""
    x = torch.randn(4, 7, requires_grad=True)
    w = (torch.randn(7) + 1).requires_grad_()
    g, h = torch.randn(4, 7), torch.randn(4, 7)
    (dx,) = torch.autograd.grad((rms_norm(x, w, backend="triton") * g).sum(), x,
                                create_graph=True)
    got = torch.autograd.grad((dx * h).sum(), (x, w))
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad((_reference(x64, w64, 1e-6) * g.double()).sum(), x64,
                                  create_graph=True)
    want = torch.autograd.grad((dx64 * h.double()).sum(), (x64, w64))
    for a, b, name in zip(got, want, ("d2 x", "d2 w"), strict=True):
        assert_close(a, b, dtype=torch.float32, name=name)
    xs = torch.randn(3, 4, 5)
    w5 = torch.randn(5) + 1
    got = torch.func.vmap(lambda a: rms_norm(a, w5, backend="triton"))(xs)
    assert_close(got, _reference(xs, w5, 1e-6), dtype=torch.float32, name="vmap")
    got = torch.func.grad(lambda a: rms_norm(a, w5, backend="triton").sum())(xs)
    assert_close(got, _grads(xs, w5, torch.ones_like(xs), 1e-6)[1], dtype=torch.float32,
                 name="func.grad")


def test_backward_grid_depends_on_rows_and_sms_only(monkeypatch):
    """The backward launches min(row tiles, 8 x SMs) programs, one partial weight-gradient row
    each: the workspace is [programs, n] float32 whatever the rows hold."""
    grids = []
    kernels = R._kernels()

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernels[2][grid]

    monkeypatch.setattr(R, "_KERNELS", (kernels[0], kernels[1], Spy()))
    for rows in (10, 5000):
        x = torch.randn(rows, 64, requires_grad=True)
        w = torch.ones(64, requires_grad=True)
        torch.autograd.grad(rms_norm(x, w, backend="triton").sum(), (x, w))
    block_row = R._blocks(64, R._BWD_PER_WARP, R._BWD_TILE)[0]
    assert grids == [(1,), (min(-(-5000 // block_row), R._PROGRAMS_PER_SM * 4),)]


# ---------------------------------------------------------------- GPU (gpu_smoke.sh)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_gpu():
    """bfloat16 on the GPU: float64 parity at a hidden row and Qwen3's q-norm rows (more row
    tiles than backward programs), and int64 addressing past 2**31 elements (the last rows
    are right, forward and backward)."""
    dev, bf = "cuda", torch.bfloat16
    for shape in [(37, 96), (8191, 1024), (4096, 16, 128)]:
        x = (torch.randn(shape, device=dev) * 3).to(bf).requires_grad_()
        w = (torch.randn(shape[-1], device=dev) * 0.5 + 1).to(bf).requires_grad_()
        y = rms_norm(x, w)
        dy = torch.randn(shape, device=dev).to(bf)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        want, want_dx, want_dw = _grads(x, w, dy, 1e-6)
        assert_close(y, want, dtype=bf, name="y")
        assert_close(dx, want_dx, dtype=bf, name="dx")
        scale = (dy.double() * want / w.detach().double()).abs().sum(
            tuple(range(len(shape) - 1))).clamp_min(1e-30)
        assert_close(dw / scale, want_dw / scale, dtype=bf, name="dw / sum |terms|")
    rows, n = 2 ** 31 // 128 + 37, 128
    if torch.cuda.mem_get_info()[0] < 7 * rows * n * 2:
        pytest.skip("needs 29 GiB free for the > 2**31-element case")
    x = torch.randn(rows, n, device=dev, dtype=bf).requires_grad_()
    w = torch.ones(n, device=dev, dtype=bf, requires_grad=True)
    y = rms_norm(x, w)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    tail = slice(rows - 1000, rows)
    xt = x.detach()[tail].double().requires_grad_()
    yt = _reference(xt, w.detach().double(), 1e-6)
    (dxt,) = torch.autograd.grad(yt, xt, torch.ones_like(yt))
    assert_close(y[tail], yt, dtype=bf, name="y, last rows")
    assert_close(dx[tail], dxt, dtype=bf, name="dx, last rows")
