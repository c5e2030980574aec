"""cp_rope.parallel.self_test: passes on correct settings (gloo, 2 ranks, every method and both
placements), catches each injected misconfiguration with a clear error on every rank, runs in
seconds, and leaves the RNG state alone."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from cp_rope.parallel import _blocks
from cp_rope.parallel._self_test import SelfTestError, self_test


def test_cp1_passes_and_keeps_rng_state():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    res = self_test(None, dtype=torch.float64, backend="reference")
    assert torch.equal(torch.get_rng_state(), before)
    assert max(res.errors.values()) <= 1e-9, res.errors
    assert set(res.errors) == {"loss", "output", "dq", "dk", "dv", "dW"}
    assert 1 in res.lengths and 0 in res.lengths


def test_cp1_catches_a_wrong_backend(monkeypatch):
    real = _blocks._Reference.forward

    def wrong(self, *args, **kwargs):  # right LSE, output scaled: a wrong block
        parts, aux = real(self, *args, **kwargs)
        return [(o, out * 1.01, lse) for o, out, lse in parts], aux

    monkeypatch.setattr(_blocks._Reference, "forward", wrong)
    with pytest.raises(SelfTestError, match=r"(output|dq|dk|dv) differs.*document \d+"):
        self_test(None, dtype=torch.float64, backend="reference")


def _broken_rope_args(monkeypatch):
    """plan.rope_args() of both plan kinds giving wrong positions (every one halved): what the
    trainers' RoPE would then rotate by; the self-test must see it."""
    from cp_rope.parallel import CPAttentionPlan, PerDocumentPlan

    for cls in (CPAttentionPlan, PerDocumentPlan):
        real = cls.rope_args

        def broken(self, real=real):
            args = real(self)
            return {**args, "position_ids": args["position_ids"] // 2}

        monkeypatch.setattr(cls, "rope_args", broken)


def test_cp1_windows_and_sinks_pass():
    """A full and a windowed layer (W = 4, below the long documents) with sink logits: the
    plan's for_window and sinks against float64 per-document attention."""
    res = self_test(None, dtype=torch.float64, backend="reference", window=[None, 4], sinks=True)
    assert set(res.errors) == {"loss", "output", "dq", "dk", "dv", "dW", "dsinks"}
    assert max(res.errors.values()) <= 1e-9, res.errors


@pytest.mark.parametrize("placement", ["zigzag", "per_document"])
def test_cp1_catches_a_broken_rope_args(monkeypatch, placement):
    """The self-test runs the trainers' path (attention_plan -> plan.rope_args() -> the door
    with plan=): wrong positions from rope_args fail it."""
    assert max(self_test(None, dtype=torch.float64, backend="reference",
                         placement=placement).errors.values()) <= 1e-9
    _broken_rope_args(monkeypatch)
    with pytest.raises(SelfTestError, match=r"(output|dq|dk) differs from the unsharded"):
        self_test(None, dtype=torch.float64, backend="reference", placement=placement)


def _body(rank, world):
    group = dist.group.WORLD
    kw = dict(dtype=torch.float64, backend="reference", head_dim=16)
    t0 = time.perf_counter()
    for placement in ("zigzag", "per_document"):
        for method, u in (("ring", None), ("allgather", None), ("ulysses", None)):
            res = self_test(group, method=method, placement=placement, ulysses_size=u,
                            split_threshold=8 if placement == "per_document" else None, **kw)
            assert max(res.errors.values()) <= 1e-9, (placement, method, res.errors)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5 * 6, elapsed  # <= 5 s per self-test on 2 CPU ranks
    for placement in ("zigzag", "per_document"):  # a windowed layer and sinks at cp 2
        res = self_test(group, method="ring", placement=placement, window=[None, 4], sinks=True,
                        split_threshold=8 if placement == "per_document" else None, **kw)
        assert max(res.errors.values()) <= 1e-9 and "dsinks" in res.errors, res.errors

    def fails(match, **over):
        args = {**kw, **over}
        try:
            self_test(group, **args)
        except SelfTestError as exc:
            assert match in str(exc), str(exc)
            return str(exc)
        raise AssertionError(f"no error for {over}")

    # the group's ranks ordered differently from the data's cp_rank
    fails("group rank 0 holds data cp_rank 1", cp_rank=world - 1 - rank)
    # a batch sharded for another cp_size
    fails("of cp_size 4", cp_size=4)
    # the data placed per document, the attention told zigzag
    fails("(per_document)", data_placement="per_document", split_threshold=None)
    # a backend that returns wrong blocks (only off the diagonal: cp 1 would not see it)
    real = _blocks._Reference.forward

    def wrong(self, q, k, v, block, *args, **kwargs):
        parts, aux = real(self, q, k, v, block, *args, **kwargs)
        if block.causal:
            return parts, aux
        return [(o, out * 0.5, lse) for o, out, lse in parts], aux

    _blocks._Reference.forward = wrong
    try:
        msg = fails("differs from the unsharded computation")
        assert "placement=zigzag" in msg and "method=ring" in msg
    finally:
        _blocks._Reference.forward = real
    # a broken plan.rope_args (the trainers' RoPE positions)
    patch = pytest.MonkeyPatch()
    try:
        _broken_rope_args(patch)
        fails("differs from the unsharded computation")
    finally:
        patch.undo()


def test_two_ranks_pass_and_catch_misconfigurations():
    run_distributed(_body, 2)


def _trainer_body(rank, world, tmp):
    from utils import tiny_pretrain_argv

    from cp_rope.launch.pretrain import main

    common = tiny_pretrain_argv() + ["--cp-size", "2", "--steps", "2", "--fsdp", "off",
                                     "--no-save-final"]
    on = main(common + ["--out-dir", f"{tmp}/on"])
    off = main(common + ["--out-dir", f"{tmp}/off", "--cp-self-test", "off"])
    assert sorted(on["losses"]) == [1, 2]
    assert on["losses"] == off["losses"], (on["losses"], off["losses"])  # bit for bit


def test_training_losses_equal_with_the_self_test_on_and_off(tmp_path):
    run_distributed(_trainer_body, 2, str(tmp_path))


# ------------------------------------------------------------------ bad input (round 3)

def _self_test_disagreement_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    from cp_rope.parallel import SelfTestError, self_test
    g = dist.group.WORLD
    # a rank-local refusal before the CP run: every rank gets the error, none waits
    with pytest.raises(SelfTestError, match=r"rank 1: ValueError: head_dim=7"):
        self_test(g, head_dim=32 if rank == 0 else 7)
    # the test's own seed must agree (else each rank builds other data and CP is blamed)
    with pytest.raises(SelfTestError, match=r"seed differs across the ranks: \[0, 1\]"):
        self_test(g, seed=rank)
    # shapes that differ (a rank with other GQA heads broadcast other-sized tensors: a raw
    # gloo abort before) and the attention each rank would run
    with pytest.raises(SelfTestError, match=r"kv_heads differs across the ranks: \[2, 1\] "
                       r"\(every rank must build the same test batch and attention\)"):
        self_test(g, kv_heads=2 if rank == 0 else 1)
    with pytest.raises(SelfTestError, match=r"q_heads differs .*: \[4, 8\]; head_dim differs "
                       r".*: \[32, 16\]"):
        self_test(g, q_heads=4 if rank == 0 else 8, head_dim=32 if rank == 0 else 16)
    with pytest.raises(SelfTestError, match=r"method differs across the ranks: \['ring', "
                       r"'allgather'\]"):
        self_test(g, method="ring" if rank == 0 else "allgather")
    assert self_test(g).errors  # still usable


def test_self_test_arguments_agree_across_ranks():
    from dist_utils import run_distributed
    run_distributed(_self_test_disagreement_body, 2, timeout_s=30)


@pytest.mark.parametrize("kw,match", [
    ({"device": "cuda"}, r"device='cuda': CUDA is not available"),
    ({"seed": "a"}, r"TypeError: seed must be an int, got str"),
    ({"dtype": torch.int32}, r"TypeError: dtype must be one of"),
    ({"head_dim": 0}, r"ValueError: head_dim=0: must be an even int >= 2"),
])
def test_self_test_own_arguments(kw, match):
    from cp_rope.parallel import SelfTestError, self_test
    if "device" in kw and torch.cuda.is_available():
        pytest.skip("the case of a build without CUDA")
    with pytest.raises(SelfTestError, match=match):
        self_test(**kw)
