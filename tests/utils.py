"""Shared test helpers: the one dtype -> tolerance table and an assert that
prints the worst mismatches (index, got, expected) instead of a bare bool."""

from __future__ import annotations

import os

import torch

# (atol, rtol) for outputs *stored* in this dtype and compared with a float64
# reference. fp32: a few ulps of fp32 math; fp16/bf16: one rounding of the
# stored value (2**-11 and 2**-8 relative) with room for fp32 intermediates.
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1.3e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 8e-3),
}


def tol(dtype: torch.dtype) -> tuple[float, float]:
    return TOL[dtype]


def assert_close(got: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
                 atol: float | None = None, rtol: float | None = None, name: str = "tensor",
                 show: int = 5) -> None:
    """Assert ``|got - expected| <= atol + rtol * |expected|`` elementwise.

    Tolerances come from :data:`TOL` for ``dtype`` (default: ``got.dtype``)
    unless given. Compares in float64 on the CPU. NaN anywhere fails. On
    failure the message lists the ``show`` worst elements.
    """
    if got.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != expected {tuple(expected.shape)}")
    d_atol, d_rtol = TOL[dtype or got.dtype]
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if torch.isnan(g).any() and not torch.equal(torch.isnan(g), torch.isnan(e)):
        idx = torch.nonzero(torch.isnan(g) & ~torch.isnan(e))[:show].tolist()
        raise AssertionError(f"{name}: NaN at {idx}")
    err = (g - e).abs().nan_to_num(0.0)
    bound = atol + rtol * e.abs().nan_to_num(0.0)
    bad = err > bound
    if bad.any():
        excess = torch.where(bad, err - bound, torch.zeros_like(err)).flatten()
        worst = torch.topk(excess, min(show, int(bad.sum()))).indices
        rows = []
        for flat in worst.tolist():
            idx = tuple(torch.unravel_index(torch.tensor(flat), g.shape)) if g.dim() else ()
            idx = tuple(int(i) for i in idx)
            rows.append(f"  at {idx}: got {g.flatten()[flat].item():.10g}, "
                        f"expected {e.flatten()[flat].item():.10g}, |err| {err.flatten()[flat].item():.3g}")
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.numel()} elements outside atol={atol:g}, rtol={rtol:g}; "
            f"max |err| {err.max().item():.3g}. Worst:\n" + "\n".join(rows))


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floating) so an unwritten element cannot pass a check."""
    return t.fill_(float("nan"))


def tiny_pretrain_argv(*, seq_len: int = 128, tokens_per_batch: int = 512,
                       max_docs: int = 40) -> list[str]:
    """``cp_rope.launch.pretrain`` flags for the launch tests: a ~30K-parameter model and a corpus
    slice small enough for a few steps per second on one CPU core, logging every step, no
    progress bar or TensorBoard."""
    return ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1",
            "--ffn-hidden-dim", "64", "--seq-len", str(seq_len),
            "--tokens-per-batch", str(tokens_per_batch), "--max-docs", str(max_docs),
            "--warmup-steps", "2", "--log-every", "1", "--no-progress", "--no-tensorboard",
            "--tokenizer", "bytes", "--eval-docs", "0"]  # BPE and held-out eval: test_results.py


def script_module(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts folder is not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                        f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
