"""Tiny local models, a tokenizer and short Trainer / SFTTrainer runs for tests/test_hf_trainer.py.

Everything is built from configs with random weights (saved once to a directory so that
every process loads the same ones; never downloaded). One run function serves both the
single-process reference (no cp_rope) and the CP runs (``cp_size`` set: the trainer goes
through :func:`cp_rope.hf.prepare`), so the two differ only by that call.
"""

from __future__ import annotations

import json

import torch

V = 97  # vocabulary of the tiny models and tokenizer
FAMILIES = {"qwen3": "Qwen3Config", "llama": "LlamaConfig"}


def tokenizer():
    """A word-level tokenizer over ``t0 .. t{V-1}`` (pad ``t0``, eos ``t1``), no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1",
                                   unk_token="t2")


def make_model_dir(path: str, family: str, seed: int = 0) -> str:
    """Write a tiny random float32 model of ``family`` (GQA, 2 layers) and the tokenizer."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = getattr(transformers, FAMILIES[family])(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=V, max_position_embeddings=512, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, tie_word_embeddings=family == "llama")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random, not the init's small std: losses and gradients move
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else None
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def documents(seed: int, n: int, lo: int = 3, hi: int = 29) -> list[list[int]]:
    """``n`` documents of random lengths in [lo, hi] (odd ones too) over ids 3 .. V-1."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, V, (k,), generator=g).tolist() for k in lens]


def write_jsonl(path: str, docs: list[list[int]]) -> str:
    """The documents as a JSONL file of ``{"text": "t5 t17 ..."}`` lines."""
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in d)}) + "\n")
    return path


def run(kind: str, model_dir: str, docs, out_dir: str, *, cp_size: int | None = None,
        grad_accum: int = 1, steps: int = 5, save_steps: int | None = None,
        resume: str | None = None, prepare_kwargs: dict | None = None,
        args_over: dict | None = None, eval_docs=None, before_train=None) -> dict:
    """Train ``steps`` optimizer steps and return ``{"loss": [...], "grad_norm": [...],
    "step": [...], "ran": [...], "state": {name: tensor}}`` (the logged values per step, the
    steps this call ran, the final weights).

    kind: ``"sft"`` (TRL SFTTrainer, packing=True, per-device batch 1 packed row of 48
    tokens) or ``"plain"`` (transformers Trainer, 4 documents per batch: the reference
    collates with DataCollatorWithFlattening, the CP run with cp_rope's PackingCollator).
    """
    import datasets
    import transformers

    import cp_rope.hf

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa")
    common = dict(output_dir=out_dir, max_steps=steps, gradient_accumulation_steps=grad_accum,
                  learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                  max_grad_norm=1.0, disable_tqdm=True, dataloader_num_workers=0,
                  save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                  lr_scheduler_type="linear", warmup_steps=1, bf16=False,
                  gradient_checkpointing=False) | (args_over or {})
    ds = datasets.Dataset.from_dict({"input_ids": docs})
    ev = None if eval_docs is None else datasets.Dataset.from_dict({"input_ids": eval_docs})
    if kind == "sft":
        import trl

        args = trl.SFTConfig(packing=True, max_length=48, per_device_train_batch_size=1,
                             dataset_num_proc=None, **common)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, eval_dataset=ev,
                                 processing_class=tokenizer())
    else:
        args = transformers.TrainingArguments(per_device_train_batch_size=4, **common)
        collate = (cp_rope.parallel.PackingCollator() if cp_size else
                   transformers.DataCollatorWithFlattening(return_position_ids=True))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                       data_collator=collate)
    if cp_size:
        trainer = cp_rope.hf.prepare(trainer, cp_size=cp_size, **(prepare_kwargs or {}))
    ran = []
    trainer.add_callback(type("Count", (transformers.TrainerCallback,), {
        "on_step_end": lambda self, args, state, control, **kw: ran.append(state.global_step)}))
    if before_train is not None:
        before_train(trainer)
    trainer.train(resume_from_checkpoint=resume)
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    extra = {} if ev is None else {"eval_loss": trainer.evaluate()["eval_loss"]}
    return extra | {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
            "step": [e["step"] for e in logs], "ran": ran,
            "state": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


RTOL = 1e-5  # the target: the same losses, gradient norms and weights to 1e-5


def assert_same_run(got: dict, want: dict, what: str, steps=None, rtol: float = RTOL) -> None:
    """Logged losses and gradient norms (per step, relative) and, when both have them, the
    final weights (per tensor, relative to its largest entry) agree to ``rtol``."""
    if "step" not in got:  # the example script's report: every step logged
        got, want = dict(got, step=list(range(1, len(got["loss"]) + 1))), dict(
            want, step=list(range(1, len(want["loss"]) + 1)))

    def pick(r, k):
        if steps is None or k == "eval_loss":
            return r[k]
        return [v for v, s in zip(r[k], r["step"], strict=True) if s in steps]

    assert (got["step"] if steps is None else steps) == (
        want["step"] if steps is None else [s for s in want["step"] if s in steps]), (
        f"{what}: logged steps {got['step']} vs {want['step']}")
    for key in ("loss", "grad_norm", "eval_loss"):
        if key == "eval_loss" and key not in got:  # asked of some runs only
            continue
        a, b = torch.tensor(pick(got, key)), torch.tensor(pick(want, key))
        assert a.shape == b.shape, f"{what}: {key} {a.tolist()} vs {b.tolist()}"
        err = ((a - b).abs() / b.abs()).max().item()
        assert err <= rtol, f"{what}: {key} relative error {err:.2e}: {a.tolist()} vs {b.tolist()}"
    if got.get("state") and want.get("state"):
        assert got["state"].keys() == want["state"].keys(), f"{what}: parameter names differ"
        worst = max((((got["state"][k] - w).abs().max() / w.abs().max()).item(), k)
                    for k, w in want["state"].items())
        assert worst[0] <= rtol, f"{what}: weights differ after training, {worst[1]} by {worst[0]:.2e}"


def example(argv: list[str]) -> dict:
    """Run scripts/sft_trl_example.py's main(argv) in this process; returns its report."""
    from utils import script_module

    return script_module("sft_trl_example").main(argv)
