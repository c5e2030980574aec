"""Issue 30: the trainers' one ``--loss-impl`` field (``parallel.loss_impl``, typed by
``choices.LOSS_IMPLS``): pretrain parses it, refuses what cannot run, runs it and logs it."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from utils import tiny_pretrain_argv

from cp_rope.launch import model as model_module
from cp_rope.launch.cli import parse_args
from cp_rope.launch.config import ConfigError, ParallelConfig, validate
from cp_rope.parallel.choices import LOSS_IMPLS, LossImpl


def test_one_field_typed_by_the_one_list():
    assert typing.get_type_hints(ParallelConfig)["loss_impl"] == LossImpl
    assert typing.get_args(LossImpl) == LOSS_IMPLS
    pytest.importorskip("transformers")
    from cp_rope.launch.finetune_hf import HFConfig

    assert "loss_impl" not in {f.name for f in dataclasses.fields(HFConfig)}  # not re-declared


@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_pretrain_parses_loss_impl(impl):
    assert parse_args(["--loss-impl", impl]).parallel.loss_impl == impl
    assert parse_args([]).parallel.loss_impl == "auto"


def test_pretrain_refuses_a_loss_impl_typo():
    with pytest.raises(SystemExit) as exc:
        parse_args(["--loss-impl", "ligr"])
    assert exc.value.code == 2


@pytest.mark.parametrize("flags, match", [
    (["--loss-impl", "liger", "--device", "cpu"], r"parallel\.loss_impl='liger'.*cpu"),
    (["--loss-impl", "liger", "--loss-chunk-size", "512"], r"parallel\.loss_impl='liger'.*chunk"),
    (["--loss-impl", "torch", "--no-fused-loss"], r"parallel\.loss_impl='torch'.*fused loss only"),
])
def test_pretrain_refuses_loss_impl_combinations(flags, match):
    with pytest.raises(ConfigError, match=match):
        validate(parse_args(flags))


def test_pretrain_runs_the_loss_impl_it_is_given(monkeypatch):
    from cp_rope.launch.pretrain import build_model

    cfg = parse_args(["--loss-impl", "torch", "--vocab-size", "64", "--max-seq-len", "16"])
    model = build_model(cfg, torch.device("cpu"))
    assert model.loss_impl == "torch"
    seen = []
    real = model_module.cp_linear_cross_entropy
    monkeypatch.setattr(model_module, "cp_linear_cross_entropy",
                        lambda *a, **k: seen.append(k["impl"]) or real(*a, **k))
    h = torch.randn(5, cfg.model.dim)
    model.head(h, labels=torch.tensor([1, 2, -100, 3, 4]))
    assert seen == ["torch"]


def test_pretrain_logs_the_loss_impl_at_start(tmp_path, capsys):
    from cp_rope.launch.pretrain import main

    main(tiny_pretrain_argv() + ["--steps", "1", "--warmup-steps", "0", "--loss-impl", "torch", "--out-dir",
                                 str(tmp_path)])
    out = capsys.readouterr().out
    assert "loss: fused (torch, chunks of " in out and "(--loss-impl torch)" in out, out
