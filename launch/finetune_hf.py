"""Fine-tuning (or continued pretraining) of a local transformers causal LM with packed CP.

One node, CPU (gloo), 2 processes, a checkpoint or config directory on disk::

    torchrun --standalone --nproc-per-node 2 -m cp_rope.launch.finetune_hf \\
        --model DIR --data corpus.jsonl --cp-size 2

One node, 8 GPUs: a downloaded Llama-3.2-1B, 64K-token documents split over 4 ranks, 2 DP groups::

    torchrun --standalone --nproc-per-node 8 -m cp_rope.launch.finetune_hf \\
        --model /ckpt/Llama-3.2-1B --data long.jsonl --cp-size 4 \\
        --seq-len 65536 --tokens-per-batch 65536 --lr 2e-5 --steps 1000

Two nodes x 8 GPUs (run on every node; the rendezvous endpoint is node 0)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id ft42 \\
        -m cp_rope.launch.finetune_hf --model /shared/Qwen3-8B --data long.jsonl \\
        --cp-size 8 --seq-len 131072 --tokens-per-batch 131072 --out-dir /shared/runs/ft

The model is transformers' own (one of ``cp_rope.hf.SUPPORTED_FAMILIES``: Llama, Mistral,
Qwen2, Qwen3, Phi3, Gemma 2 / 3, GPT-OSS, Qwen3-MoE, Mixtral; docs/hf.md), loaded
from ``--model`` only (``config.json`` plus weights, or a config alone for a
random init from ``--seed``; never a download), patched by
:func:`cp_rope.hf.patch_model` (CP attention over the mesh's ``"cp"`` group,
cp_rope's RoPE kernel unless ``--no-rope-kernel``). Everything else is
:mod:`cp_rope.launch.pretrain`'s trainer: the ``("dp", "cp")`` DeviceMesh,
documents packed by the token-budget sampler, :func:`~cp_rope.launch.parallelize.parallelize`
(FSDP2 over all ranks on GPU, bf16 compute on fp32 master weights; gradient
all-reduce on CPU), the loss :func:`cp_rope.parallel.cp_cross_entropy` (never
transformers' shifted loss), DCP checkpoints and ``--resume``, the same
logging (``metrics.jsonl``, TensorBoard, tqdm), SIGTERM handling. After the
last step the weights are written with ``save_pretrained`` to
``<out-dir>/hf_model`` together with ``--model``'s tokenizer files.

Data: tokenized with ``DIR/tokenizer.json`` when there is one (or
``--tokenizer``), else byte-level ids (then the model's ``vocab_size`` must be
at least 259). ``python -m cp_rope.launch.finetune_hf --help`` lists every flag.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import tyro
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

try:
    from cp_rope.hf import load_causal_lm, local_config
    from cp_rope.hf.families import check_config
    from cp_rope.hf.moe import MoESpec, moe_spec, router_loss_spec
    from cp_rope.hf.norms import LOW_PRECISION, norm_kernel
    from cp_rope.hf.tiled_mlp import swiglu_mlps

    from .hf_model import HFCausalLM
except ImportError as _exc:  # no transformers: the command says how to install it, no traceback
    if __name__ == "__main__":
        print(f"error: {_exc}", file=sys.stderr)
        raise SystemExit(2) from None
    raise
from cp_rope.ops import resolve_backend

from .cli import check_eval_flags, kebab_flags, plain_text, run_cli
from .config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PretrainConfig,
    TrainConfig,
    check_loss_impl,
    runs_on_cpu,
    validate,
)
from .data import load_tokenizer
from .offload import checkpoint_flag_argv
from .parallelize import compute_dtype
from .plan_memory import Shapes
from .pretrain import set_up, setup_distributed, summarize, train_loop
from .start_gate import agreed_start

__all__ = ["HFConfig", "FinetuneConfig", "HFCausalLM", "parse_args", "main"]

PROG = "torchrun --nproc-per-node N -m cp_rope.launch.finetune_hf"
HF_MODEL_DIR = "hf_model"
# FSDP2 warns that HFCausalLM (the FSDP root) returns a view ([1, T, V] -> [T, V]); the
# trainer's loss reads it out of place (no copy of the largest activation to silence that).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPHFCausalLM\) returned "
                        "a view tensor", category=UserWarning)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


@dataclass(kw_only=True, slots=True)
class HFConfig:
    """The transformers model."""

    model: str = ""
    """Local directory with config.json and optionally weights (model.safetensors / pytorch_model.bin); a config alone gives a random init from --seed. Never downloaded. Required."""
    rope_kernel: bool = True
    """RoPE by cp_rope's THD kernel (CP positions in-kernel); --no-rope-kernel keeps the model's own rotary embedding (on the global position_ids)."""
    fused_loss: bool = True
    """Loss from the base model's final hidden states and the lm_head weight in chunks of loss_chunk_size tokens (cp_rope.parallel.cp_linear_cross_entropy; tied embeddings and final logit softcapping included), so the [tokens, vocab_size] logits never exist whole; --no-fused-loss computes the logits, then cp_cross_entropy. Same value and gradients."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the fused loss (each chunk holds [chunk, vocab_size] float32 logits); 0 = automatic (2**27 / vocab_size, a multiple of 256 in [256, 65536]: 768 for Qwen's 151,936)."""
    fused_norm: bool = True
    """RMSNorms by a fused kernel in bf16 (cp_rope.hf.norms: Liger-Kernel's RMSNorm on CUDA where liger-kernel is installed, cp_rope's Triton RMSNorm with CP_ROPE_NORM_KERNEL=triton, else PyTorch's rms_norm; no float32 copies kept for backward); --no-fused-norm keeps transformers' own."""
    fused_swiglu: bool = True
    """SwiGLU MLPs (Llama, Mistral, Qwen2/3: down_proj(silu(gate_proj x) * up_proj x)) with the product by cp_rope's fused Triton kernel on CUDA (cp_rope.swiglu: gate and up kept instead of three tensors, tiled or not); --no-fused-swiglu keeps transformers' own."""
    mlp_tile_tokens: int = 0
    """Sequence-tiled MLP (ALST's TiledMLP) in every decoder layer: the MLP runs over tiles of this many tokens inside one autograd node, recomputed per tile in backward, so [tokens, intermediate_size] never exists whole; 0 = off. Same gradients."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute each decoder layer's activations in backward: none; full (keep the layer input); selective (also keep the attention output and its LSE; norms, projections and the MLP are recomputed). A bare --activation-checkpointing means full (cp_rope.launch.offload; transformers' own gradient checkpointing is not used)."""
    offload_activations: bool = False
    """Keep what each decoder layer saves for backward in pinned host memory (side-stream copies, prefetched one layer ahead)."""
    router_aux_loss: Literal["config", "on", "off"] = "config"
    """Mixture-of-experts models' router load-balancing loss (computed from the router statistics of the whole CP group's batch, packing pads excluded; logged as aux_loss; the gradient is that of loss + router_aux_loss_coef * aux_loss): config = as config.json says (output_router_logits with router_aux_loss_coef; a coefficient > 0 with output_router_logits false is an error, nothing is dropped silently); on = with the config's coefficient; off = without. Dense models: config or off."""
    memory: Literal["manual", "auto"] = "manual"
    """auto: the fastest --activation-checkpointing / --offload-activations / --mlp-tile-tokens / --fused-loss that fit the GPU, holding those given with other than their defaults (cp_rope.launch.plan_memory); manual: as given."""


@dataclass(kw_only=True, slots=True)
class FinetuneConfig:
    """Everything :func:`main` reads: the model directory and the trainer's sections."""

    hf: HFConfig = field(default_factory=HFConfig)
    """The transformers model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and batching."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Context parallelism; data-parallel size = world size / cp_size."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5, warmup_steps=10,
                                                                   weight_decay=0.0))
    """AdamW with linear warmup then cosine decay (fine-tuning defaults)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=100,
                                                                   out_dir="runs/finetune_hf"))
    """Loop, precision, logging, checkpoints."""


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    """Command line -> :class:`FinetuneConfig` (tyro; kebab-case flags without section prefixes).

    Raises: SystemExit on ``--help`` (0) or a malformed flag (2, tyro's message).
    """
    argv = checkpoint_flag_argv(kebab_flags(sys.argv[1:] if argv is None else argv))
    fc = tyro.cli(FinetuneConfig, args=argv, prog=PROG, description=plain_text(__doc__).strip(),
                  config=(tyro.conf.OmitArgPrefixes,),
                  console_outputs=True)  # under torchrun, start_gate keeps rank > 0's
    check_eval_flags(argv, fc.data.eval_docs)
    return fc


def _model_section(hf_config, hf: HFConfig) -> ModelConfig:
    """The trainer's :class:`ModelConfig` describing the transformers model (shapes for the
    MFU arithmetic, config.json and the ``--resume`` check)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelConfig(dim=hf_config.hidden_size, n_layers=hf_config.num_hidden_layers,
                       n_heads=heads, head_dim=head_dim,
                       n_kv_heads=getattr(hf_config, "num_key_value_heads", heads),
                       ffn_hidden_dim=hf_config.intermediate_size,
                       vocab_size=hf_config.vocab_size,
                       norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
                       rope_base=float(rope.get("rope_theta", 10000.0)), max_seq_len=0,
                       fused_loss=hf.fused_loss, loss_chunk_size=hf.loss_chunk_size,
                       mlp_tile_tokens=hf.mlp_tile_tokens, fused_swiglu=hf.fused_swiglu,
                       activation_checkpointing=hf.activation_checkpointing,
                       offload_activations=hf.offload_activations, memory=hf.memory)


def resolve(fc: FinetuneConfig) -> PretrainConfig:
    """The trainer's config for ``fc``: the model section from ``--model``'s config.json,
    its tokenizer.json as the default tokenizer.

    Raises: ConfigError naming the field (no ``--model``, not a local directory with a
    supported config, a tokenizer with more ids than the model's vocabulary,
    a rope backend other than auto).
    """
    if not fc.hf.model:
        raise ConfigError("hf.model='': required: --model DIR (a local checkpoint or config "
                          "directory)")
    try:
        hf_config = local_config(fc.hf.model)
    except ValueError as exc:
        raise ConfigError(f"hf.{exc}") from None
    data = dataclasses.replace(fc.data)
    own = os.path.join(fc.hf.model, "tokenizer.json")
    if data.tokenizer is None:  # the model's own ids, else bytes (never a BPE trained here)
        data.tokenizer = own if os.path.isfile(own) else "bytes"
    cfg = PretrainConfig(model=_model_section(hf_config, fc.hf), data=data,
                         parallel=fc.parallel, optim=fc.optim, train=fc.train)
    if fc.parallel.rope_backend != "auto":
        raise ConfigError(f"parallel.rope_backend={fc.parallel.rope_backend!r}: finetune_hf uses "
                          "auto (set CP_ROPE_BACKEND=torch|triton to force one)")
    _check_loss_impl(fc)
    _check_norm_kernel(fc)
    try:  # what patch_model would refuse of the config, before the data and the model load
        check_config(hf_config)
        moe = moe_spec(hf_config)
    except ValueError as exc:
        raise ConfigError(f"hf.model={fc.hf.model!r}: {exc}") from None
    if moe is not None and fc.hf.mlp_tile_tokens:  # cp_rope.hf.tiled_mlp refuses MoE blocks
        raise ConfigError(f"hf.mlp_tile_tokens={fc.hf.mlp_tile_tokens}: a mixture-of-experts "
                          "model: its router logits are recorded inside its MoE blocks, whose "
                          "tiles run without autograd (the load-balancing loss would lose its "
                          "gradient; the router chooses each token's experts anyway), so "
                          "cp_rope does not tile them; leave --mlp-tile-tokens off")
    n_ids = load_tokenizer(data).vocab_size
    if n_ids > hf_config.vocab_size:
        raise ConfigError(f"data.tokenizer={data.tokenizer!r}: {n_ids} ids (byte-level when "
                          f"None) but the model's vocab_size is {hf_config.vocab_size}: pass the "
                          "model's tokenizer with --tokenizer")
    return cfg


def _check_loss_impl(fc: FinetuneConfig) -> None:
    """``--loss-impl`` (``parallel.loss_impl``, the trainers' one field) against ``--model``'s
    loss flags and this machine, before any data or model is loaded: the shared rule,
    :func:`~cp_rope.launch.config.check_loss_impl` (ConfigError naming the field)."""
    check_loss_impl(fc.parallel.loss_impl, fused=fc.hf.fused_loss,
                    chunk_size=fc.hf.loss_chunk_size, device=fc.train.device)


def _check_norm_kernel(fc: FinetuneConfig) -> None:
    """``$CP_ROPE_NORM_KERNEL`` (:func:`cp_rope.hf.norms.norm_kernel`) against this machine,
    before any data or model is loaded: ConfigError naming it for an unknown value, or for
    ``liger`` on CUDA without liger-kernel."""
    try:
        norm_kernel("cpu" if runs_on_cpu(fc.train.device) else "cuda")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build_model(fc: FinetuneConfig, device: torch.device) -> HFCausalLM:
    """``--model`` loaded (or initialised from ``--seed``) in float32 on ``device``, wrapped."""
    try:
        lm, _ = load_causal_lm(fc.hf.model, dtype=torch.float32, seed=fc.train.seed)
    except ValueError as exc:  # damaged or mismatched weight files, named
        raise ConfigError(f"hf.{exc}") from None
    # activation checkpointing / offload: parallelize wraps self.layers (cp_rope.launch.offload)
    aux = router_aux(lm.config, fc.hf.router_aux_loss)
    lm.config.output_router_logits = aux is not None
    return HFCausalLM(lm.to(device), rope_kernel=fc.hf.rope_kernel, fused_loss=fc.hf.fused_loss,
                      loss_chunk_size=fc.hf.loss_chunk_size, mlp_tile_tokens=fc.hf.mlp_tile_tokens,
                      loss_impl=fc.parallel.loss_impl, fused_norm=fc.hf.fused_norm,
                      fused_swiglu=fc.hf.fused_swiglu, router_aux=aux)


def router_aux(hf_config, mode: str) -> MoESpec | None:
    """:func:`cp_rope.hf.moe.router_loss_spec` (``--router-aux-loss``), errors as ConfigError."""
    try:
        return router_loss_spec(hf_config, mode)
    except ValueError as exc:
        raise ConfigError(f"hf.{exc}") from None


def save_hf_model(model: HFCausalLM, fc: FinetuneConfig) -> str:
    """Collective: the trained weights gathered (FSDP2 shards included) and written by rank 0
    with ``save_pretrained`` to ``<out-dir>/hf_model``, with ``--model``'s tokenizer files.

    Returns: the directory.
    """
    path = os.path.join(fc.train.out_dir, HF_MODEL_DIR)
    state = get_model_state_dict(model.lm, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    if dist.get_rank() == 0:
        model.lm.save_pretrained(path, state_dict=state)
        for name in _TOKENIZER_FILES:
            src = os.path.join(fc.hf.model, name)
            if os.path.isfile(src) and not os.path.exists(os.path.join(path, name)):
                shutil.copy2(src, path)
    dist.barrier()
    return path


def model_files(path: str) -> list[str]:
    """The files directly in the model directory ``path`` (config, weights, tokenizer; no
    dotfiles), whose contents every rank must agree on (:mod:`cp_rope.launch.run_identity`)."""
    return [os.path.join(path, n) for n in sorted(os.listdir(path))
            if not n.startswith(".") and os.path.isfile(os.path.join(path, n))]


def _swiglu_summary(fc: FinetuneConfig, tr) -> str:
    """What runs the decoder MLPs' ``silu(gate) * up``, with how many of them it covers (a
    GELU, Phi3's fused ``gate_up_proj`` or a mixture of experts keeps transformers' own)."""
    n, total = len(swiglu_mlps(tr.model.lm)), len(tr.model.layers)
    if not fc.hf.fused_swiglu or not n:
        return f"transformers ({'--no-fused-swiglu' if n else f'none of the {total} MLPs is one'})"
    kernel = ("cp_rope's fused kernel" if resolve_backend("auto", tr.device) == "triton"
              else "cp_rope.swiglu, PyTorch expression (no CUDA)")
    return f"{kernel}, {n} of {total} MLPs"


def _memory_knobs(fc: FinetuneConfig, cfg: PretrainConfig) -> FinetuneConfig:
    """``fc`` with the tiled-MLP and fused-loss choice of ``cfg.model`` (``--memory auto`` sets them)."""
    m = cfg.model
    return dataclasses.replace(fc, hf=dataclasses.replace(
        fc.hf, mlp_tile_tokens=m.mlp_tile_tokens, fused_loss=m.fused_loss))


def _parsed(argv: list[str] | None) -> tuple[FinetuneConfig, PretrainConfig]:
    fc = parse_args(argv)
    cfg = resolve(fc)
    validate(cfg, int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)
    return fc, cfg


def main(argv: list[str] | None = None) -> dict:
    """Entry point: parse, validate, set up the process group, train, ``save_pretrained``.

    Works under torchrun, as a plain one-process ``python -m``, and inside an
    already initialised process group (tests), which it then leaves initialised.

    Returns: :func:`cp_rope.launch.pretrain.summarize`'s dict plus ``"hf_model"``
    (the saved directory, or None when the run stopped early).
    """
    (fc, cfg), store = agreed_start(lambda: _parsed(argv), lambda c: c[1].parallel.timeout_s)
    created, _ = setup_distributed(cfg, store)
    try:
        tr = set_up(cfg, build=lambda run_cfg, device: build_model(_memory_knobs(fc, run_cfg), device),
                    memory_shapes=Shapes.from_hf_dir(fc.hf.model, fused_swiglu=fc.hf.fused_swiglu), program="finetune_hf",
                    extra={"hf": dataclasses.asdict(fc.hf)},  # agreed, in config.json
                    files={"hf.model": model_files(fc.hf.model)})
        dtype = compute_dtype(cfg, tr.device.type)
        fused_norm = fc.hf.fused_norm and dtype in LOW_PRECISION
        kernel = {"liger": "Liger-Kernel's RMSNorm", "triton": "cp_rope's Triton RMSNorm",
                  "torch": "torch rms_norm"}[
            norm_kernel(tr.device.type)]
        tr.log.write(f"RMSNorm: {f'fused ({kernel})' if fused_norm else 'transformers'}")
        tr.log.write(f"SwiGLU MLPs (silu(gate) * up): {_swiglu_summary(fc, tr)}")
        try:
            try:
                train_loop(tr)
            except BaseException:
                tr.log.close()
                raise
            summary = summarize(tr)
            finished = not tr.interrupted and tr.step >= cfg.train.steps
            summary["hf_model"] = save_hf_model(tr.model, fc) if finished else None
            return summary
        finally:
            tr.start.close()  # after save_hf_model: the directory is this run's until then
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _cli() -> None:
    summary = run_cli(main)
    if summary.get("hf_model") and os.environ.get("RANK", "0") == "0":
        print(json.dumps({"hf_model": summary["hf_model"]}))


if __name__ == "__main__":
    _cli()
