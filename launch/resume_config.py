"""What a ``--resume`` must keep of a run's :class:`~cp_rope.launch.config.PretrainConfig`:
the fields fixed by the checkpoint (:data:`RESUME_FIXED`, :func:`resume_fixed`) and the
comparison with the run's saved ``config.json`` (:func:`check_resume_config`)."""

from __future__ import annotations

from .config import ConfigError, PretrainConfig, head_dim_of, to_dict

__all__ = ["RESUME_FIXED", "check_resume_config", "resume_fixed", "saved_head_dim"]


RESUME_FIXED: dict[str, tuple[str, ...]] = {
    "model": ("dim", "n_layers", "n_heads", "head_dim", "n_kv_heads", "ffn_hidden_dim",
              "vocab_size",
              "norm_eps", "rope_base"),
    "data": ("data", "tokenizer", "text_field", "bin_dtype", "eos_id", "seq_mode", "seq_len",
             "tokens_per_batch", "max_docs", "bpe_vocab_size", "eval_docs"),
    "parallel": ("cp_size",),
    "optim": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "train": ("seed",),
}
"""Fields a ``--resume`` must keep: the model's shapes and function, everything that
decides the data order (corpus, tokenizer, batching, seed, cp_size; the world size
is checked against the checkpoint), and the optimizer hyper-parameters that the
checkpoint's optimizer state restores (a changed value would be silently ignored).
Everything else may change on resume: ``train.steps`` (the cosine is recomputed
for the new total), ``stop_at_step``, logging, checkpoint frequency, out_dir,
``optim.warmup_steps`` / ``min_lr_ratio`` / ``grad_clip`` (take effect from the
resumed step), ``data.num_workers``, the CP method and kernel backends, FSDP,
activation checkpointing, device and dtype."""


def resume_fixed(cfg: PretrainConfig) -> dict[str, tuple[str, ...]]:
    """:data:`RESUME_FIXED` for this run: without ``data.bpe_vocab_size`` unless the run
    trains a BPE (``--tokenizer bpe``, or no tokenizer with the stdlib corpus), which is
    the only run that reads it."""
    d = cfg.data
    bpe = d.tokenizer == "bpe" or (d.tokenizer is None and d.data is None)
    return {s: tuple(n for n in names if bpe or (s, n) != ("data", "bpe_vocab_size"))
            for s, names in RESUME_FIXED.items()}


def check_resume_config(saved: dict, cfg: PretrainConfig) -> None:
    """Compare the run's saved ``config.json`` (``saved``, from :func:`to_dict`) with ``cfg``.

    A ``model.vocab_size`` of 0 (= from the tokenizer) in ``cfg`` is not compared:
    the tokenizer is. ``model.head_dim`` is compared as features per head (0 = dim /
    n_heads on either side). Fields missing from ``saved`` (older files) are skipped.

    Raises: ConfigError naming every field of :data:`RESUME_FIXED` that differs,
    with the saved and the current value.
    """
    now = to_dict(cfg)
    diffs = []
    for section, names in resume_fixed(cfg).items():
        for name in names:
            old, new = saved.get(section, {}).get(name, now[section][name]), now[section][name]
            if (section, name) == ("model", "vocab_size") and new == 0:
                continue
            if (section, name) == ("model", "head_dim"):  # 0 = dim / n_heads: the same model
                model = saved.get("model", {})
                old = saved_head_dim(old, model.get("dim"), model.get("n_heads"))
                new = head_dim_of(cfg.model)
            if old != new:
                diffs.append(f"{section}.{name}: {old!r} (checkpoint) != {new!r} (now)")
    if diffs:
        raise ConfigError("--resume with a config that differs from the checkpoint's run: "
                          + "; ".join(diffs) + ". Keep these fields, or start a new run "
                          "(--out-dir or --overwrite)")


HEAD_KEYS = ("head_dim", "dim", "n_heads")
"""The model fields :func:`saved_head_dim` reads, in its order."""


def saved_head_dim(head_dim, dim, n_heads) -> object:
    """A saved run's features per head: its ``head_dim``, or ``dim / n_heads`` when 0 (as
    :func:`~cp_rope.launch.config.head_dim_of`; the raw value where the record lacks either:
    an older file). Compared by :func:`check_resume_config` and the checkpoint's run check
    (:func:`cp_rope.launch.checkpoint.check_run`)."""
    if head_dim == 0 and isinstance(dim, int) and isinstance(n_heads, int) and n_heads > 0:
        return dim // n_heads
    return head_dim
