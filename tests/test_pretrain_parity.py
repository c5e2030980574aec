"""Whole-model parity: one training step under dp x cp equals a single-process run.

Every rank builds the same global data from one seed and the single-process
reference (``Transformer`` without CP, ``F.cross_entropy`` mean over the
concatenation of every data-parallel rank's batch). It then runs the
production step (:func:`cp_rope.launch.parallelize.parallelize`, then
:func:`cp_rope.launch.pretrain.train_step`: the CP model,
:func:`cp_cross_entropy` over the dp x cp group, the gradient SUM) on its
shard from :class:`PackingCollator` and asserts the loss and every
parameter's gradient with the float32 tolerances of ``tests/utils.TOL``.

The same body runs on GPUs under torchrun (NCCL, the FSDP2 bf16 production path
against a single-GPU run with the same bf16 policy, bf16 tolerances)::

    torchrun --standalone --nproc-per-node 2 tests/test_pretrain_parity.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from utils import assert_close

from cp_rope.launch.config import (
    ModelConfig,
    ParallelConfig,
    PretrainConfig,
    TrainConfig,
)
from cp_rope.launch.model import Transformer
from cp_rope.launch.parallelize import apply_fsdp, checkpoint_mode, parallelize
from cp_rope.launch.pretrain import train_step
from cp_rope.parallel import PackingCollator, shard_batch
from cp_rope.parallel.mesh import ParallelDims

VOCAB = 61


def _model_cfg(activation_checkpointing: bool | str = False, offload: bool = False) -> ModelConfig:
    # head_dim 16, GQA 4:2, two blocks: small enough for the CPU, every piece exercised.
    return ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96,
                       vocab_size=VOCAB, max_seq_len=512,
                       activation_checkpointing=activation_checkpointing,
                       offload_activations=offload)


def _docs(seed: int, dp: int) -> list[list[torch.Tensor]]:
    """dp lists of documents; lengths include 1-token documents and lengths that land
    exactly on zigzag chunk edges for cp 2 and 4 (multiples of 8)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [[37, 1, 64, 8, 23, 50], [16, 45, 1, 30, 2, 71]]
    return [[torch.randint(0, VOCAB, (n,), generator=g) for n in lengths[d % 2]] for d in range(dp)]


def _build(device):
    """fp32 weights from one seed (RoPE's kernel takes fp32/bf16/fp16, so no float64 here)."""
    torch.manual_seed(1234)
    with torch.device(device):
        return Transformer(_model_cfg())


def _reference(docs, label_fn, device, bf16_mesh=None):
    """Single process, no CP: loss and gradients of the mean CE over all dp ranks' documents.

    With ``bf16_mesh`` (a one-rank DeviceMesh) the model gets the production FSDP2 bf16
    mixed-precision policy without any sharding: the same roundings as the CP run.
    """
    batch = PackingCollator(cp_size=1)([{"input_ids": x} for d in docs for x in d])
    batch = label_fn(batch).to(device)
    model = _build(device)
    if bf16_mesh is not None:
        apply_fsdp(model, bf16_mesh, torch.bfloat16)
    logits = model(batch.input_ids, model.attention_plan(batch))
    n = int((batch.labels != -100).sum())
    ce = F.cross_entropy(logits.float(), batch.labels, ignore_index=-100, reduction="sum")
    loss = ce / max(n, 1)
    loss.backward()
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g
    return loss.detach(), {k: full(p.grad).clone() for k, p in model.named_parameters()}


def _keep_all(batch):
    return batch


def _only_one_label(batch):
    """Keep a single real label: row 29 of the first document (on rank 1 at cp 2, rank 2 at cp 4)."""
    labels = torch.full_like(batch.labels, -100)
    labels[29] = batch.labels[29]
    batch.labels = labels
    return batch


def _no_label(batch):
    batch.labels = torch.full_like(batch.labels, -100)
    return batch


LABELS = {"all": _keep_all, "one": _only_one_label, "none": _no_label}


# GPU: both runs use FSDP2 bf16 mixed precision; they differ by the order of bf16 roundings
# (ring merges, split reductions), measured ~3e-3 normwise on gloo, i.e. below the bf16 unit
# roundoff 2**-8. Compare gradients normwise (a wrong normalisation is off by >= 50%).
GPU_GRAD_NORM_RTOL = 2e-2


def _check_case(dp: int, cp: int, labels: str, device: torch.device, fsdp: bool,
                ac: bool | str = False, method: str = "ring", placement: str = "zigzag") -> None:
    """CPU: fp32 model, plain all-reduce (or FSDP2 fp32), elementwise fp32 tolerances. GPU: the
    production FSDP2 bf16 path (loss scaled by the world size, reduce-scatter average), bf16
    tolerances."""
    gpu = device.type == "cuda"
    world = dist.get_world_size()
    dims = ParallelDims(dp=dp, cp=cp, world_size=world)
    mesh, flat = dims.build_mesh(device.type), dims.build_flat_mesh(device.type)
    dp_rank, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    docs = _docs(seed=7, dp=dp)
    label_fn = LABELS[labels]
    one_rank = ParallelDims(dp=world, cp=1, world_size=world).build_mesh(device.type)["cp"] if gpu \
        else None
    ref_loss, ref_grads = _reference(docs, label_fn, device, bf16_mesh=one_rank)

    # Labels are set on the global batch of this dp rank (before CP sharding), as the collator does.
    glob = label_fn(PackingCollator(cp_size=cp)([{"input_ids": x} for x in docs[dp_rank]]))
    if labels == "one" and dp_rank != 0:
        glob = _no_label(glob)  # the one label lives in dp rank 0's batch
    # per_document: documents up to 24 tokens (padded) whole on one rank, the others zigzag
    doc = {} if placement == "zigzag" else {"placement": placement, "split_threshold": 24}
    batch = shard_batch(glob, cp, cp_rank, **doc)  # on the host: train_step plans, then moves it
    # The production wiring: CP over mesh["cp"], activation checkpointing, FSDP2 or a cast.
    model = _build(device)
    parallelize(model, mesh, PretrainConfig(
        model=_model_cfg(activation_checkpointing=ac, offload=ac == "selective"),
        parallel=ParallelConfig(cp_size=cp, fsdp="on" if fsdp else "off", cp_method=method,
                                ulysses_size=2 if method == "hybrid" else 1),
        train=TrainConfig(dtype="bfloat16" if gpu else "float32")))
    assert model.cp_size == cp and all(getattr(b, "checkpoint_mode", "none") == checkpoint_mode(ac)
                                       for b in model.layers)
    loss = train_step(model, batch, flat.get_group(), device=device, reduce_group=flat.get_group(),
                      grad_scale=float(world) if fsdp else 1.0, reduce_grads=not fsdp)
    tol_dtype = torch.bfloat16 if gpu else torch.float32

    where = (f"dp={dp} cp={cp} {method} {placement} labels={labels} fsdp={fsdp} ac={ac} "
             f"rank={dist.get_rank()}")
    assert_close(loss.reshape(1), ref_loss.reshape(1), dtype=tol_dtype, name=f"loss [{where}]")
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient [{where}]"
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert torch.isfinite(grad).all(), f"{name}: non-finite gradient [{where}]"
        if labels == "none":
            assert torch.count_nonzero(grad) == 0, f"{name}: gradient not exactly 0 [{where}]"
        elif gpu:
            ref = ref_grads[name].float()
            rel = float((grad.float() - ref).norm() / ref.norm())
            assert rel <= GPU_GRAD_NORM_RTOL, f"grad {name}: normwise rel err {rel:.3g} [{where}]"
        else:
            assert_close(grad, ref_grads[name], dtype=tol_dtype, name=f"grad {name} [{where}]")
    if labels == "none":
        assert loss.item() == 0.0, f"loss {loss.item()} != 0 with every label ignored [{where}]"
    if labels == "one":  # the single token's gradient is whole on every layout, not 1/cp of it
        assert ref_grads["output.weight"].abs().max() > 0


def _parity_body(rank: int, world: int, cases) -> None:
    torch.manual_seed(0)
    for dp, cp, labels, *opts in cases:  # opts: "fsdp", "ac" (activation checkpointing; "sel":
        # selective with offload), a method
        method = next((o for o in opts if o in ("allgather", "ulysses", "hybrid")), "ring")
        placement = "per_document" if "per_document" in opts else "zigzag"
        ac = "selective" if "sel" in opts else "ac" in opts
        _check_case(dp, cp, labels, torch.device("cpu"), fsdp="fsdp" in opts, ac=ac,
                    method=method, placement=placement)


def test_parity_cp1():
    """cp_size 1 (world 1): the production step through the process group equals plain autograd."""
    run_distributed(_parity_body, 1, [(1, 1, "all"), (1, 1, "one"), (1, 1, "none")])


def test_parity_cp2():
    # Then the FSDP2 path (loss x world, reduce-scatter average) on gloo, and activation
    # checkpointing (the ring's collectives run again in the recomputation).
    run_distributed(_parity_body, 2, [(1, 2, "all"), (1, 2, "one"), (1, 2, "none"), (2, 1, "all"),
                                      (1, 2, "all", "fsdp"), (1, 2, "one", "fsdp"),
                                      (1, 2, "all", "fsdp", "ac"), (1, 2, "one", "ac"),
                                      (1, 2, "all", "fsdp", "sel"),
                                      (1, 2, "all", "per_document"),
                                      (1, 2, "one", "per_document", "fsdp", "ac")])


def test_parity_cp4_and_dp2_cp2():
    # then Ulysses (Hq 4 over 4 ranks, kv heads shared by 2) and hybrid (U = 2: 2 x 2 ring)
    run_distributed(_parity_body, 4, [(1, 4, "all"), (1, 4, "one"), (1, 4, "none"),
                                      (2, 2, "all"), (2, 2, "one"), (1, 4, "all", "ulysses"),
                                      (1, 4, "one", "hybrid"), (1, 4, "all", "hybrid", "ac"),
                                      (1, 4, "all", "per_document"),
                                      (1, 4, "one", "per_document", "allgather"),
                                      (2, 2, "all", "per_document")])


# ---------------------------------------------------------------- GPU (torchrun)
def _torchrun_main() -> None:
    """Under torchrun: on GPUs (NCCL) one FSDP2 bf16 step at cp = world and at dp = world vs a
    single-GPU run; without CUDA the same cases on gloo in fp32 (a check of this entry)."""
    import datetime

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    try:
        world = dist.get_world_size()
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        for dp, cp in ((1, world), (world, 1)):
            for labels in ("all", "one", "none"):
                _check_case(dp, cp, labels, device, fsdp=True)
                if dist.get_rank() == 0:
                    what = (f"FSDP2 bf16 vs single-GPU FSDP2 bf16, normwise grad rtol {GPU_GRAD_NORM_RTOL}"
                            if cuda else "FSDP2 fp32 on gloo, fp32 tolerances")
                    print(f"parity OK: dp={dp} cp={cp} labels={labels} ({what})", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _torchrun_main()
