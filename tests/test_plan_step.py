"""The plan is born from the host batch, once per step (issue 30 item 1).

* Both trainers (pretrain's ``train_step`` / ``HeldOut.evaluate``, finetune_hf's
  ``HFCausalLM``) build one plan per forward, from the host batch, and the models only take it:
  counted here at cp 1 in one process (cp 2 / 4 counts: tests/test_plan_api.py).
* The patched transformers model builds one plan per forward when none is passed (the
  three-line recipe of cp_rope.hf) and none when one is: same logits.
* A plan of another batch handed to a model is a clear error naming ``plan``.
* On CUDA the planning and the step do no device-to-host read (``set_sync_debug_mode``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from utils import assert_close, tiny_pretrain_argv

from cp_rope.parallel import CPAttentionPlan, PackingCollator


class _Counts:
    """Counts CPAttentionPlan.build, the models' attention_plan and forward calls; checks that
    every plan is built from host data."""

    def __init__(self, monkeypatch, model_cls):
        self.builds = self.plans = self.forwards = 0
        real_build = CPAttentionPlan.build.__func__

        def build(cls, cu_seqlens, *a, **kw):
            assert cu_seqlens.device.type == "cpu", "a plan built from device data"
            self.builds += 1
            return real_build(cls, cu_seqlens, *a, **kw)

        real_plan, real_forward = model_cls.attention_plan, model_cls.forward

        def plan(model, batch, *a, **kw):
            self.plans += 1
            return real_plan(model, batch, *a, **kw)

        def forward(model, input_ids, the_plan, **kw):
            self.forwards += 1
            return real_forward(model, input_ids, the_plan, **kw)

        monkeypatch.setattr(CPAttentionPlan, "build", classmethod(build))
        monkeypatch.setattr(model_cls, "attention_plan", plan)
        monkeypatch.setattr(model_cls, "forward", forward)


def test_pretrain_builds_one_plan_per_step(monkeypatch, tmp_path):
    from cp_rope.launch.model import Transformer
    from cp_rope.launch.pretrain import main

    count = _Counts(monkeypatch, Transformer)
    out = main(tiny_pretrain_argv() + ["--steps", "3", "--out-dir", str(tmp_path),
                                       "--no-save-final"])
    assert sorted(out["losses"]) == [1, 2, 3]
    assert count.builds == count.plans == count.forwards == 3, vars(count)


def _llama_dir(tmp_path, transformers):
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2, vocab_size=320,
                             max_position_embeddings=256).save_pretrained(tmp_path / "model")
    import cp_rope.hf as H
    here = os.path.dirname(H.__file__)
    texts = [open(os.path.join(here, f)).read()[i:i + 300] for f in sorted(os.listdir(here))
             if f.endswith(".py") for i in (0, 400)]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)


def test_finetune_hf_builds_one_plan_per_step(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    from cp_rope.launch.finetune_hf import HFCausalLM, main

    _llama_dir(tmp_path, transformers)
    count = _Counts(monkeypatch, HFCausalLM)
    out = main(["--model", f"{tmp_path}/model", "--data", f"{tmp_path}/corpus.jsonl",
                "--steps", "3", "--warmup-steps", "0", "--seq-len", "64", "--tokens-per-batch", "256", "--log-every",
                "1", "--device", "cpu", "--no-progress", "--out-dir", f"{tmp_path}/run",
                "--no-save-final"])
    assert sorted(out["losses"]) == [1, 2, 3]
    # 3 steps, then the held-out batches (HeldOut.evaluate): one plan per forward
    assert count.forwards > 3 and count.builds == count.plans == count.forwards, vars(count)


def _batch(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return PackingCollator(cp_size=1)([{"input_ids": torch.randint(0, 50, (n,), generator=g)}
                                       for n in lens])


def test_patched_model_builds_a_plan_only_when_none_is_passed(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import cp_rope.hf as H

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=50,
                                   max_position_embeddings=128, attention_dropout=0.0)
    model = H.patch_model(transformers.AutoModelForCausalLM.from_config(cfg))
    batch = _batch([21, 5, 13])
    builds = []
    real = CPAttentionPlan.build.__func__
    monkeypatch.setattr(CPAttentionPlan, "build",
                        classmethod(lambda cls, *a, **kw: builds.append(1) or real(cls, *a, **kw)))
    with torch.no_grad():
        own = model(**H.model_inputs(batch)).logits  # the three-line recipe: one build
        assert len(builds) == 1
        plan = H.attention_plan(model, batch)  # the step's plan, from the host batch
        assert len(builds) == 2
        given = model(**H.model_inputs(batch, plan)).logits
        assert len(builds) == 2, "the patched model built a plan although one was passed"
    assert_close(given, own, dtype=torch.float32, name="logits with a passed plan")
    other = H.attention_plan(model, _batch([7, 9]))
    with pytest.raises(ValueError, match=r"plan: built for a batch of 18 rows, got 42"):
        model(**H.model_inputs(batch, other))
    same_rows = H.attention_plan(model, _batch([13, 21, 5]))  # 42 rows, other documents
    with pytest.raises(ValueError, match=r"plan: built for another batch \(its cu_seqlens"):
        model(**H.model_inputs(batch, same_rows))


@pytest.mark.gpu
def test_train_step_plans_without_a_device_sync(monkeypatch):
    """pretrain's train_step on CUDA (bf16, activation checkpointing, fused loss): the plan is
    built from the host batch and the batch moved after it; the step, planning included, does
    no device-to-host read (torch raises on any under sync debug mode "error"). cp_rope's own
    fused loss: Liger's kernel, which ``auto`` takes when it is installed, reads its count of
    non-ignored targets with ``.item()``."""
    from cp_rope.parallel import _loss_impl

    monkeypatch.setattr(_loss_impl, "_LIGER", [(None, "off: its kernel syncs (.item())")])
    from cp_rope.launch.config import ModelConfig
    from cp_rope.launch.model import Transformer
    from cp_rope.launch.parallelize import apply_activation_checkpointing
    from cp_rope.launch.pretrain import train_step

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=2,
                                        ffn_hidden_dim=512, vocab_size=512, max_seq_len=8192))
    model.to(torch.bfloat16)
    model.compute_dtype = torch.bfloat16
    apply_activation_checkpointing(model)
    g = torch.Generator().manual_seed(1)
    batches = [PackingCollator(cp_size=1)(
        [{"input_ids": torch.randint(0, 512, (n,), generator=g)} for n in lens]).pin_memory()
        for lens in ([3000, 1, 700, 4096], [17, 2048, 900])]
    for batch in batches:  # warm-up outside the check: kernels, caches, pinned staging
        train_step(model, batch, None, device=device, reduce_grads=False)
    torch.cuda.synchronize()
    for batch in batches:
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = train_step(model, batch, None, device=device, reduce_grads=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(loss).item()
