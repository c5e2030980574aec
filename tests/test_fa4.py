"""The ``fa4`` block backend and ``auto``'s per-length dispatch (parallel/_fa4.py), on the CPU.

The glue runs over fake kernels (tests/fa4_utils.py for FA4, tests/attention_utils.py's for
cuDNN: both write NaN wherever their kernel need not write) in float64 and is compared with
the float64 oracle (cp 1) and with the reference backend on the same plans (simulated ranks
of cp 2: ring and all-gather blocks, skipped keys, keyless queries). Then the rule: the
split of a block by the crossover, get_backend's choice, the cost model's per-segment table,
the calibration's crossover table (measurement rule, file round trip, refusal of a file from
another FA4 version), and the trainers' refusal of ``--attn-backend fa4`` where it cannot run.
"""

from __future__ import annotations

import json
import random

import fa4_utils
import numpy as np
import pytest
import torch
from attention_utils import (
    F64_EXACT,
    fake_cudnn_dense_bwd,
    fake_cudnn_dense_fwd,
    fake_cudnn_thd_bwd,
    fake_cudnn_thd_fwd,
    naive_attention,
    naive_lse,
)
from fa4_utils import fake_fa4_bwd, fake_fa4_fwd, zero_outside
from utils import assert_close

from cp_rope.parallel import (
    CPAttentionPlan,
    _blocks,
    _compat,
    calibrate,
    context_parallel_attention,
    cost_model,
)
from cp_rope.parallel._cudnn_thd import CudnnTHD
from cp_rope.parallel._fa4 import (
    MIN_BUCKET,
    SPLIT_MIN_ROWS,
    CudnnFa4,
    Fa4,
    bucket,
    split_block,
)

CUDNN_CALLS = []


def _cudnn_fwd(q, k, v, cu_q, cu_k, *rest):
    CUDNN_CALLS.append("fwd")
    q, k, v = zero_outside(q, cu_q), zero_outside(k, cu_k), zero_outside(v, cu_k)
    return fake_cudnn_thd_fwd(q, k, v, cu_q, cu_k, *rest)


def _cudnn_bwd(dout, q, k, v, out, lse_padded, cu_q, cu_k, *rest):
    CUDNN_CALLS.append("bwd")
    dout, q, out = (zero_outside(x, cu_q) for x in (dout, q, out))
    k, v = zero_outside(k, cu_k), zero_outside(v, cu_k)
    return fake_cudnn_thd_bwd(dout, q, k, v, out, lse_padded, cu_q, cu_k, *rest)


_REAL_FA4_FWD = _compat.fa4_varlen_fwd  # the op's wrapper (the fakes fixture replaces it)


@pytest.fixture
def fakes(monkeypatch):
    """Backends on the CPU over the fake kernels: ``fakes["auto"] = crossover`` selects
    CudnnFa4(crossover, fakes["min_rows"]) for backend "auto" (min_rows 0: every short
    segment on cuDNN, so that small layouts split); "fa4" and "cudnn" are the real glue."""
    from cp_rope.parallel import attention as att

    monkeypatch.setattr(_compat, "fa4_varlen_fwd", fake_fa4_fwd)
    monkeypatch.setattr(_compat, "fa4_varlen_bwd", fake_fa4_bwd)
    monkeypatch.setattr(_compat, "cudnn_thd_fwd", _cudnn_fwd)
    monkeypatch.setattr(_compat, "cudnn_thd_bwd", _cudnn_bwd)
    monkeypatch.setattr(_compat, "cudnn_dense_fwd", fake_cudnn_dense_fwd)
    monkeypatch.setattr(_compat, "cudnn_dense_bwd", fake_cudnn_dense_bwd)
    state = {"auto": 64, "min_rows": 0}
    real = _blocks.get_backend
    made = {"fa4": Fa4, "cudnn": CudnnTHD,
            "auto": lambda: CudnnFa4(state["auto"], state["min_rows"])}
    monkeypatch.setattr(att, "get_backend",
                        lambda name, q, n, **kw: made[name]() if name in made else real(name, q, n,
                                                                                        **kw))
    fa4_utils.CALLS.clear()
    CUDNN_CALLS.clear()
    return state


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)


def _run(q, k, v, dout, **kw):
    qx, kx, vx = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = context_parallel_attention(qx, kx, vx, return_lse=True, **kw)
    out.backward(dout)
    return out.detach(), lse, qx.grad, kx.grad, vx.grad


LAYOUTS = {  # edge layouts: zero-length, one-token and odd-length documents; skewed batches
    "edges": [0, 1, 7, 300, 0, 33, 129, 2, 1],
    "one long": [517],
    "long first": [300] + [3] * 40,
    "long in the middle": [2] * 20 + [260] + [2] * 20 + [0] + [130] + [1] * 20,
}


@pytest.mark.parametrize("backend", ["fa4", "auto"])
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("causal", [True, False])
def test_cp1_matches_oracle(fakes, backend, name, causal):
    """fa4 alone and auto (FA4 from 64 query rows, cuDNN below) against the float64 oracle,
    GQA 4:1, trailing rows that belong to no document."""
    lens = LAYOUTS[name]
    gen = torch.Generator().manual_seed(len(lens) + causal)
    cu = _cu(lens)
    n = int(cu[-1]) + 3
    q, k, v, dout = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64)
                     for h in (4, 1, 1, 4))
    kw = {} if causal else {"causal": False, "seq_lens": torch.tensor(lens)}
    got = _run(q, k, v, dout, cu_seqlens=cu, max_seqlen=max(lens), backend=backend, **kw)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(*ref_in, cu, causal, 8 ** -0.5, kw.get("seq_lens"))
    grads = torch.autograd.grad(ref, ref_in, dout)
    exp = (ref.detach(), naive_lse(q, k, cu, causal, 8 ** -0.5, kw.get("seq_lens")), *grads)
    for nm, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, exp, strict=True):
        assert_close(a, b, **F64_EXACT, name=f"{backend} {name} causal={causal} {nm}")
    assert fa4_utils.CALLS, "FA4 was never called"
    mixed = backend == "auto" and any(0 < x < 64 for x in lens) and max(lens) >= 64
    assert not mixed or CUDNN_CALLS, "auto ran no short document on cuDNN"


def _plan(local_cu, cp_size, rank, method, **kw):
    max_local = max(int((local_cu[1:] - local_cu[:-1]).max()), 1)
    return CPAttentionPlan.simulated(local_cu, max_local, cp_size=cp_size, cp_rank=rank,
                                     q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float64,
                                     device="cpu", method=method, **kw)


@pytest.mark.parametrize("method,causal", [("ring", True), ("allgather", True),
                                           ("ring", False), ("ulysses", True)])
def test_simulated_ranks_match_reference(fakes, method, causal):
    """Each rank of cp 2 (its blocks run in turn, the partials merged; ulysses: its
    head-sharded blocks over loopback all-to-alls): fa4 and auto equal the reference backend
    on the same plan and inputs, exactly in float64."""
    lens = [4] * 20 + [260 * 2] + [4] * 20 + [0] + [150 * 2] + [16] * 10 + [4]
    local = _cu([n // 2 for n in lens])
    kw = {} if causal else {"causal": False, "seq_lens": torch.tensor(lens)}
    fakes["auto"] = 128
    for r in range(2):
        gen = torch.Generator().manual_seed(r)
        n = int(local[-1])
        q, k, v, dout = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64)
                         for h in (4, 2, 2, 4))
        res = {b: _run(q, k, v, dout, plan=_plan(local, 2, r, method, backend=b, **kw))
               for b in ("fa4", "auto", "reference")}
        for b in ("fa4", "auto"):
            for nm, x, y in zip(("out", "lse", "dq", "dk", "dv"), res[b], res["reference"],
                                strict=True):
                assert_close(x, y, **F64_EXACT, name=f"{b} cp2 {method} rank {r} {nm}")
    assert fa4_utils.CALLS and CUDNN_CALLS


def test_bucket_is_a_small_stable_set():
    """max_seqlen as FA4 sees it: a bound, >= MIN_BUCKET (never one tile), 64 x 2^k: at most
    log2(T / 256) + 1 values for any batch (FA4 compiles per variant)."""
    seen = set()
    for n in range(0, 70000, 7):
        b = bucket(n)
        assert b >= max(n, MIN_BUCKET) and (b == MIN_BUCKET or b < 2 * n)
        seen.add(b)
    assert seen == {256 << i for i in range(10)}, sorted(seen)


def _rows_of(cu, mask):
    return {r for i in np.flatnonzero(mask) for r in range(int(cu[i]), int(cu[i + 1]))}


def test_split_block_partitions_segments():
    """Random blocks (keyless queries, skipped keys, short and long documents): FA4's
    sub-block keeps exactly the segments of >= crossover query rows (and those without
    queries or keys), cuDNN's exactly the shorter ones; q_rows / k_rows are their rows."""
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randrange(1, 30)
        lq = [rng.choice([0, 1, 3, 40, 64, 65, 200]) for _ in range(n)]
        lk = [x if rng.random() < 0.7 else rng.choice([0, 5, 90]) for x in lq]
        cq, ck = _cu(lq), _cu(lk)
        blk = _blocks.Block(cq, ck, max(lq), max(lk), False, cu_q_host=cq, cu_k_host=ck)
        sp = split_block(blk, 64, 0)
        assert split_block(blk, 64, 0) is sp  # kept on the block
        lq_t, lk_t = torch.tensor(lq), torch.tensor(lk)
        real = (lq_t > 0) & (lk_t > 0)
        short = real & (lq_t < 64)
        for sub, kept in ((sp.fa4, real & ~short), (sp.cudnn, short)):
            if sub is None:
                assert not bool(kept.any()) or (sub is sp.fa4 and not bool(short.any()))
                continue
            sq = sub.cu_q_host[1:] - sub.cu_q_host[:-1]
            sk = sub.cu_k_host[1:] - sub.cu_k_host[:-1]
            both = (sq > 0) & (sk > 0)
            assert _rows_of(sub.cu_q_host, both) == _rows_of(cq, kept)
            assert _rows_of(sub.cu_k_host, both) == _rows_of(ck, kept)
            assert int(sub.cu_q_host[-1]) == int(cq[-1]) and int(sub.cu_k_host[-1]) == int(ck[-1])
        if sp.fa4 is not None and sp.cudnn is not None:
            assert set(sp.q_rows.tolist()) == _rows_of(cq, short)
            assert set(sp.k_rows.tolist()) == _rows_of(ck, short)



@pytest.mark.parametrize("short_rows", [SPLIT_MIN_ROWS - 1, SPLIT_MIN_ROWS])
def test_split_needs_min_rows_of_short_segments(short_rows):
    """Short segments (below the crossover) go to cuDNN only when they hold at least
    SPLIT_MIN_ROWS query rows in all; fewer stay on FA4 with the long ones, also in a block
    of short segments alone. Segments without keys do not count."""
    rng = random.Random(short_rows)
    parts, left = [], short_rows
    while left:
        parts.append(min(left, rng.randrange(1, 1024)))
        left -= parts[-1]
    for lq in ([3000, *parts, 0, 1500], parts):
        lq_x, lk_x = [*lq, 500], [*lq, 0]  # a keyless short segment: not counted
        cq, ck = _cu(lq_x), _cu(lk_x)
        blk = _blocks.Block(cq, ck, max(lq_x), max(lk_x), True, cu_q_host=cq, cu_k_host=ck)
        sp = split_block(blk, 1024)
        short = sum(x for x in lq if 0 < x < 1024)
        on_cudnn = short >= SPLIT_MIN_ROWS
        assert (sp.cudnn is not None) == on_cudnn, (short, lq[:3])
        assert (sp.fa4 is blk) == (not on_cudnn)
        if on_cudnn and lq is parts:
            assert sp.fa4 is None  # all short: cuDNN alone


def test_auto_keeps_few_short_rows_on_fa4(fakes):
    """End to end over the fake kernels with the default rule: a long document and a few
    short ones run in one FA4 call (no cuDNN call); with SPLIT_MIN_ROWS short rows the short
    ones run on cuDNN; both match the float64 oracle exactly."""
    fakes["auto"], fakes["min_rows"] = 64, SPLIT_MIN_ROWS
    for lens, cudnn in (([300, 40, 50, 7], False), ([300, *[32] * (SPLIT_MIN_ROWS // 32)], True)):
        cu = _cu(lens)
        n = int(cu[-1])
        gen = torch.Generator().manual_seed(len(lens))
        q, k, v, dout = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64)
                         for h in (4, 2, 2, 4))
        fa4_utils.CALLS.clear()
        CUDNN_CALLS.clear()
        res = {b: _run(q, k, v, dout, cu_seqlens=cu, max_seqlen=max(lens), backend=b)
               for b in ("auto", "reference")}
        assert bool(CUDNN_CALLS) == cudnn and fa4_utils.CALLS, (lens[:3], len(CUDNN_CALLS))
        for nm, x, y in zip(("out", "lse", "dq", "dk", "dv"), res["auto"], res["reference"],
                            strict=True):
            assert_close(x, y, **F64_EXACT, name=f"auto {len(lens)} segments {nm}")

def test_get_backend_auto_rule(monkeypatch):
    """auto: cuDNN + FA4 by the calibration's crossover (the plan's; None: the shipped one)
    where both run; the one that runs otherwise (FA4 beyond cuDNN's head_dim 128); an explicit
    fa4 that cannot run raises naming it and the reason."""
    import dataclasses

    from cp_rope.parallel._calibration import default_calibration

    runs = {"cudnn", "fa4", "reference"}

    def unsupported(b, q, n):
        if b == "cudnn" and q.shape[-1] > 128:
            return "head_dim"
        return None if b in runs else "no"
    monkeypatch.setattr(_blocks, "_unsupported", unsupported)
    for d, cross in ((64, 1024), (128, 1024), (96, 1024)):
        be = _blocks.get_backend("auto", torch.zeros(4, 2, d), 3)
        assert isinstance(be, CudnnFa4) and be.crossover == cross == \
            default_calibration().crossover_at(d), (d, be.crossover)
        assert be.min_rows == SPLIT_MIN_ROWS  # the rule of the module docstring, as built
    mine = dataclasses.replace(default_calibration(), crossover={64: 77})
    assert _blocks.get_backend("auto", torch.zeros(4, 2, 64), 3, calibration=mine).crossover == 77
    assert isinstance(_blocks.get_backend("auto", torch.zeros(4, 2, 192), 3), Fa4)
    runs.discard("fa4")
    assert isinstance(_blocks.get_backend("auto", torch.zeros(4, 2, 64), 3), CudnnTHD)
    assert not isinstance(_blocks.get_backend("auto", torch.zeros(4, 2, 64), 3), CudnnFa4)
    with pytest.raises(ValueError, match="backend='fa4' no"):
        _blocks.get_backend("fa4", torch.zeros(4, 2, 64), 3)


def test_backend_unavailable_names_the_install_command(monkeypatch):
    monkeypatch.setattr(_compat, "_fa4", lambda: (None, "needs flash-attn-4, which is not "
                                                  "importable (ModuleNotFoundError)"))
    why = _blocks.backend_unavailable("fa4", device="cuda", dtype=torch.bfloat16, head_dim=64)
    assert "flash-attn-4" in why and 'pip install "cp-rope[fa4]"' in why
    for kw, text in (({"device": "cpu"}, "needs CUDA"),
                     ({"device": "cuda", "dtype": torch.float32}, "float16/bfloat16")):
        args = {"dtype": torch.bfloat16, "head_dim": 64, **kw}
        assert text in _blocks.backend_unavailable("fa4", **args)
    assert _blocks._fa4_head_dim(9, 256) is None and _blocks._fa4_head_dim(9, 72) is None
    assert "8-256" in _blocks._fa4_head_dim(9, 264) and "8-256" in _blocks._fa4_head_dim(9, 4)
    assert "8-128 or 256" in _blocks._fa4_head_dim(10, 192)


def test_fa2_is_told_apart_from_fa4(monkeypatch):
    """A flash_attn namespace without flash-attn 2's extension (FA4's flash_attn/cute alone)
    is not the flash_attn backend."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn_2_cuda" else real(name, *a))
    _compat._flash_attn_interface.cache_clear()
    try:
        assert not _compat.flash_attn_available()
    finally:
        _compat._flash_attn_interface.cache_clear()


def test_cost_model_auto_uses_the_crossover(monkeypatch):
    """predict(backend="auto"): per segment fa4's table from the crossover up, cudnn's below;
    cudnn's alone when FA4 is not importable."""
    from cp_rope.parallel._calibration import default_calibration

    cal = default_calibration()
    kw = dict(cp_size=1, q_heads=32, kv_heads=8, head_dim=64, calibration=cal)
    s = cost_model.Setting("zigzag", None, "ring")
    long, short = [0, 32768], [0, *range(256, 256 * 65, 256)]
    monkeypatch.setattr(_compat, "fa4_unavailable", lambda: None)
    pred = {b: {name: cost_model.predict(cu, s, backend=b, **kw)
                for name, cu in (("long", long), ("short", short))}
            for b in ("auto", "cudnn", "fa4")}
    assert pred["auto"]["long"] == pred["fa4"]["long"] < pred["cudnn"]["long"]
    assert pred["auto"]["short"] == pred["cudnn"]["short"] < pred["fa4"]["short"]
    both = [0, 32768, *range(32768 + 256, 32768 + 256 * 65, 256)]
    mixed = cost_model.predict(both, s, backend="auto", **kw)
    t_long = cost_model.predict(long, s, backend="fa4", **kw)
    t_short = cost_model.predict(short, s, backend="cudnn", **kw)
    seg = 65 * 32 * cal.seg_ns * 1e-6 - 64 * 32 * cal.seg_ns * 1e-6 - 32 * cal.seg_ns * 1e-6
    assert mixed == pytest.approx(t_long + t_short + seg, rel=1e-9)
    for n_short in (SPLIT_MIN_ROWS - 1, SPLIT_MIN_ROWS):  # the split's rule at its bound
        lens = [256] * (n_short // 256) + [n_short % 256] * (n_short % 256 > 0)
        short = [0, *np.cumsum(lens).tolist()]
        cu = [0, *(32768 + x for x in short)]
        got = cost_model.predict(cu, s, backend="auto", **kw)
        if n_short < SPLIT_MIN_ROWS:  # all on FA4
            assert got == cost_model.predict(cu, s, backend="fa4", **kw)
        else:  # as the mixed layout above: FA4's long part plus cuDNN's short one
            assert got == pytest.approx(t_long + cost_model.predict(short, s, backend="cudnn",
                                                                    **kw), rel=1e-9)
    # a window shorter than the documents: windowed blocks run on FA4 alone (WINDOW_BACKENDS),
    # so auto is priced as fa4 however short the documents
    win = {b: cost_model.predict(both, s, backend=b, window=512, **kw) for b in ("auto", "fa4")}
    assert win["auto"] == win["fa4"] != cost_model.predict(both, s, backend="cudnn", window=512,
                                                           **kw)
    monkeypatch.setattr(_compat, "fa4_unavailable", lambda: "absent")
    assert cost_model.predict(long, s, backend="auto", **kw) == pred["cudnn"]["long"]


def test_crossover_at_nearest_head_dim():
    import dataclasses

    from cp_rope.parallel._calibration import default_calibration

    cal = dataclasses.replace(default_calibration(), crossover={64: 500, 128: 900, 256: 3000})
    got = {d: cal.crossover_at(d) for d in (8, 64, 80, 90, 96, 128, 181, 182, 4096)}
    # nearest by ratio: 90.5 is the geometric middle of 64 / 128 (tie: the smaller head_dim)
    assert got == {8: 500, 64: 500, 80: 500, 90: 500, 96: 900, 128: 900, 181: 900, 182: 3000,
                   4096: 3000}, got
    assert dataclasses.replace(cal, crossover={}).crossover_at(64) is None


def test_crossover_measurement_rule():
    L = [64, 128, 256, 512, 1024]
    assert calibrate.crossover_from(L, [1, 2, 3, 4, 5], [2, 2, 3.5, 3.9, 4.9]) == 512
    assert calibrate.crossover_from(L, [1, 2, 3, 4, 5], [1, 1, 1, 1, 1]) == 64
    assert calibrate.crossover_from(L, [1, 2, 3, 4, 5], [1, 1, 1, 1, 6]) == calibrate.NEVER
    assert calibrate.crossover_from(L, [1, 2, 3, 4, 5], [0.5, 3, 1, 1, 1]) == 256


def test_calibration_file_keeps_and_checks_the_crossover(tmp_path, monkeypatch):
    from cp_rope.parallel._calibration import (
        CalibrationError,
        default_calibration,
        load_calibration,
        save_calibration,
    )

    cal = default_calibration("cpu")
    path = str(tmp_path / "cal.json")
    save_calibration(cal, path)
    monkeypatch.setattr(_compat, "fa4_version", lambda: "4.0.0b36")
    got = load_calibration(path, "cpu")
    assert got.crossover == {64: 1024, 128: 1024} and got.fa4_version == "4.0.0b36"
    assert got.crossover_at(80) == 1024 and got.crossover_at(256) == 1024
    monkeypatch.setattr(_compat, "fa4_version", lambda: "4.0.0b40")
    with pytest.raises(CalibrationError, match="cal.json.*flash-attn-4 4.0.0b36.*4.0.0b40"):
        load_calibration(path, "cpu")
    monkeypatch.setattr(_compat, "fa4_version", lambda: None)  # FA4 absent: table unused
    assert load_calibration(path, "cpu").crossover_at(64) == 1024
    raw = json.load(open(path))
    del raw["crossover"], raw["fa4_version"]  # a file from before FA4
    json.dump(raw, open(path, "w"))
    assert load_calibration(path, "cpu").crossover_at(64) is None
    raw["crossover"] = {"64": -1}
    json.dump(raw, open(path, "w"))
    with pytest.raises(CalibrationError, match="crossover"):
        load_calibration(path, "cpu")


def test_trainer_refuses_fa4_on_cpu():
    from cp_rope.launch.config import ConfigError, preset, validate

    cfg = preset("tiny")
    cfg.parallel.attn_backend = "fa4"
    cfg.train.device = "cpu"
    with pytest.raises(ConfigError, match=r"^parallel.attn_backend='fa4': needs CUDA"):
        validate(cfg, 1)


# --------------------------------------------------------------------------- windows and sinks

def test_fa4_window_convention():
    """cp_rope's window W (query p sees keys p - W + 1 .. p) is FA4's causal
    ``window_size=(W - 1, 0)``; the halo pieces' flash-attn ``(0, -1)`` goes to FA4 as
    ``(0, None)`` (FA4 reads a -1 right bound as a bound: 4.0.0b36 keeps it, excluding the
    diagonal; later versions drop a window with left + right < 0)."""
    from fa4_utils import fa4_mask
    from window_utils import window_mask

    from cp_rope.parallel._blocks import Block, _Reference
    from cp_rope.parallel._fa4 import fa4_window

    assert fa4_window(None) == (None, None)
    assert fa4_window((6, 0)) == (6, 0) and fa4_window((0, -1)) == (0, None)
    assert fa4_mask(False, (0, None)) == (False, (0, -1))
    with pytest.raises(AssertionError, match="negative bound"):  # the fakes refuse -1
        fake_fa4_fwd(*(torch.zeros(2, 1, 8, dtype=torch.float64),) * 3, _cu([2]), _cu([2]),
                     MIN_BUCKET, MIN_BUCKET, False, 1.0, window=(0, -1))
    n = 9
    for W in (1, 2, 5, 9, 20):
        causal, win = fa4_mask(True, fa4_window((W - 1, 0)))
        blk = Block(torch.tensor([0, n]), torch.tensor([0, n]), n, n, causal, window=win)
        lo, hi = _Reference()._row_windows(blk, n, "cpu")
        j = torch.arange(n)
        seen = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
        assert torch.equal(seen, window_mask(n, W)), W


WINDOW_LENS = [0, 1, 7, 40, 0, 13, 2, 1]


@pytest.mark.parametrize("W", [1, 2, 6, 7, 8, 100])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_windowed_cp1_fa4_matches_oracle(fakes, W, with_sinks):
    """fa4 (fake kernels) with a window and sinks at cp 1 against the float64 oracle of
    tests/window_utils.py: out, LSE and the gradients of q, k, v, sinks; GQA 2:1; edge
    layouts (zero-length, one-token documents; W = 1, W longer than every document)."""
    from window_utils import window_attention

    cu = _cu(WINDOW_LENS)
    n = int(cu[-1]) + 2
    gen = torch.Generator().manual_seed(W + 100 * with_sinks)
    q, k, v, dout = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64)
                     for h in (4, 2, 2, 4))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) if with_sinks else None
    ins = [t.clone().requires_grad_() for t in (q, k, v)] + (
        [sinks.clone().requires_grad_()] if with_sinks else [])
    fa4_utils.WINDOWS.clear()
    fa4_utils.SINK_CALLS.clear()
    out, lse = context_parallel_attention(*ins[:3], cu, max(WINDOW_LENS), backend="fa4",
                                          window=W, sinks=ins[3] if with_sinks else None,
                                          return_lse=True)
    grads = torch.autograd.grad((out * dout).sum(), ins)
    ref = [t.clone().requires_grad_() for t in ins]
    rout, rlse = window_attention(*ref[:3], cu.tolist(), W, ref[3] if with_sinks else None,
                                  8 ** -0.5)
    rgrads = torch.autograd.grad((rout * dout).sum(), ref)
    what = f"fa4 W={W} sinks={with_sinks}"
    assert_close(out, rout, **F64_EXACT, name=f"out {what}")
    assert_close(lse, rlse, **F64_EXACT, name=f"lse {what}")
    for nm, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads, strict=False):
        assert_close(g, rg, **F64_EXACT, name=f"{nm} {what}")
    assert fa4_utils.WINDOWS, "FA4 was never called"
    # cp 1, one block: the sinks go into FA4's kernel (its learnable_sink and dsink), once
    assert fa4_utils.SINK_CALLS == (["fwd", "bwd"] if with_sinks else []), fa4_utils.SINK_CALLS
    if W < max(WINDOW_LENS):  # a window that masks reaches FA4 as its causal local window
        assert (W - 1, 0) in fa4_utils.WINDOWS, fa4_utils.WINDOWS


@pytest.mark.parametrize("C,method", [(2, "ring"), (2, "allgather"), (2, "ulysses"),
                                      (4, "ring"), (4, "allgather")])
def test_windowed_simulated_ranks_fa4_equals_reference(fakes, C, method):
    """Each rank of cp 2 / 4 with windows below, at and above the chunk length and sinks: fa4
    (fake kernels: the windowed ring's diagonal, unmasked and halo pieces through its
    glue) equals the reference backend on the same plan and inputs, exactly in float64."""
    lens = [C * 2 * 9, C * 2, 0, C * 2 * 3, C * 2 * 9 + 2 * C]  # chunks 9, 1, 3, 10
    local = _cu([x // C for x in lens])
    windows = []
    fa4_utils.SINK_CALLS.clear()
    for W in (2, 8, 9, 11, 30):
        fa4_utils.WINDOWS.clear()
        for r in range(C):
            gen = torch.Generator().manual_seed(W * 10 + r)
            n = int(local[-1])
            q, k, v, dout = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64)
                             for h in (4, 2, 2, 4))
            sinks = torch.randn(4, generator=gen, dtype=torch.float64)
            res = {}
            for b in ("fa4", "reference"):
                ins = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
                out, lse = context_parallel_attention(
                    *ins[:3], plan=_plan(local, C, r, method, backend=b, window=W, sinks=True),
                    sinks=ins[3], return_lse=True)
                res[b] = (out, lse, *torch.autograd.grad((out * dout).sum(), ins))
            for nm, x, y in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), res["fa4"],
                                res["reference"], strict=True):
                assert_close(x, y, **F64_EXACT, name=f"fa4 cp{C} {method} W={W} r{r} {nm}")
        windows += fa4_utils.WINDOWS
    assert (1, 0) in windows and (7, 0) in windows, windows  # causal local diagonals
    if method == "ring":
        assert (0, None) in windows, windows  # the halo pieces, right bound None
    # ring / all-gather: several blocks per row, the sinks enter once after the merge, never
    # in a block's kernel; Ulysses: whole sequences after the all-to-all (an inner cp 1 of
    # this rank's heads and sinks), so FA4's kernel takes them
    assert bool(fa4_utils.SINK_CALLS) == (method == "ulysses"), fa4_utils.SINK_CALLS


def test_auto_and_cudnn_with_a_window(monkeypatch):
    """A windowed plan: auto picks the first windowed backend that runs (fa4 where it runs,
    never cudnn); backend cudnn falls back by WINDOW_FALLBACK (fa4, flash_attn,
    torch_flash); torch_cudnn refuses by name."""
    runs = {"cudnn", "fa4", "torch_cudnn", "torch_flash", "reference"}
    monkeypatch.setattr(_blocks, "_unsupported",
                        lambda b, q, n: None if b in runs else "does not run here")
    q = torch.zeros(4, 2, 64)
    assert isinstance(_blocks.get_backend("auto", q, 3, windowed=True), Fa4)
    assert isinstance(_blocks.get_backend("cudnn", q, 3, windowed=True), Fa4)
    assert isinstance(_blocks.get_backend("cudnn", q, 3), CudnnTHD)
    runs.discard("fa4")
    for name in ("auto", "cudnn"):
        assert _blocks.get_backend(name, q, 3, windowed=True).name == "torch_flash"
    with pytest.raises(ValueError, match="backend='torch_cudnn' does not run sliding-window"):
        _blocks.get_backend("torch_cudnn", q, 1, windowed=True)
    runs.discard("torch_flash")
    with pytest.raises(ValueError, match="backend='cudnn' runs sliding-window.*none does"):
        _blocks.get_backend("cudnn", q, 3, windowed=True)
    assert _blocks.get_backend("auto", q, 3, windowed=True).name == "reference"


@pytest.mark.parametrize("backend,lens,in_kernel", [
    ("fa4", [0, 5, 1, 9, 30], True),
    ("auto", [9, 30, 12], True),  # every segment at or above the crossover: all on FA4
    ("auto", [9, 3, 30], False),  # a short one on cuDNN (no sink there): after the merge
])
def test_cp1_sinks_in_fa4s_kernel(fakes, backend, lens, in_kernel):
    """Sinks without a window at cp 1 (GPT-OSS's full layers): the plan's one block takes them
    in FA4's kernel (learnable_sink, dsink from its backward) when the block runs on FA4 alone,
    else after the merge; both against the float64 oracle (out, LSE, dq, dk, dv, dsinks)."""
    from window_utils import window_attention

    fakes["auto"] = 8
    cu = _cu(lens)
    n = int(cu[-1]) + 2
    gen = torch.Generator().manual_seed(sum(lens))
    q, k, v, dout = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64)
                     for h in (4, 2, 2, 4))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    ins = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    fa4_utils.SINK_CALLS.clear()
    out, lse = context_parallel_attention(*ins[:3], cu, max(lens), backend=backend,
                                          sinks=ins[3], return_lse=True)
    grads = torch.autograd.grad((out * dout).sum(), ins)
    ref = [t.clone().requires_grad_() for t in ins]
    rout, rlse = window_attention(*ref[:3], cu.tolist(), None, ref[3], 8 ** -0.5)
    rgrads = torch.autograd.grad((rout * dout).sum(), ref)
    assert_close(out, rout, **F64_EXACT, name=f"out {backend} {lens}")
    assert_close(lse, rlse, **F64_EXACT, name=f"lse {backend} {lens}")
    for nm, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads, strict=True):
        assert_close(g, rg, **F64_EXACT, name=f"{nm} {backend} {lens}")
    assert fa4_utils.SINK_CALLS == (["fwd", "bwd"] if in_kernel else []), fa4_utils.SINK_CALLS
    assert in_kernel or CUDNN_CALLS, "the short document did not run on cuDNN"


@pytest.mark.parametrize("mode,fwd_calls", [("none", 2), ("full", 4), ("selective", 2)])
def test_selective_keeps_fa4s_output(fakes, monkeypatch, mode, fwd_calls):
    """Selective checkpointing with the fa4 backend: FA4's forward runs through the op
    cp_rope::fa4_varlen_fwd, one of ATTENTION_OPS, so the recomputation replays its kept
    output: once per layer as without checkpointing, twice under full; the gradients equal
    those without checkpointing, exactly in float64."""
    from torch import nn

    from cp_rope.launch.offload import wrap_layer

    monkeypatch.setattr(_compat, "fa4_varlen_fwd", _REAL_FA4_FWD)
    monkeypatch.setattr(_compat, "_fa4_kernel_fwd", lambda q, k, v, cq, ck, mq, mk, c, s, left,
                        right, sink: fake_fa4_fwd(q, k, v, cq, ck, mq, mk, c, s, (left, right), sink))
    cu = _cu([5, 17, 1, 9])

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 3 * 16, dtype=torch.float64)

        def forward(self, x):
            q, k, v = self.qkv(x).reshape(-1, 3, 2, 8).unbind(1)
            return x + context_parallel_attention(q, k, v, cu, 17, backend="fa4").reshape(-1, 16)

    torch.manual_seed(0)
    layers = nn.ModuleList(Layer() for _ in range(2))
    ref = [p.detach().clone() for p in layers.parameters()]
    grads = {}
    for m in ("none", mode):
        with torch.no_grad():
            for p, r in zip(layers.parameters(), ref, strict=True):
                p.copy_(r)
                p.grad = None
        for i, layer in enumerate(layers):
            layer.__dict__.pop("forward", None)
            wrap_layer(layer, i, m)
        fa4_utils.CALLS.clear()
        h = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for layer in layers:
            h = layer(h)
        h.square().mean().backward()
        grads[m] = [p.grad.clone() for p in layers.parameters()]
        calls = sum(c[0] == "fwd" for c in fa4_utils.CALLS)
    assert calls == fwd_calls, (mode, fa4_utils.CALLS)
    for a, b in zip(grads["none"], grads[mode], strict=True):
        assert torch.equal(a, b), mode


def test_fa4_op_fake_is_contiguous():
    """cp_rope::fa4_varlen_fwd's fake (meta tensors) gives the kernel's layouts: a contiguous
    [T, H, D] output whatever q's strides (empty_like kept a permuted q's), and an [H, T]
    float32 LSE."""
    q = torch.empty(3, 8, 16, device="meta").permute(1, 0, 2)  # [8, 3, 16], not contiguous
    k = v = torch.empty(8, 1, 16, device="meta")
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device="meta")
    out, lse = torch.ops.cp_rope.fa4_varlen_fwd(q, k, v, cu, cu, 5, 5, True, 0.25, None, None, None)
    assert out.shape == (8, 3, 16) and out.is_contiguous()
    assert lse.shape == (3, 8) and lse.dtype == torch.float32
