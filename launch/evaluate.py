"""Held-out evaluation: the loss and bits per byte on documents the run never trains on.

The held-out documents (``--eval-docs``, chosen by :func:`cp_rope.launch.data.held_out_ids`)
are packed like the training data (``--seq-mode docs`` always: every held-out token is
predicted exactly once, whatever the training ``--seq-mode``) with the run's CP layout and
a fixed order, and all of them are evaluated every ``--eval-every`` steps and after the
last step. The text is the same for every tokenizer, so held-out bits per byte compare
runs with different vocabularies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import PretrainConfig
from .data import Corpus, TokenDataset, build_loader, placement_args
from .metrics import bits_per_byte

__all__ = ["HeldOut"]


class HeldOut:
    """The held-out loader of this rank and the evaluation loop.

    Args:
        cfg: the run's resolved config (batching, CP placement, ``eval_every``, steps).
        corpus: the held-out documents.
        token_bytes: int64 ``[vocab]`` bytes of text per id, or None (no bits per byte).
        cp_size, cp_rank, dp_size, dp_rank: this rank's place in the ``("dp", "cp")`` mesh.
        group: the dp x cp group the loss averages over.
        device: the model's device.
        placement: the loader's placement arguments (:func:`~cp_rope.launch.data.placement_args`;
            default: from ``cfg``, with the shipped calibration).
    """

    def __init__(self, cfg: PretrainConfig, corpus: Corpus, token_bytes, *, cp_size: int,
                 cp_rank: int, dp_size: int, dp_rank: int, group, device: torch.device,
                 placement: dict | None = None):
        self.every, self.token_bytes = cfg.train.eval_every, token_bytes
        t = cfg.train
        self.last = t.steps if t.stop_at_step is None else min(t.steps, t.stop_at_step)
        self.group, self.device = group, device
        dataset = TokenDataset(corpus, "docs", cfg.data.seq_len)
        self.loader, self.sampler = build_loader(
            cfg.data, dataset, cp_size=cp_size, cp_rank=cp_rank, dp_size=dp_size,
            dp_rank=dp_rank, seed=cfg.train.seed, pin_memory=device.type == "cuda",
            **(placement or placement_args(cfg.parallel, cfg.model)))
        self.num_docs = corpus.num_docs

    @classmethod
    def build(cls, cfg: PretrainConfig, run_data, mesh, group, device: torch.device,
              placement: dict | None = None):
        """The held-out evaluation of a run (``run_data``:
        :class:`~cp_rope.launch.tokenizer.RunData`) on this rank of the ``("dp", "cp")``
        ``mesh``, or None when the run holds no documents out. ``placement``: the training
        loader's :func:`~cp_rope.launch.data.placement_args` (default: from ``cfg``)."""
        if run_data.eval is None:
            return None
        return cls(cfg, run_data.eval, run_data.token_bytes, cp_size=mesh["cp"].size(),
                   cp_rank=mesh.get_local_rank("cp"), dp_size=mesh["dp"].size(),
                   dp_rank=mesh.get_local_rank("dp"), group=group, device=device,
                   placement=placement)

    def due(self, step: int) -> bool:
        """Evaluate after ``step``: every ``eval_every`` steps and after the last one."""
        return step == self.last or (self.every is not None and step % self.every == 0)

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        """``{"eval_loss", "eval_tokens"}`` (+ ``"eval_bpb", "eval_bytes"`` with a byte table)
        over every held-out token of the job (all ranks call it together; the model is put
        back in training mode).

        ``eval_loss`` = NLL sum / tokens, nats; the NLL sum is each batch's group-mean loss
        times the group's labelled tokens of that batch.
        """
        was_training = model.training
        model.eval()
        self.sampler.set_epoch(0)
        losses, counts = [], []
        try:
            for host in self.loader:
                labels = host.labels.numpy()
                real = labels[labels >= 0]
                n_bytes = int(self.token_bytes[real].sum()) if self.token_bytes is not None else 0
                counts.append((real.size, n_bytes))
                plan = model.attention_plan(host, device=self.device)  # from host data
                batch = host.to(self.device, non_blocking=True)
                losses.append(model(batch.input_ids, plan, labels=batch.labels,
                                    loss_group=self.group).detach().double().reshape(()))
        finally:
            model.train(was_training)
        counts = torch.tensor(counts, dtype=torch.float64, device=self.device).reshape(-1, 2)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(counts, group=self.group)  # the group's tokens and bytes per batch
        loss = torch.stack(losses).to(self.device) if losses else counts[:, 0]
        n = counts[:, 0]
        nll = float(torch.where(n > 0, loss * n, torch.zeros_like(n)).sum())
        tokens, n_bytes = float(n.sum()), float(counts[:, 1].sum())
        out = {"eval_loss": nll / tokens if tokens else float("nan"), "eval_tokens": int(tokens)}
        if self.token_bytes is not None:
            out.update(eval_bpb=bits_per_byte(nll, n_bytes), eval_bytes=int(n_bytes))
        return out
