"""Static checks of every ``@triton.jit`` function in the package, and the
token-linear launch grid of the RoPE kernel.

* A ``tl.constexpr`` parameter the body never reads is a bug magnet (it
  specializes the kernel on a value for nothing; with a dynamic batch it
  means a recompile per value).
* Every ``tl.program_id(...)`` must be widened at once, ``tl.program_id(a).to(tl.int64)``,
  so that offsets built from it cannot wrap at 2**31 elements.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import cp_rope.kernel as rope_kernel

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ["cp_rope", "parallel", "launch"]  # the folders of cp_rope, cp_rope.parallel, cp_rope.launch


def _is_triton_jit(dec: ast.expr) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return (isinstance(target, ast.Attribute) and target.attr == "jit") or (
        isinstance(target, ast.Name) and target.id == "jit")


def _is_constexpr(ann: ast.expr | None) -> bool:
    return (isinstance(ann, ast.Attribute) and ann.attr == "constexpr") or (
        isinstance(ann, ast.Name) and ann.id == "constexpr")


def _is_int64(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "int64") or (
        isinstance(node, ast.Name) and node.id == "int64")


def lint_source(source: str, filename: str = "<string>") -> list[str]:
    """Problems in the ``@triton.jit`` functions of ``source``, as ``file:line: message``."""
    problems = []
    tree = ast.parse(source, filename)
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or not any(map(_is_triton_jit, fn.decorator_list)):
            continue
        params = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        read = {n.id for stmt in fn.body for n in ast.walk(stmt)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        for arg in params:
            if _is_constexpr(arg.annotation) and arg.arg not in read:
                problems.append(f"{filename}:{arg.lineno}: {fn.name}: tl.constexpr parameter "
                                f"{arg.arg!r} is never read")
        parents = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "program_id"):
                continue
            attr = parents.get(node)
            call = parents.get(attr)
            widened = (isinstance(attr, ast.Attribute) and attr.attr == "to"
                       and isinstance(call, ast.Call) and call.func is attr
                       and len(call.args) == 1 and _is_int64(call.args[0]))
            if not widened:
                problems.append(f"{filename}:{node.lineno}: {fn.name}: tl.program_id not widened "
                                f"with .to(tl.int64)")
    return problems


def _package_sources():
    for d in PACKAGE_DIRS:
        yield from sorted((ROOT / d).rglob("*.py"))


def test_package_kernels_pass_lint():
    files = list(_package_sources())
    jitted = [f for f in files if "triton.jit" in f.read_text()]
    assert ROOT / "cp_rope" / "kernel.py" in jitted  # the checker does look at the kernel
    problems = [p for f in files for p in lint_source(f.read_text(), str(f.relative_to(ROOT)))]
    assert not problems, "\n".join(problems)


BAD_SNIPPET = '''
import triton
import triton.language as tl

@triton.jit
def k(X, n, BLOCK: tl.constexpr, UNUSED: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs), mask=offs < n)

@triton.jit
def k2(X, BLOCK: tl.constexpr):
    start = tl.program_id(axis=1).to(tl.int32) * BLOCK
    tl.store(X + start, 1.0)
'''

GOOD_SNIPPET = '''
import triton
import triton.language as tl

@triton.jit
def k(X, n, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    if FLAG:
        x = -x
    tl.store(X + offs, x, mask=offs < n)

def not_a_kernel(UNUSED: tl.constexpr):
    return tl.program_id(0)
'''


def test_lint_catches_bad_snippets():
    problems = lint_source(BAD_SNIPPET)
    assert len(problems) == 3, problems
    assert any("'UNUSED' is never read" in p for p in problems)
    assert sum("not widened" in p for p in problems) == 2  # bare, and widened to int32
    assert lint_source(GOOD_SNIPPET) == []


# ------------------------------------------------------------- token-linear grid
def _grids(monkeypatch, n_tokens, cu, n_positions):
    """Call the real launcher and record the grid it launches (the kernel is replaced)."""
    seen = []

    class _Recorder:
        def __getitem__(self, grid):
            seen.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(rope_kernel, "_rope_kernel", _Recorder())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors are fine: nothing is launched
    q = torch.randn(n_tokens, 32, 128, dtype=torch.bfloat16)
    k = torch.randn(n_tokens, 8, 128, dtype=torch.bfloat16)
    cos, sin = torch.ones(n_positions, 64), torch.zeros(n_positions, 64)
    rope_kernel.rotary_triton(q, k, torch.empty_like(q), torch.empty_like(k), cos, sin, cu, 1, 0,
                              False, False)
    return seen


def test_grid_is_token_linear(monkeypatch):
    """4096 two-token sequences plus one long one, vs one sequence, vs trailing
    zero-length entries, and caches of different lengths: the same grid, which
    is cdiv(T, BLOCK_T) * head blocks (one axis)."""
    n_tokens = 16384
    many = torch.cat((torch.arange(0, 8193, 2), torch.tensor([n_tokens]))).to(torch.int32)
    one = torch.tensor([0, n_tokens], dtype=torch.int32)
    trailing = torch.tensor([0, 100] + [n_tokens] * 5000, dtype=torch.int32)
    grids = [_grids(monkeypatch, n_tokens, many, 2**20), _grids(monkeypatch, n_tokens, one, n_tokens),
             _grids(monkeypatch, n_tokens, trailing, 2**21)]
    assert grids[0] == grids[1] == grids[2] and len(grids[0]) == 1
    grid, heads_per_prog, meta = rope_kernel.launch_config(n_tokens, 32, 8, 128, 128, 2)
    assert grids[0][0] == grid
    head_blocks = -(-32 // heads_per_prog) + -(-8 // heads_per_prog)
    assert grid == (-(-n_tokens // meta["BLOCK_T"]) * head_blocks,)
    # doubling T doubles the grid
    big, _, _ = rope_kernel.launch_config(2 * n_tokens, 32, 8, 128, 128, 2)
    assert big == (2 * grid[0],)


@pytest.mark.parametrize("head_dim, rotary_dim", [(128, 128), (80, 40), (96, 96), (256, 64)])
def test_launch_meta_is_constexpr_only_for_code_shape(head_dim, rotary_dim):
    """constexprs come from rotary_dim / head_dim / flags only, never from T."""
    a = rope_kernel.launch_config(1000, 8, 2, head_dim, rotary_dim, 2)[2]
    b = rope_kernel.launch_config(123457, 8, 2, head_dim, rotary_dim, 2)[2]
    assert a == b
    assert a["BLOCK_R"] >= rotary_dim // 2 and a["COPY_PASS"] == (head_dim > rotary_dim)
