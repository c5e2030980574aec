"""cp_rope.hf.prepare: a transformers Trainer / TRL SFTTrainer with packed CP, against the same
script on one process without cp_rope.

Tiny random float32 Qwen3 and Llama models saved to a directory (tests/hf_trainer_utils.py;
never downloaded). The reference is the unmodified Trainer on one process (SDPA on TRL's
padding-free rows; transformers' DataCollatorWithFlattening for the plain Trainer); the CP
runs are spawned gloo worlds of 2 ranks (cp 2: Qwen3 and Llama SFT, per-document placement,
plain Trainer with cp_rope's PackingCollator, gradient accumulation and checkpointing,
bf16 autocast, evaluate(), checkpoint + resume, the example script, ranks that disagree) and
of 4 ranks (dp 2 x cp 2, against one process with twice the gradient accumulation). Five
optimizer steps with clipping (max_grad_norm=1) and a moving learning rate: the logged
losses and gradient norms and the final weights agree to 1e-5 relative.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from dist_utils import run_distributed
from hf_trainer_utils import (
    assert_same_run,
    documents,
    example,
    make_model_dir,
    run,
    tokenizer,
    write_jsonl,
)

import cp_rope.hf as H
from cp_rope.hf.trainer_data import documents_of

trl = pytest.importorskip("trl")  # the `trl` extra (scripts/setup.sh installs it for CI)
transformers = H.transformers
DOCS = documents(1, 60)
EVAL = documents(2, 12)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_trainer")
    return {f: make_model_dir(str(root / f), f) for f in ("qwen3", "llama")} | {
        "root": root, "jsonl": write_jsonl(str(root / "docs.jsonl"), DOCS)}


def _example_argv(dirs: dict, out: str) -> list[str]:
    return ["--model-dir", dirs["qwen3"], "--data", dirs["jsonl"], "--seq-len", "64",
            "--steps", "5", "--lr", "3e-3", "--no-bf16", "--out-dir", out, "--timing-warmup", "1"]


@pytest.fixture(scope="module")
def refs(dirs):
    """Single-process runs without cp_rope (the pytest process: no process group)."""
    root = dirs["root"]
    return {
        "sft_qwen3": run("sft", dirs["qwen3"], DOCS, str(root / "ref_sq"), eval_docs=EVAL),
        "sft_llama": run("sft", dirs["llama"], DOCS, str(root / "ref_sl")),
        "plain_qwen3": run("plain", dirs["qwen3"], DOCS, str(root / "ref_pq")),
        "sft_llama_ga2": run("sft", dirs["llama"], DOCS, str(root / "ref_sl2"), grad_accum=2),
        "sft_qwen3_bf16": run("sft", dirs["qwen3"], DOCS, str(root / "ref_sqb"),
                              args_over={"bf16": True}),
        "example": example([*_example_argv(dirs, str(root / "ref_ex")), "--no-cp"]),
    }


# --------------------------------------------------------------------------- batches -> documents
def test_documents_of_padding_free_and_padded():
    ids = torch.arange(10, 19)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    lab = ids.clone()
    lab[0, [0, 3, 5]] = -100
    docs = documents_of({"input_ids": ids, "labels": lab, "position_ids": pos,
                         "cu_seq_lens_q": torch.tensor([0, 3, 5, 9], dtype=torch.int32),
                         "max_length_q": 4, "seq_idx": torch.zeros(1, 9)})
    assert [d["input_ids"].tolist() for d in docs] == [[10, 11, 12], [13, 14], [15, 16, 17, 18]]
    assert docs[1]["labels"].tolist() == [-100, 14]
    # padded rows with positions: the masked tokens, split where the positions restart
    padded = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]),
              "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
              "position_ids": torch.tensor([[0, 1, 0, 0], [0, 1, 0, 0]])}
    assert [d["input_ids"].tolist() for d in documents_of(padded)] == [[5, 6], [7], [8, 9]]
    # no mask, no positions: each row one document, the ids as labels
    rows = documents_of({"input_ids": np.array([[3, 4], [5, 6]])})
    assert [d["labels"].tolist() for d in rows] == [[3, 4], [5, 6]]


@pytest.mark.parametrize("batch, match", [
    ({"input_ids": torch.ones(2, 3, dtype=torch.long),
      "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}, "pads .* without position_ids"),
    ({"input_ids": torch.ones(1, 3, dtype=torch.long), "pixel_values": torch.ones(1)},
     "pixel_values"),
    ({"input_ids": torch.ones(1, 3, dtype=torch.long), "position_ids": torch.tensor([[4, 5, 6]])},
     "start at 4"),
    ({"input_ids": torch.ones(1, 3, dtype=torch.long), "position_ids": torch.tensor([[0, 2, 3]])},
     "not 0, 1, 2"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]]),
      "cu_seq_lens_q": torch.tensor([0, 4], dtype=torch.int32)}, "cu_seq_lens_q"),
])
def test_documents_of_refuses(batch, match):
    with pytest.raises(ValueError, match=match):
        documents_of(batch)


# --------------------------------------------------------------------------- bad input at prepare
def _sft(model_dir, tmp_path, **over):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = dict(output_dir=str(tmp_path), max_steps=1, packing=True, max_length=48,
               per_device_train_batch_size=1, report_to=[], use_cpu=True, bf16=False,
               gradient_checkpointing=False, disable_tqdm=True) | over
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": DOCS[:8]})
    return trl.SFTTrainer(model=model, args=trl.SFTConfig(**cfg), train_dataset=ds,
                          processing_class=tokenizer())


def test_prepare_bad_input(dirs, tmp_path):
    import datasets

    sft = _sft(dirs["qwen3"], tmp_path)
    with pytest.raises(ValueError, match="cp_size=2 must divide the world size 1"):
        H.prepare(sft, cp_size=2)
    with pytest.raises(TypeError, match="trainer must be a transformers.Trainer"):
        H.prepare(object(), cp_size=1)
    with pytest.raises(ValueError, match="per_device_train_batch_size=2"):
        H.prepare(_sft(dirs["qwen3"], tmp_path, per_device_train_batch_size=2), cp_size=1)
    with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length'"):
        H.prepare(_sft(dirs["qwen3"], tmp_path, train_sampling_strategy="group_by_length"),
                  cp_size=1)
    # accelerate's own context / sequence parallelism
    for name in ("cp_size", "sp_size"):
        sft.args.parallelism_config = types.SimpleNamespace(**{name: 2})
        with pytest.raises(ValueError, match=f"parallelism_config.{name}=2"):
            H.prepare(sft, cp_size=1)
    sft.args.parallelism_config = None
    # a sampler override that could give CP ranks different batches
    sub = type("MyTrainer", (trl.SFTTrainer,), {
        "_get_train_sampler": lambda self, ds=None: torch.utils.data.DistributedSampler(
            ds, num_replicas=2, rank=0)})
    sft.__class__ = sub
    with pytest.raises(ValueError, match="_get_train_sampler: MyTrainer returns a DistributedSampler"):
        H.prepare(sft, cp_size=1)
    sft.__class__ = trl.SFTTrainer
    # a collator that pads without position ids (transformers' LM collator)
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["qwen3"], dtype=torch.float32)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          per_device_train_batch_size=2, max_steps=1)
    ds = datasets.Dataset.from_dict({"input_ids": DOCS[:4]})
    pad = transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    plain = transformers.Trainer(model=model, args=args, train_dataset=ds, data_collator=pad)
    with pytest.raises(ValueError, match="data_collator: it pads .* without position_ids"):
        H.prepare(plain, cp_size=1)
    # a family cp_rope does not patch
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2,
                                                                vocab_size=97))
    other = transformers.Trainer(model=gpt2, args=args, train_dataset=ds,
                                 data_collator=transformers.DataCollatorWithFlattening())
    with pytest.raises(ValueError, match="model: model_type 'gpt2' is not supported"):
        H.prepare(other, cp_size=1)
    # a mixture-of-experts model whose router loss prepare's loss would leave out
    moe = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        vocab_size=97, output_router_logits=True, router_aux_loss_coef=0.01))
    other = transformers.Trainer(model=moe, args=args, train_dataset=ds,
                                 data_collator=transformers.DataCollatorWithFlattening())
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01"):
        H.prepare(other, cp_size=1)
    # loss_impl is checked at prepare, as the trainers' --loss-impl (round 4b: ignored, or
    # refused only inside train())
    for kw, match in ((dict(loss_impl="bogus"), r"loss_impl must be one of .*got 'bogus'"),
                      (dict(loss_impl="torch", fused_loss=False), r"loss_impl='torch': is for the "
                       r"fused loss only"),
                      (dict(loss_impl="liger"), r"loss_impl='liger': Liger-Kernel's kernels run "
                       r"on CUDA and the trainer is on cpu"),
                      (dict(loss_impl="liger", loss_chunk_size=512), r"loss_chunk_size=512"),
                      # round 5 #6, #7: accepted, then ignored or refused at step 1 naming a
                      # command-line flag
                      (dict(fused_loss=False, loss_chunk_size=8), r"loss_chunk_size=8: is for "
                       r"the fused loss only"),
                      (dict(loss_chunk_size=-5), r"loss_chunk_size must be >= 0, got -5")):
        with pytest.raises(ValueError, match=match):
            H.prepare(sft, cp_size=1, **kw)
    with pytest.raises(TypeError, match=r"loss_chunk_size must be an int, got float"):
        H.prepare(sft, cp_size=1, loss_chunk_size=2.5)
    # round 5 #2, #3: the Trainer's label smoothing and its own loss function were dropped
    sft.args.label_smoothing_factor = 0.3
    with pytest.raises(ValueError, match=r"args\.label_smoothing_factor=0\.3: .* without label "
                                         r"smoothing"):
        H.prepare(sft, cp_size=1)
    sft.args.label_smoothing_factor = 0.0
    sft.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.loss * 0
    with pytest.raises(ValueError, match=r"compute_loss_func: prepare's loss"):
        H.prepare(sft, cp_size=1)
    sft.compute_loss_func = None
    # final pass #1, #2: TRL's loss_type="dft" and a subclass's compute_loss ran as plain NLL
    sft.args.loss_type = "dft"
    with pytest.raises(ValueError, match=r"args\.loss_type='dft': prepare's CP loss"):
        H.prepare(sft, cp_size=1)
    sft.args.loss_type = "nll"

    class Tripled(type(sft)):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs) * 3

    cls = type(sft)
    sft.__class__ = Tripled
    with pytest.raises(ValueError, match=r"compute_loss: Tripled overrides it"):
        H.prepare(sft, cp_size=1)
    sft.__class__ = cls
    # nothing above changed the trainers; a good one prepares once, not twice
    assert type(sft) is trl.SFTTrainer and not hasattr(sft.model, "cp_rope_patch")
    H.prepare(sft, cp_size=1)
    assert type(sft).__name__ == "CPRopeSFTTrainer"
    with pytest.raises(ValueError, match="already prepared"):
        H.prepare(sft, cp_size=1)


def test_example_refuses_bad_flags_in_one_line(dirs, tmp_path, capsys, monkeypatch):
    """A fresh user's try: --cp-size 3 at world 2 or --method bogus gave a traceback on every
    rank from prepare; the example's own parser now refuses them, naming the flag."""
    from utils import script_module

    parse = script_module("sft_trl_example").parse_args
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["--model-dir", dirs["qwen3"], "--data", dirs["jsonl"]]
    for flags, match in ((["--cp-size", "3"], "--cp-size 3: must be >= 1 and divide the world "
                                                "size 2"),
                         (["--method", "bogus"], "argument --method: invalid choice: 'bogus'"),
                         (["--backend", "nope"], "argument --backend: invalid choice: 'nope'")):
        with pytest.raises(SystemExit):
            parse(base + flags)
        assert match in capsys.readouterr().err, flags
    assert parse(base + ["--cp-size", "2"]).cp_size == 2


def test_prepare_one_process_matches(dirs, refs, tmp_path):
    """cp_size=1 on one process: the whole path (collator, loss, step count) without CP."""
    got = run("sft", dirs["qwen3"], DOCS, str(tmp_path), cp_size=1)
    assert_same_run(got, refs["sft_qwen3"], "sft qwen3 cp1")


# --------------------------------------------------------------------------- spawned worlds
def _env(rank: int, world: int) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def _cp2_body(rank: int, world: int, dirs: dict, refs: dict) -> None:
    _env(rank, world)
    root = dirs["root"]
    cases = [("sft", "qwen3", {}), ("sft", "llama", {}), ("plain", "qwen3", {}),
             ("sft", "qwen3", {"placement": "per_document", "split_threshold": 16})]
    for kind, fam, kw in cases:  # the first with evaluate(): its loss is the reference's too
        got = run(kind, dirs[fam], DOCS, str(root / f"cp2_{kind}_{fam}_{len(kw)}"), cp_size=2,
                  prepare_kwargs=kw, eval_docs=EVAL if (kind, fam, kw) == cases[0] else None)
        assert ("eval_loss" in got) == ((kind, fam, kw) == cases[0])
        if rank == 0:
            assert_same_run(got, refs[f"{kind}_{fam}"], f"cp2 {kind} {fam} {kw}")
    # gradient accumulation: each micro-batch weighted by its share of the step's labels
    got = run("sft", dirs["llama"], DOCS, str(root / "cp2_ga2"), cp_size=2, grad_accum=2)
    if rank == 0:
        assert_same_run(got, refs["sft_llama_ga2"], "cp2 grad_accum 2")
    # transformers' gradient checkpointing (TRL's default) recomputes the patched layers
    got = run("sft", dirs["qwen3"], DOCS, str(root / "cp2_gc"), cp_size=2,
              args_over={"gradient_checkpointing": True})
    if rank == 0:
        assert_same_run(got, refs["sft_qwen3"], "cp2 gradient checkpointing")
    # bf16 autocast (the Trainer's bf16=True) on float32 weights: bf16's rounding, not 1e-5
    got = run("sft", dirs["qwen3"], DOCS, str(root / "cp2_bf16"), cp_size=2,
              args_over={"bf16": True})
    if rank == 0:
        assert_same_run(got, refs["sft_qwen3_bf16"], "cp2 bf16", rtol=2e-2)
    # the example script on its JSONL, against the same script with --no-cp on one process
    got = example(_example_argv(dirs, str(root / "cp2_ex")))
    if rank == 0:
        assert_same_run(got, refs["example"], "scripts/sft_trl_example.py cp2")
        assert got["cp_size"] == 2 and got["tokens_per_s"] > 0 and got["peak_mem_gib"] > 0
    # checkpoint at step 3, then a fresh trainer resumes from it: steps 4 and 5 as uninterrupted
    out = str(root / "cp2_resume")
    run("sft", dirs["qwen3"], DOCS, out, cp_size=2, save_steps=3)
    with open(f"{out}/checkpoint-3/config.json") as f:  # loads into an unpatched model
        assert "cp_rope" not in f.read()
    got = run("sft", dirs["qwen3"], DOCS, out, cp_size=2, resume=f"{out}/checkpoint-3")
    assert got["ran"] == [4, 5], f"the resumed run ran steps {got['ran']}"
    if rank == 0:
        assert_same_run(got, refs["sft_qwen3"], "cp2 resume", steps=[4, 5])
    # ranks called with different arguments or seeds: every rank raises, none waits
    for kw in ({"prepare_kwargs": {"method": "ring" if rank == 0 else "allgather"}},
               {"args_over": {"data_seed": rank}}):
        with pytest.raises(ValueError, match="different arguments"):
            run("sft", dirs["qwen3"], DOCS, str(root / "cp2_bad"), cp_size=2, **kw)
    # the sampler seeded per rank after prepare: the CP ranks' batches differ at step 1
    with pytest.raises(RuntimeError, match="drew different batches at step 1"):
        run("sft", dirs["qwen3"], DOCS, str(root / "cp2_bad"), cp_size=2,
            before_train=lambda trainer: torch.manual_seed(100 + rank))


def test_parity_cp2(dirs, refs):
    run_distributed(_cp2_body, 2, dirs, refs, timeout_s=600)


def _dp2_cp2_body(rank: int, world: int, dirs: dict, refs: dict) -> None:
    _env(rank, world)
    got = run("sft", dirs["llama"], DOCS, str(dirs["root"] / "dp2cp2"), cp_size=2)
    if rank == 0:
        assert_same_run(got, refs["sft_llama_ga2"], "dp2 x cp2 sft llama")


def test_parity_dp2_cp2(dirs, refs):
    run_distributed(_dp2_cp2_body, 4, dirs, refs, timeout_s=600)
