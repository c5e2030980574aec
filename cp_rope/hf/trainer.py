"""Packed context parallelism inside an existing transformers ``Trainer`` / TRL ``SFTTrainer``.

One call after the trainer is built::

    trainer = SFTTrainer(model=model, args=SFTConfig(packing=True, ...), train_dataset=ds)
    trainer = cp_rope.hf.prepare(trainer, cp_size=2)
    trainer.train()

under ``torchrun --nproc-per-node W`` (``W`` a multiple of ``cp_size``; DP = W / cp_size).
:func:`prepare` checks everything first (each refusal a ValueError naming the argument, on
every rank, before any step), then:

1. builds the ``("dp", "cp")`` DeviceMesh over the Trainer's world
   (:class:`cp_rope.parallel.ParallelDims`); accelerate's own ``cp_size`` stays unset;
2. data: the Trainer's collator is wrapped in :class:`~cp_rope.hf.trainer_data.TrainerCollator`
   (its padding-free batch, or cp_rope's ``PackingCollator`` examples -> this rank's zigzag
   or per-document shard), and the data loaders the Trainer builds are sharded by DP group
   (every CP rank of a group draws the same batch: DP rank = group index);
3. the model: :func:`cp_rope.hf.patch_model` over the ``"cp"`` group, and a forward that,
   called with ``cp_rope_labels=``, runs the base model to the final hidden states and
   returns the loss :func:`cp_rope.parallel.cp_linear_cross_entropy` (or, unfused,
   :func:`~cp_rope.parallel.cp_cross_entropy` of the logits) over the whole world;
4. the loss (the trainer's class becomes a subclass with :class:`CPRopeTrainerMixin`):
   per optimizer step the real labels of every micro-batch are counted over the world
   (one all-reduce), and micro-batch ``g``'s loss is ``L_g * N_g / N`` (``L_g`` the world's
   token mean of the micro-batch, ``N_g`` its count, ``N`` the step's), with its gradient
   multiplied by the world size: the Trainer's DDP / FSDP gradient *average* over the world
   then gives exactly the gradient of the single-process token mean of the global batch,
   whatever the gradient accumulation; the logged ``loss`` (the world mean of the summed
   micro-batch values) is that token mean, and clipping sees the true gradient.

Checkpoints are the Trainer's own (the patch changes no parameter): ``save_pretrained``
weights, optimizer, scheduler, RNG and trainer state; ``resume_from_checkpoint`` skips the
trained batches through the same DP-grouped loader.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler

from cp_rope.parallel import PackingCollator, ParallelDims, agree_across_ranks
from cp_rope.parallel.choices import LOSS_IMPLS, PLACEMENTS
from cp_rope.parallel.loss import liger_missing
from cp_rope.validation import check_bool, check_choice, check_int, content_checks_enabled

from ._compat import transformers
from .patch import _family, patch_model
from .trainer_data import FINGERPRINT, LABELS, NUM_ITEMS, TrainerCollator, regroup_loader
from .trainer_model import install_loss_forward, scale_grad

__all__ = ["prepare", "CPRopeTrainerMixin", "CPRopeTrainerState"]

Trainer = transformers.Trainer
_STRATEGIES = ("random", "sequential")  # train_sampling_strategy values that keep CP ranks equal


@dataclasses.dataclass(eq=False)
class CPRopeTrainerState:
    """What :func:`prepare` attached to the trainer (``trainer.cp_rope``)."""

    dims: ParallelDims
    """dp x cp degrees of the Trainer's world."""
    mesh: object | None
    """The ``("dp", "cp")`` DeviceMesh (None in a one-process run)."""
    dp_rank: int
    cp_rank: int
    collator: TrainerCollator
    """The installed ``data_collator`` (its ``inner`` is the Trainer's own)."""
    ignore_index: int


class CPRopeTrainerMixin:
    """The methods :func:`prepare` puts in front of the trainer's class (its MRO: this, then
    the trainer's own class, e.g. TRL's ``SFTTrainer``). Not meant to be subclassed by hand."""

    # compute_loss normalises by the whole optimizer step's token count itself
    loss_is_scaled_for_ga = True

    def get_train_dataloader(self):
        s = self.cp_rope
        return regroup_loader(super().get_train_dataloader(), s.dims.dp, s.dp_rank,
                              s.dims.world_size)

    def get_eval_dataloader(self, eval_dataset=None):
        s = self.cp_rope
        return regroup_loader(super().get_eval_dataloader(eval_dataset), s.dims.dp, s.dp_rank,
                              s.dims.world_size)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The Trainer's micro-batches of one optimizer step, each tagged with its count of
        real labels over the world (``NUM_ITEMS``, one all-reduce for the step); returns
        ``(batches, N)`` with ``N`` the step's count (the Trainer's ``num_items_in_batch``).

        On CPU (or with ``CP_ROPE_DEBUG=1``: the check reads the result on the host) the CP
        ranks of each group also compare their global batches' fingerprints (one all-reduce
        over the group) and all raise RuntimeError when they drew different batches."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:
            return batches, None
        ignore = self.cp_rope.ignore_index
        counts = torch.stack([(b[LABELS] != ignore).sum() for b in batches]).to(device)
        if self.cp_rope.dims.world_size > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            self._check_same_batches(batches, counts)
        for b, n in zip(batches, counts, strict=True):
            b[NUM_ITEMS] = n
        return batches, counts.sum()

    def _check_same_batches(self, batches, counts) -> None:
        state = self.cp_rope
        if state.dims.cp == 1 or not content_checks_enabled(counts):
            return
        crc = torch.stack([b[FINGERPRINT] for b in batches]).to(counts.device)
        both = torch.cat([crc, -crc])  # max of x and of -x: every rank equal iff max == min
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=state.mesh["cp"].get_group())
        if not torch.equal(both[:len(batches)], -both[len(batches):]):
            raise RuntimeError(
                f"cp_rope.hf.prepare: the CP ranks of DP group {state.dp_rank} drew different "
                f"batches at step {self.state.global_step + 1} (their fingerprints differ): the "
                "Trainer's sampler gives ranks different indices (a sampler seeded per rank, "
                "torch.manual_seed(rank) before train() with accelerate's seedable sampler, a "
                "rank-aware sampler); every rank must see the same seed and sampler")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The world's token-mean loss of this micro-batch, weighted by its share of the
        optimizer step's labels, with the gradient scaled for the world average (module
        docstring). Without ``num_items_in_batch`` (evaluation): the micro-batch's mean."""
        inputs = dict(inputs)
        labels, n_items = inputs.pop(LABELS), inputs.pop(NUM_ITEMS, None)
        inputs.pop(FINGERPRINT, None)
        outputs = model(**inputs, cp_rope_labels=labels[0])
        loss = outputs.loss
        if num_items_in_batch is not None and n_items is not None:
            share = n_items.to(loss.dtype) / torch.as_tensor(
                num_items_in_batch, device=loss.device).to(loss.dtype).clamp(min=1)
            loss = loss * share
        if torch.is_grad_enabled():
            loss = scale_grad(loss, float(self.cp_rope.dims.world_size))
        return (loss, outputs) if return_outputs else loss


_CLASSES: dict[type, type] = {}


def _cp_class(cls: type) -> type:
    if issubclass(cls, CPRopeTrainerMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"CPRope{cls.__name__}", (CPRopeTrainerMixin, cls),
                             {"__module__": cls.__module__, "__qualname__": f"CPRope{cls.__name__}"})
    return _CLASSES[cls]


# --------------------------------------------------------------------------- checks
def _check_parallelism(trainer) -> None:
    args = trainer.args
    pc = getattr(trainer.accelerator, "parallelism_config", None) or getattr(
        args, "parallelism_config", None)
    for name in ("cp_size", "sp_size", "tp_size"):
        value = getattr(pc, name, 1) if pc is not None else 1
        if value not in (None, 1):
            raise ValueError(f"parallelism_config.{name}={value}: cp_rope.hf.prepare runs its own "
                             "context parallelism over the Trainer's world (dp = world / cp_size); "
                             f"leave accelerate's {name} unset")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("args.deepspeed: cp_rope.hf.prepare supports DDP and FSDP (their "
                         "gradient average over the world), not DeepSpeed")
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"args.n_gpu={args.n_gpu}: one process per GPU (torchrun), not "
                         "torch.nn.DataParallel")
    if getattr(trainer, "is_model_parallel", False):
        raise ValueError("model: spread over several devices (device_map): cp_rope needs one "
                         "device per process")


def _check_router_loss(config) -> None:
    coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    if getattr(config, "output_router_logits", False) and coef:
        raise ValueError(f"model: a mixture-of-experts model with its router load-balancing "
                         f"loss on (output_router_logits, router_aux_loss_coef={coef}): "
                         "prepare's loss is the token cross-entropy alone; set "
                         "router_aux_loss_coef=0 (SFTConfig) or output_router_logits=False, or "
                         "train it with cp_rope.launch.finetune_hf --router-aux-loss")


def _check_data(trainer, cp_size: int) -> None:
    args = trainer.args
    if trainer.train_dataset is None:
        raise ValueError("train_dataset: cp_rope.hf.prepare needs the Trainer's train_dataset")
    if isinstance(trainer.train_dataset, IterableDataset) or not hasattr(
            trainer.train_dataset, "__len__"):
        raise ValueError("train_dataset: an iterable dataset is sharded (or dispatched) by "
                         "accelerate over every process, not per CP group; use a map-style "
                         "dataset (datasets.Dataset)")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in _STRATEGIES:
        raise ValueError(f"train_sampling_strategy={strategy!r} (group_by_length, "
                         "batch_rebalance): its sampler gives ranks different batches or sizes "
                         f"that the CP ranks of a group would not share; use one of {_STRATEGIES}")
    own = getattr(type(trainer), "_get_train_sampler", None)
    if own is not getattr(Trainer, "_get_train_sampler", None):
        sampler = trainer._get_train_sampler(trainer.train_dataset)
        if type(sampler) not in (RandomSampler, SequentialSampler, type(None)):
            raise ValueError(f"_get_train_sampler: {type(trainer).__name__} returns a "
                             f"{type(sampler).__name__}, which may give the CP ranks of a group "
                             "different batches; return a RandomSampler or SequentialSampler "
                             "(accelerate shards it by DP group)")
    acc = args.accelerator_config
    for name, bad in (("split_batches", True), ("dispatch_batches", True), ("even_batches", False)):
        if getattr(acc, name, None) is bad:
            raise ValueError(f"accelerator_config.{name}={bad}: cp_rope shards the data loader by "
                             "DP group through accelerate's BatchSamplerShard; leave it at its "
                             "default")
    if getattr(args, "auto_find_batch_size", False):
        raise ValueError("auto_find_batch_size=True: the per-device batch size is part of the "
                         "packed-row contract; set per_device_train_batch_size")
    bs = args.per_device_train_batch_size
    if getattr(args, "packing", False) and bs != 1:
        raise ValueError(
            f"per_device_train_batch_size={bs}: with packing=True every dataset row is already "
            f"one packed sequence of up to max_length={getattr(args, 'max_length', None)} "
            f"tokens, and cp_rope runs one packed row per micro-batch, split over cp_size="
            f"{cp_size} ranks; set per_device_train_batch_size=1 (more tokens per step: "
            "gradient_accumulation_steps, or a longer max_length)")


def _packer(collator, cp_size: int, cp_rank: int, pad_id: int, placement: str,
            split_threshold) -> tuple[object | None, PackingCollator]:
    """``(inner collator or None, PackingCollator for this rank)``."""
    if isinstance(collator, PackingCollator):
        if collator.cp_rank is not None or collator.cp_size not in (1, cp_size):
            raise ValueError(f"data_collator: a PackingCollator for cp_size={collator.cp_size}, "
                             f"cp_rank={collator.cp_rank}; give the global one "
                             "(PackingCollator(...) without cp_rank): prepare shards it")
        c = collator
        return None, PackingCollator(
            cp_size, cp_rank, pad_id=c.pad_id, ignore_index=c.ignore_index,
            pad_to_multiple=c.pad_to_multiple, max_tokens=c.max_tokens, max_seqlen=c.max_seqlen,
            vocab_size=c.vocab_size, placement=placement if c.placement == "zigzag"
            else c.placement, split_threshold=split_threshold or c.split_threshold)
    if collator is None:
        raise ValueError("data_collator: the Trainer has none; " + _need_collator())
    return collator, PackingCollator(cp_size, cp_rank, pad_id=pad_id, placement=placement,
                                     split_threshold=split_threshold)


def _need_collator() -> str:
    return ("give SFTTrainer packing=True / padding_free=True, transformers' "
            "DataCollatorWithFlattening, or cp_rope's PackingCollator")


def _probe(trainer, collator: TrainerCollator) -> None:
    """Run the installed collator on the first examples of the train dataset (the columns
    the Trainer would keep), so that a collator cp_rope cannot read fails here."""
    ds = trainer.train_dataset
    n = min(len(ds), max(1, trainer.args.per_device_train_batch_size))
    inner = collator
    if hasattr(ds, "select") and hasattr(trainer, "_remove_unused_columns"):
        ds = trainer._remove_unused_columns(ds.select(range(n)), description="cp_rope probe")
    elif hasattr(trainer, "_get_collator_with_removed_columns"):
        inner = trainer._get_collator_with_removed_columns(collator, description="cp_rope probe")
    inner([ds[i] for i in range(n)])


# --------------------------------------------------------------------------- the entry
def prepare(trainer, *, cp_size: int, method: str = "ring", backend: str = "auto",
            rope_kernel: bool = True, ulysses_size: int | None = None,
            placement: str = "zigzag", split_threshold: int | None = None,
            fused_loss: bool = True, loss_chunk_size: int | None = None,
            loss_impl: str = "auto", fused_norm: bool = True,
            mlp_tile_tokens: int | None = None, fused_swiglu: bool = True):
    """Make a built ``transformers.Trainer`` (or subclass: TRL's ``SFTTrainer``) train with
    packed context parallelism over ``cp_size`` ranks (module docstring). Call it on every
    rank, with the same arguments, after the trainer is built and before ``train()``.

    Args:
        trainer: a ``transformers.Trainer`` whose model is a causal LM of a supported family
            (:data:`cp_rope.hf.SUPPORTED_FAMILIES`), not yet wrapped (no ``model_init``), with
            a map-style ``train_dataset`` and a collator that gives padding-free batches
            (TRL's ``packing=True`` / ``padding_free=True``, ``DataCollatorWithFlattening``),
            padded ones with ``position_ids``, or cp_rope's ``PackingCollator``.
        cp_size: ranks that share one packed row; must divide the Trainer's world size.
        method, backend, rope_kernel, ulysses_size, fused_norm, mlp_tile_tokens,
            fused_swiglu: as :func:`cp_rope.hf.patch_model`.
        placement, split_threshold: how a row is cut over the CP ranks (``"zigzag"``, or
            ``"per_document"`` with short documents whole on one rank;
            :class:`~cp_rope.parallel.PackingCollator`).
        fused_loss: the loss from the final hidden states and the LM head weight in chunks
            (:func:`~cp_rope.parallel.cp_linear_cross_entropy`: the ``[T, V]`` logits never
            exist); False: the logits, then :func:`~cp_rope.parallel.cp_cross_entropy`.
        loss_chunk_size, loss_impl: of :func:`~cp_rope.parallel.cp_linear_cross_entropy`.

    Returns: ``trainer`` itself, its class now ``CPRope<its class>`` (with
    :class:`CPRopeTrainerMixin`), its ``data_collator`` a ``TrainerCollator``, its model
    patched; ``trainer.cp_rope`` (:class:`CPRopeTrainerState`) holds the mesh and ranks.

    Raises (every rank, before anything changes), each naming the argument:
        TypeError: ``trainer`` not a ``transformers.Trainer``; a non-int ``cp_size``.
        ValueError: ``cp_size`` not dividing the world; a model family cp_rope does not
            support; a mixture-of-experts model with its router loss on; accelerate's ``parallelism_config`` with ``cp_size`` / ``sp_size`` /
            ``tp_size`` set, DeepSpeed, DataParallel; ``model_init``; an iterable dataset;
            ``train_sampling_strategy`` other than random / sequential or a
            ``_get_train_sampler`` override returning another sampler; accelerate's
            ``split_batches`` / ``dispatch_batches`` / ``even_batches=False``; a collator
            that pads without ``position_ids`` (or gives keys cp_rope does not carry); a
            per-device batch size other than 1 with pre-packed rows (``packing=True``) or
            ``auto_find_batch_size``; ``loss_impl`` / ``loss_chunk_size`` as the trainers'
            flags refuse them; ``args.label_smoothing_factor``, ``compute_loss_func``, TRL's
            ``args.loss_type`` other than nll or a user override of ``compute_loss`` set
            (the CP loss replaces the Trainer's); a trainer already prepared; ranks with
            different arguments, ``args.seed`` or ``args.data_seed`` (the sampler's seed).
        RuntimeError (at a step, on CPU or with ``CP_ROPE_DEBUG=1``): the CP ranks of a group
            drew different batches all the same (e.g. ``torch.manual_seed(rank)`` before
            ``train()``, which seeds accelerate's sampler).
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer (or a subclass such as TRL's "
                        f"SFTTrainer), got {type(trainer).__name__}")
    world = trainer.args.world_size
    dims = ParallelDims.from_world(cp_size, world)  # names cp_size, with the arithmetic
    distributed = world > 1
    error, state = None, None
    try:
        if isinstance(trainer, CPRopeTrainerMixin):
            raise ValueError("trainer: already prepared by cp_rope.hf.prepare")
        if getattr(trainer, "model_init", None) is not None:
            raise ValueError("model_init: train() would build a new, unpatched model; pass the "
                             "model itself")
        _family(trainer.model)  # an unsupported family is named here, before any collective
        _check_router_loss(trainer.model.config)
        check_bool("fused_loss", fused_loss)
        loss_chunk_size = _check_loss_args(trainer, loss_impl, fused_loss, loss_chunk_size)
        placement = check_choice("placement", placement, PLACEMENTS)
        _check_parallelism(trainer)
        _check_data(trainer, dims.cp)
    except (TypeError, ValueError) as exc:
        error = exc
    if distributed:  # a rank's refusal reaches every rank; all ranks must pass the same
        sig = (dims.cp, method, backend, rope_kernel, placement, fused_loss,
               type(trainer).__name__, trainer.args.seed, trainer.args.data_seed)
        agree_across_ranks(None, error, sig, what="cp_rope.hf.prepare",
                           describe=lambda sigs: f"ranks were called with different arguments "
                           f"(cp_size, method, backend, rope_kernel, placement, fused_loss, "
                           f"trainer class, args.seed, args.data_seed): {sigs}")
    elif error is not None:
        raise error
    mesh = dims.build_mesh(trainer.args.device.type) if distributed else None
    cp_group = mesh["cp"].get_group() if mesh is not None else None
    rank = dist.get_rank() if distributed else 0
    dp_rank, cp_rank = divmod(rank, dims.cp)
    try:
        pad_id = getattr(trainer.processing_class, "pad_token_id", None)  # rows no label reads
        inner, packer = _packer(trainer.data_collator, dims.cp, cp_rank,
                                pad_id if isinstance(pad_id, int) else 0, placement,
                                split_threshold)
        collator = TrainerCollator(inner, packer)
        _probe(trainer, collator)
        state = CPRopeTrainerState(dims=dims, mesh=mesh, dp_rank=dp_rank, cp_rank=cp_rank,
                                   collator=collator, ignore_index=packer.ignore_index)
        loss_kwargs = dict(fused=fused_loss, chunk_size=loss_chunk_size, impl=loss_impl)
    except (TypeError, ValueError) as exc:
        error = exc
    if distributed:
        agree_across_ranks(None, error, None, what="cp_rope.hf.prepare", describe=str)
    elif error is not None:
        raise error
    # patch_model checks everything before it changes the model; the same model on every rank
    patch_model(trainer.model, group=cp_group, method=method, backend=backend,
                rope_kernel=rope_kernel, ulysses_size=ulysses_size, fused_norm=fused_norm,
                mlp_tile_tokens=mlp_tile_tokens, fused_swiglu=fused_swiglu)
    install_loss_forward(trainer.model, **loss_kwargs)
    trainer.data_collator = collator
    trainer.cp_rope = state
    trainer.__class__ = _cp_class(type(trainer))
    return trainer


def _check_loss_args(trainer, impl, fused_loss: bool, chunk_size):
    """The loss arguments of ``prepare`` as the trainers' ``--loss-impl`` /
    ``--loss-chunk-size`` refuse them, and what of the Trainer's own loss prepare cannot honour;
    returns ``chunk_size`` (None for 0: automatic). ValueError (TypeError for a non-int
    chunk) naming: ``loss_impl`` outside :data:`~cp_rope.parallel.choices.LOSS_IMPLS`, or a
    choice with ``fused_loss=False`` (only the fused loss has kernels to choose);
    ``"liger"`` with a ``loss_chunk_size`` (Liger picks its chunks), on a CPU device or without
    the package; ``loss_chunk_size`` negative or with ``fused_loss=False``; the Trainer's
    ``args.label_smoothing_factor``, ``compute_loss_func``, TRL's ``args.loss_type`` other
    than ``"nll"`` and a ``compute_loss`` overridden outside transformers / TRL (the CP loss
    replaces the Trainer's: they would be dropped silently)."""
    check_choice("loss_impl", impl, LOSS_IMPLS)
    if chunk_size is not None:
        chunk_size = check_int("loss_chunk_size", chunk_size, min_value=0) or None
    if not fused_loss and (impl != "auto" or chunk_size):
        what = f"loss_impl={impl!r}" if impl != "auto" else f"loss_chunk_size={chunk_size}"
        raise ValueError(f"{what}: is for the fused loss only (fused_loss=False)")
    smoothing = getattr(trainer.args, "label_smoothing_factor", 0.0) or 0.0
    if smoothing:
        raise ValueError(f"args.label_smoothing_factor={smoothing}: cp_rope's CP loss is the "
                         "token cross-entropy without label smoothing (set it to 0)")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError("compute_loss_func: prepare's loss is the token cross-entropy over the "
                         "CP group and would replace this function (pass none)")
    loss_type = getattr(trainer.args, "loss_type", "nll")  # TRL's SFTConfig
    if loss_type not in (None, "nll"):
        raise ValueError(f"args.loss_type={loss_type!r}: prepare's CP loss is the token "
                         "cross-entropy ('nll'); another loss would be replaced silently")
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in c.__dict__)
    if owner is not Trainer and not owner.__module__.startswith("trl."):
        raise ValueError(f"compute_loss: {owner.__name__} overrides it, and prepare's CP loss "
                         "(CPRopeTrainerMixin.compute_loss) would run instead of the override")
    if impl == "liger":
        if chunk_size:
            raise ValueError(f"loss_impl='liger' with loss_chunk_size={chunk_size}: Liger picks "
                             "its own chunks (use loss_impl='torch' or 'auto')")
        if torch.device(trainer.args.device).type != "cuda":
            raise ValueError(f"loss_impl='liger': Liger-Kernel's kernels run on CUDA and the "
                             f"trainer is on {trainer.args.device} (use loss_impl='auto' or "
                             "'torch')")
        if liger_missing():
            raise ValueError(f"loss_impl='liger': {liger_missing()}")
    return chunk_size
