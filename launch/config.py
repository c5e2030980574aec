"""Typed configuration of the pretraining entry point: what a config is and what is valid.

One ``@dataclass(kw_only=True, slots=True)`` per component, each field
documented by the docstring under it (that text is also the ``--help`` of its
command-line flag, so units live there; plain text, no markup). Named presets
are plain Python functions returning a :class:`PretrainConfig`. Reading a
config (preset < ``--config`` file < flags, through tyro) is
:mod:`cp_rope.launch.cli`; what a ``--resume`` must keep of it,
:mod:`cp_rope.launch.resume_config`.

:func:`validate` checks everything that can be checked without a process
group or data, so a bad config fails in milliseconds with a message naming
the field (``ConfigError: model.dim=128: must be divisible by model.n_heads=3``).
Options declared for methods that are not wired yet are refused in one place,
:func:`check_available`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from cp_rope.parallel.choices import AUTO, BACKEND_CHOICES, METHODS, PLACEMENTS, LossImpl

__all__ = [
    "ConfigError", "ModelConfig", "DataConfig", "ParallelConfig", "OptimConfig", "TrainConfig",
    "PretrainConfig", "SECTIONS", "PRESETS", "preset", "validate", "check_available", "to_dict",
    "check_loss_impl", "check_seq_len", "head_dim_of", "MEMORY_KNOBS", "runs_on_cpu",
]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field (``section.field``)."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Llama-style decoder shapes (see cp_rope.launch.model)."""

    dim: int = 128
    """Hidden size (model width), in features."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per attention layer."""
    head_dim: int = 0
    """Features per attention head; 0 = dim / n_heads (a transformers config's own head_dim
    where it differs: Qwen3, Gemma 3, GPT-OSS)."""
    n_kv_heads: int = 2
    """Key/value heads (GQA); must divide n_heads."""
    ffn_hidden_dim: int = 384
    """SwiGLU hidden size, in features."""
    vocab_size: int = 0
    """Vocabulary size; 0 = taken from the tokenizer (rounded up to a multiple of 64)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_base: float = 10000.0
    """RoPE base (theta); Llama 3 uses 500000."""
    max_seq_len: int = 0
    """Longest global sequence the RoPE cache covers, in tokens; 0 = data.seq_len."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init (output projections are scaled by 1/sqrt(2 n_layers))."""
    fused_loss: bool = True
    """Compute the loss from the final hidden states and the output weight in chunks of loss_chunk_size tokens (cp_rope.parallel.cp_linear_cross_entropy), so the [tokens, vocab_size] logits never exist whole; --no-fused-loss materialises the logits and runs cp_cross_entropy on them. Same value and gradients."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the fused loss (each chunk holds [chunk, vocab_size] float32 logits); 0 = automatic (2**27 / vocab_size, a multiple of 256 in [256, 65536]: 768 for a 151,936-token vocabulary)."""
    fused_swiglu: bool = True
    """The SwiGLU MLPs' silu(w1 x) * w3 x by cp_rope's fused Triton kernel on CUDA (cp_rope.swiglu: one kernel each way; keeps w1 x and w3 x, not silu(w1 x)); --no-fused-swiglu runs PyTorch's eager product (CPU runs it either way). Same result up to an ulp of the compute dtype."""
    mlp_tile_tokens: int = 0
    """Sequence-tiled MLP (ALST's TiledMLP): run each SwiGLU MLP over tiles of this many tokens inside one autograd node, recomputing each tile in backward, so the [tokens, ffn_hidden_dim] intermediates exist one tile at a time; 0 = off. Same gradients; the MLP forward runs twice."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none; full (keep each block's input, recompute the rest: least memory, ~30% more compute); selective (also keep the attention output and its LSE: norms, projections and the MLP are recomputed, attention is not). A bare --activation-checkpointing means full."""
    offload_activations: bool = False
    """Keep what each block saves for backward (its input under checkpointing) in pinned host memory, copied on a side stream and prefetched one block ahead in backward."""
    memory: Literal["manual", "auto"] = "manual"
    """manual: the memory flags as given; auto: python -m cp_rope.launch.plan_memory picks the fastest --activation-checkpointing / --offload-activations / --mlp-tile-tokens / --fused-loss that fit the GPU, holding those given (flags or --config file) with other than their defaults; a preset's own memory settings are chosen anew (the log names the held flags; an error says what the leanest setting would need when nothing fits)."""


MEMORY_KNOBS = ("activation_checkpointing", "offload_activations", "mlp_tile_tokens", "fused_loss")
"""The :class:`ModelConfig` fields ``--memory auto`` chooses
(:func:`cp_rope.launch.plan_memory.auto_settings`) unless a flag or the ``--config`` file gives
them (the memory planner's ``Settings`` fields of the same names)."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Corpus, tokenizer and batching."""

    data: str | None = None
    """Corpus: None = the running Python's stdlib *.py files; a .jsonl file (text field), a directory of .txt files, or a pre-tokenized .bin (memmap)."""
    tokenizer: str | None = None
    """bytes (256 ids + BOS/EOS/PAD), bpe (a byte-level BPE of bpe_vocab_size ids trained once on the training documents, saved as out_dir/tokenizer.json and reused by a resume; needs the tokenizers package), or the path of a local HuggingFace tokenizer.json; None = bpe for the default stdlib corpus, bytes for other text corpora (finetune_hf: the model's own tokenizer.json, else bytes; never a BPE trained there)."""
    bpe_vocab_size: int = 4096
    """Ids of the trained BPE (--tokenizer bpe): 256 bytes + 2 special tokens + merges."""
    eval_docs: int | None = None
    """Documents held out of training for the held-out loss and bits per byte, evenly spaced over the corpus (a .bin: its last ones); None = min(8, documents / 10); 0 = none."""
    text_field: str = "text"
    """JSONL key holding each document's text."""
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a pre-tokenized .bin file."""
    eos_id: int | None = None
    """EOS token id that ends each document of a .bin file (required for .bin)."""
    seq_mode: Literal["docs", "concat"] = "docs"
    """docs: one example per document (long ones cut at seq_len); concat: the document stream cut into seq_len-token sequences (GPT style), for long context."""
    seq_len: int = 1024
    """Longest example (docs) or exact sequence length (concat), in tokens, before CP sharding."""
    tokens_per_batch: int = 4096
    """Token budget of one CP group's global batch per step (per data-parallel rank), in tokens; global tokens per step = dp * this."""
    max_docs: int | None = None
    """Use only the first N documents of the corpus (quick tests)."""
    num_workers: int = 0
    """DataLoader worker processes (0 = collate in the training process)."""


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Context parallelism; data-parallel size = world size / cp_size."""

    cp_size: int = 1
    """Context-parallel degree C (ranks that share one sequence)."""
    cp_method: Literal[(*METHODS, AUTO)] = "ring"
    """CP attention algorithm: ring (P2P K/V rotation), allgather (K/V all-gather), ulysses (all-to-all to head-sharded whole sequences), hybrid (Ulysses groups of ulysses_size ranks joined by a ring) or auto (chosen per batch by the cost model, cp_rope.parallel.cost_model; constants from --cp-calibration)."""
    ulysses_size: int = 1
    """hybrid only (and required there): ranks per Ulysses all-to-all group, > 1, dividing cp_size (cp_size = Ulysses; 1, the ring, is refused so that a forgotten flag does not silently run the ring)."""
    cp_placement: Literal[(*PLACEMENTS, AUTO)] = "zigzag"
    """How documents are laid out over the CP ranks: zigzag (every document split in 2 x cp_size chunks), per_document (documents up to cp_split_threshold tokens stay whole on one rank; longer ones zigzag) or auto (placement and split threshold chosen per batch by the cost model: cp_rope.parallel.cost_model.AutoPlacement)."""
    cp_split_threshold: int | None = None
    """per_document only: longest document kept whole on one rank, in tokens (padded length); None = cp_rope.parallel.default_split_threshold(head_dim, cp_size) = 2 x cp_size x max(512, 65536 // head_dim), e.g. 2048 at head_dim 128 and cp_size 2."""
    attn_backend: Literal[BACKEND_CHOICES] = "auto"
    """Per-block attention kernel used by CP attention; flash_attn, torch_flash and torch_cudnn need CUDA and bf16/fp16, reference runs anywhere."""
    rope_backend: Literal["auto", "triton", "torch"] = "auto"
    """RoPE kernel: Triton on GPU (auto) or the pure-PyTorch path; triton on cpu needs TRITON_INTERPRET=1."""
    loss_impl: LossImpl = "auto"
    """The fused loss's kernel (cp_rope.parallel.cp_linear_cross_entropy): torch (cp_rope's chunked loop of loss_chunk_size tokens, float32 logits, any device); liger (Liger-Kernel's fused linear cross-entropy, CUDA, its own chunks; pip install 'cp-rope[liger]'); auto = liger on CUDA in bf16 when installed and no --loss-chunk-size is given, else torch. The run's log names the one used. Same value and gradients up to the compute dtype's rounding."""
    fsdp: Literal["auto", "on", "off"] = "auto"
    """Shard parameters, gradients and optimizer state with FSDP2 over all dp x cp ranks; auto = on for cuda, off (plain gradient all-reduce) on cpu."""
    timeout_s: int = 600
    """Process-group timeout, in seconds: a hung collective fails after this."""
    cp_self_test: Literal["on", "off"] = "on"
    """Before the first step, check RoPE + CP attention + CP loss on the CP group against the unsharded computation (cp_rope.parallel.self_test, seconds; its time is logged); a misconfiguration fails the run naming the setting."""
    cp_calibration: str | None = None
    """JSON of the CP cost model's constants for --cp-method auto / --cp-placement auto and for --attn-backend auto's FA4 / cuDNN crossover (python -m cp_rope.parallel.calibrate --out PATH on this machine), loaded once at start-up and carried by every attention plan; None = the shipped H200 numbers."""


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (end of the cosine)."""
    warmup_steps: int = 20
    """Linear warmup, in optimizer steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only; norms and embeddings get none)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm (over all ranks) to this; 0 = off."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Loop, precision, logging, checkpoints."""

    steps: int = 120
    """Optimizer steps to train (total, including steps before a resume)."""
    stop_at_step: int | None = None
    """Stop (saving a checkpoint) after this step although the LR schedule spans --steps, e.g. to fit a job time limit; resume later with --resume."""
    seed: int = 0
    """Seed of the weight init and the data order (>= 0)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available (NCCL), else cpu (gloo)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: auto = bfloat16 on cuda (FSDP2 mixed precision, fp32 master weights and reductions), float32 on cpu."""
    out_dir: str = "runs/pretrain"
    """Run directory: metrics.jsonl, TensorBoard events, checkpoints/."""
    log_every: int = 10
    """Log loss, LR, tokens/s every N steps, in steps."""
    eval_every: int | None = None
    """Evaluate the loss and bits per byte on the held-out documents (--eval-docs) every N steps, in steps, and after the last step; None = after the last step only."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    save_final: bool = True
    """Save a checkpoint after the last step (a --stop-at-step stop always saves one: its resume needs it)."""
    keep_checkpoints: int = 2
    """Keep the newest N checkpoints, delete older ones (0 = keep all)."""
    resume: bool = False
    """Resume from the newest checkpoint in out_dir/checkpoints (none there: an error, unless --allow-fresh-start); metrics.jsonl lines after the resumed step are dropped, then appended to."""
    allow_fresh_start: bool = False
    """With --resume: start a fresh run when out_dir holds no checkpoint yet (the first submission of a job that is always submitted with --resume, e.g. launch/slurm_pretrain.sh)."""
    overwrite: bool = False
    """Without --resume: delete the checkpoints and metrics.jsonl an earlier run left in out_dir (without this flag such an out_dir is an error)."""
    save_on_signal: bool = True
    """On SIGTERM / Ctrl-C, save a checkpoint before exiting."""
    stop_grace_s: float = 20.0
    """After SIGTERM / Ctrl-C, seconds the current step may take to finish; a rank still in it then (e.g. stuck in a collective with a dead peer) exits with status 128 + signal, without a checkpoint; 0 = wait for the step. Keep it below the scheduler's kill delay (torchrun / SLURM: 30 s)."""
    tensorboard: bool = True
    """Write TensorBoard events when the tensorboard package is installed."""
    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one GPU for MFU; 0 = from the device name (H100/H200/A100/B200)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0 when stderr is a terminal (piped to a file: the log lines only)."""


@dataclass(kw_only=True, slots=True)
class PretrainConfig:
    """Everything cp_rope.launch.pretrain.main needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shapes."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and batching."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Context / data parallelism."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop, precision, logging, checkpoints."""


SECTIONS = ("model", "data", "parallel", "optim", "train")
"""The component tables, in the order of :class:`PretrainConfig` (and of a config file)."""


# ------------------------------------------------------------------- presets
def tiny() -> PretrainConfig:
    """CPU default: ~1.8M parameters with the stdlib corpus' 4096-id BPE (0.9M with --tokenizer
    bytes), 1024-token examples, held-out evaluation every 40 steps."""
    return PretrainConfig(train=TrainConfig(eval_every=40))


def gpt_125m() -> PretrainConfig:
    """GPT-3 Small / GPT-2 125M widths with Llama blocks."""
    return PretrainConfig(
        model=ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden_dim=2048),
        data=DataConfig(seq_len=8192, tokens_per_batch=65536),
        optim=OptimConfig(lr=6e-4, warmup_steps=100), train=TrainConfig(steps=1000, log_every=10))


def llama_1b() -> PretrainConfig:
    """Llama-3.2-1B shapes (dim 2048, 16 layers, 32/8 heads, SwiGLU 8192, RoPE base 500000)."""
    return PretrainConfig(
        model=ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_dim=8192,
                          rope_base=500000.0),
        data=DataConfig(seq_mode="concat", seq_len=65536, tokens_per_batch=65536),
        optim=OptimConfig(lr=3e-4, warmup_steps=50), train=TrainConfig(steps=500, log_every=10))


def llama3_8b() -> PretrainConfig:
    """Llama-3-8B shapes (dim 4096, 32 layers, 32/8 heads, SwiGLU 14336, RoPE base 500000)."""
    return PretrainConfig(
        model=ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336,
                          rope_base=500000.0, activation_checkpointing="full"),
        data=DataConfig(seq_mode="concat", seq_len=131072, tokens_per_batch=131072),
        optim=OptimConfig(lr=3e-4, warmup_steps=100), train=TrainConfig(steps=1000, log_every=1))


PRESETS = {"tiny": tiny, "125m": gpt_125m, "1b": llama_1b, "8b": llama3_8b}


def preset(name: str) -> PretrainConfig:
    """The named preset (a fresh object). Raises ConfigError for an unknown name."""
    if name not in PRESETS:
        raise ConfigError(f"preset={name!r}: expected one of {sorted(PRESETS)}")
    return PRESETS[name]()


def to_dict(cfg: PretrainConfig) -> dict:
    """Nested plain dict (JSON-serialisable), e.g. for logging the run's config."""
    return {s: {f.name: getattr(getattr(cfg, s), f.name) for f in dataclasses.fields(getattr(cfg, s))}
            for s in SECTIONS}


# ---------------------------------------------------------------- validation
def _require(ok: bool, where: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{where}={value!r}: {why}")


def check_seq_len(seq_len: int, cp_size: int) -> None:
    """The trainers' rule for ``data.seq_len`` at ``cp_size`` (ConfigError naming the field)."""
    _require(seq_len >= 2, "data.seq_len", seq_len, "must be >= 2 tokens")
    _require(seq_len % (2 * cp_size) == 0, "data.seq_len", seq_len,
             f"must be a multiple of 2 * cp_size = {2 * cp_size} (zigzag CP chunks)")


MAX_TIMEOUT_S = 7 * 24 * 3600
"""The longest ``parallel.timeout_s`` accepted, in seconds."""


def head_dim_of(m: ModelConfig) -> int:
    """``m``'s features per attention head: ``head_dim``, or ``dim / n_heads`` when 0."""
    return m.head_dim or m.dim // m.n_heads


def validate(cfg: PretrainConfig, world_size: int | None = None) -> None:
    """Check every field that can be checked before any heavy work.

    Args:
        cfg: the config.
        world_size: when given, also check that ``cp_size`` divides it.

    Raises:
        ConfigError: naming the first bad field (``section.field=value: why``).
    """
    m, d, p, o, t = cfg.model, cfg.data, cfg.parallel, cfg.optim, cfg.train
    for section in SECTIONS:  # inf / nan pass every comparison below: refuse them first
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            _require(not isinstance(value, float) or math.isfinite(value), f"{section}.{f.name}",
                     value, "must be finite")
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim"):
        _require(getattr(m, name) >= 1, f"model.{name}", getattr(m, name), "must be >= 1")
    _require(m.head_dim >= 0, "model.head_dim", m.head_dim, "must be >= 0 (0 = dim / n_heads)")
    if m.head_dim:
        _require(m.head_dim % 2 == 0, "model.head_dim", m.head_dim, "must be even for RoPE")
    else:
        _require(m.dim % m.n_heads == 0, "model.dim", m.dim,
                 f"must be divisible by model.n_heads={m.n_heads} (or set model.head_dim)")
        _require((m.dim // m.n_heads) % 2 == 0, "model.n_heads", m.n_heads,
                 f"head_dim = dim / n_heads = {m.dim // m.n_heads} must be even for RoPE")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
             f"must divide model.n_heads={m.n_heads} (GQA)")
    _require(m.vocab_size >= 0, "model.vocab_size", m.vocab_size, "must be >= 0 (0 = from the tokenizer)")
    _require(m.norm_eps > 0, "model.norm_eps", m.norm_eps, "must be > 0")
    _require(m.rope_base > 1, "model.rope_base", m.rope_base, "must be > 1")
    _require(m.init_std > 0, "model.init_std", m.init_std, "must be > 0")
    _require(m.loss_chunk_size >= 0, "model.loss_chunk_size", m.loss_chunk_size,
             "must be >= 0 tokens per fused-loss chunk (0 = automatic)")
    _require(m.loss_chunk_size == 0 or m.fused_loss, "model.loss_chunk_size", m.loss_chunk_size,
             "is for the fused loss only (this run: --no-fused-loss)")
    _require(m.mlp_tile_tokens >= 0, "model.mlp_tile_tokens", m.mlp_tile_tokens,
             "must be >= 0 tokens per MLP tile (0 = off)")
    _require(m.max_seq_len == 0 or m.max_seq_len >= d.seq_len, "model.max_seq_len", m.max_seq_len,
             f"must be 0 or >= data.seq_len={d.seq_len}")
    _require(p.cp_size >= 1, "parallel.cp_size", p.cp_size, "must be >= 1")
    _require(p.ulysses_size >= 1, "parallel.ulysses_size", p.ulysses_size, "must be >= 1")
    if p.cp_method == "hybrid":
        # 1 is the field's default: a forgotten --ulysses-size would silently run the ring
        _require(p.ulysses_size > 1, "parallel.ulysses_size", p.ulysses_size,
                 "--cp-method hybrid needs --ulysses-size U > 1, a divisor of cp_size "
                 "(U = 1 is the ring: use --cp-method ring)")
        _require(p.cp_size % p.ulysses_size == 0, "parallel.ulysses_size", p.ulysses_size,
                 f"must divide parallel.cp_size={p.cp_size} (hybrid: cp_size / ulysses_size rings)")
    else:
        _require(p.ulysses_size == 1, "parallel.ulysses_size", p.ulysses_size,
                 f"is for --cp-method hybrid only (this run: {p.cp_method})")
    if p.cp_method in ("ulysses", "hybrid"):  # heads split over the all-to-all's U ranks
        u = p.cp_size if p.cp_method == "ulysses" else p.ulysses_size
        _require(m.n_heads % u == 0, "model.n_heads", m.n_heads,
                 f"must be divisible by the all-to-all size U = {u} of --cp-method {p.cp_method}")
        _require(m.n_kv_heads % u == 0 or u % m.n_kv_heads == 0, "model.n_kv_heads",
                 m.n_kv_heads, f"must divide or be a multiple of the all-to-all size U = {u} of "
                 f"--cp-method {p.cp_method}")
    _require(p.cp_split_threshold is None or p.cp_split_threshold >= 1,
             "parallel.cp_split_threshold", p.cp_split_threshold, "must be None or >= 1 token")
    _require(p.cp_split_threshold is None or p.cp_placement == "per_document",
             "parallel.cp_split_threshold", p.cp_split_threshold,
             f"is for --cp-placement per_document only (this run: {p.cp_placement})")
    check_available(cfg)
    check_loss_impl(p.loss_impl, fused=m.fused_loss, chunk_size=m.loss_chunk_size,
                    device=t.device, where="parallel.loss_impl")
    _require(1 <= p.timeout_s <= MAX_TIMEOUT_S, "parallel.timeout_s", p.timeout_s,
             f"must be in [1, {MAX_TIMEOUT_S}] seconds (7 days; a longer timeout overflows "
             "the process group's timedelta)")
    if world_size is not None:
        _require(world_size % p.cp_size == 0, "parallel.cp_size", p.cp_size,
                 f"must divide the world size {world_size} (data-parallel size = world / cp_size "
                 f"= {world_size} / {p.cp_size} is not an integer)")
    check_seq_len(d.seq_len, p.cp_size)
    _require(d.tokens_per_batch >= d.seq_len, "data.tokens_per_batch", d.tokens_per_batch,
             f"must hold one sequence of data.seq_len={d.seq_len} tokens")
    _require(d.max_docs is None or d.max_docs >= 1, "data.max_docs", d.max_docs, "must be >= 1")
    _require(d.num_workers >= 0, "data.num_workers", d.num_workers, "must be >= 0")
    if d.data is not None:
        _require(os.path.exists(d.data), "data.data", d.data, "no such file or directory")
        if d.data.endswith(".bin"):
            _require(d.eos_id is not None, "data.eos_id", d.eos_id,
                     "a pre-tokenized .bin corpus needs --eos-id (the id that ends each document)")
            _require(m.vocab_size > 0, "model.vocab_size", m.vocab_size,
                     "a pre-tokenized .bin corpus needs --vocab-size")
    _require(d.eos_id is None or (d.data is not None and d.data.endswith(".bin")), "data.eos_id",
             d.eos_id, "is for a pre-tokenized .bin corpus (--data X.bin); a text corpus ends "
             "each document with its tokenizer's EOS")
    if d.tokenizer not in (None, "bytes", "bpe"):
        _require(os.path.isfile(d.tokenizer), "data.tokenizer", d.tokenizer,
                 "no such file (or bytes / bpe)")
    _require(d.tokenizer != "bpe" or d.data is None or not d.data.endswith(".bin"),
             "data.tokenizer", d.tokenizer, "a pre-tokenized .bin corpus has its ids already")
    _require(259 <= d.bpe_vocab_size <= 2**20, "data.bpe_vocab_size", d.bpe_vocab_size,
             "must be in [259, 2**20] (256 bytes + 2 special tokens + merges)")
    _require(d.eval_docs is None or d.eval_docs >= 0, "data.eval_docs (--eval-docs)", d.eval_docs,
             "must be >= 0 documents (0 = no held-out evaluation)")
    _require(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    _require(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    _require(0 <= o.beta1 < 1, "optim.beta1", o.beta1, "must be in [0, 1)")
    _require(0 <= o.beta2 < 1, "optim.beta2", o.beta2, "must be in [0, 1)")
    _require(o.eps > 0, "optim.eps", o.eps, "must be > 0")
    _require(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0 (0 = off)")
    _require(t.steps >= 1, "train.steps", t.steps, "must be >= 1")
    _require(0 <= t.seed < 2**63, "train.seed", t.seed, "must be in [0, 2**63) (NumPy seeds are "
             "unsigned, torch's 64-bit)")
    _require(t.stop_grace_s >= 0, "train.stop_grace_s", t.stop_grace_s, "must be >= 0 (0 = off)")
    _require(t.stop_at_step is None or t.stop_at_step >= 1, "train.stop_at_step", t.stop_at_step,
             "must be >= 1")
    _require(t.stop_at_step is None or t.stop_at_step <= t.steps, "train.stop_at_step",
             t.stop_at_step, f"must be <= train.steps={t.steps} (the run ends at --steps anyway; "
             "to train longer, raise --steps)")
    _require(t.log_every >= 1, "train.log_every", t.log_every, "must be >= 1")
    _require(t.eval_every is None or t.eval_every >= 1, "train.eval_every (--eval-every)",
             t.eval_every, "must be >= 1 step (unset: after the last step only; --eval-docs 0: "
             "no evaluation)")
    _require(t.checkpoint_every >= 0, "train.checkpoint_every", t.checkpoint_every, "must be >= 0")
    _require(t.resume or not t.allow_fresh_start, "train.allow_fresh_start", True, "is for --resume")
    _require(t.keep_checkpoints >= 0, "train.keep_checkpoints", t.keep_checkpoints, "must be >= 0")
    _require(t.peak_tflops >= 0, "train.peak_tflops", t.peak_tflops, "must be >= 0")
    import torch

    if t.device == "cuda":
        _require(torch.cuda.is_available(), "train.device", t.device, "CUDA is not available")
    on_cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    if p.attn_backend in ("cudnn", "fa4", "flash_attn", "torch_flash", "torch_cudnn"):
        _require(on_cuda, "parallel.attn_backend", p.attn_backend,
                 "needs CUDA (this run is on cpu); use auto or reference")
        _require(t.dtype != "float32", "parallel.attn_backend", p.attn_backend,
                 "runs float16/bfloat16 only; use --dtype auto/bfloat16, or auto or reference")
    if p.attn_backend in ("fa4", "flash_attn", "cudnn") and on_cuda and t.dtype != "float32":
        from cp_rope.parallel import backend_unavailable

        # the library's own rule: package (with its install command), GPU generation, head_dim
        why = backend_unavailable(p.attn_backend, device="cuda",
                                  dtype=torch.float16 if t.dtype == "float16" else torch.bfloat16,
                                  head_dim=head_dim_of(m))
        _require(why is None, "parallel.attn_backend", p.attn_backend, str(why))
    if p.rope_backend == "triton" and not on_cuda:
        _require(os.environ.get("TRITON_INTERPRET", "0") == "1", "parallel.rope_backend",
                 p.rope_backend, "the Triton kernel needs CUDA, or TRITON_INTERPRET=1 on cpu "
                 "(set before cp_rope is imported); use auto or torch")
    _require(not (t.dtype == "bfloat16" and not on_cuda), "train.dtype", t.dtype,
             "bfloat16 training is for cuda; this run is on cpu (--device "
             f"{t.device}{', no GPU found' if t.device == 'auto' else ''}): use float32 or auto")


def runs_on_cpu(device: str) -> bool:
    """Whether ``--device device`` runs on the CPU: ``cpu``, or ``auto`` without CUDA."""
    import torch
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def check_loss_impl(impl: str, *, fused: bool, chunk_size: int, device: str,
                    where: str = "parallel.loss_impl") -> None:
    """``--loss-impl`` against the other loss flags and this machine, before anything runs (both
    trainers: ``where`` names the field).

    Raises: ConfigError naming ``where``: not ``auto`` with ``--no-fused-loss``; ``liger`` with
    ``--loss-chunk-size`` (Liger picks its own chunks), on a CPU run, or without liger-kernel
    installed (the library's own reason, :func:`cp_rope.parallel.loss.liger_missing`).
    """
    _require(impl == "auto" or fused, where, impl,
             "is for the fused loss only (this run: --no-fused-loss)")
    if impl != "liger":
        return
    _require(not chunk_size, f"{where}='liger' with --loss-chunk-size", chunk_size,
             "Liger picks its own chunks; the chunk size is the torch loop's (--loss-impl torch "
             "or auto)")
    from cp_rope.parallel.loss import liger_missing
    _require(not runs_on_cpu(device), where, impl, "Liger-Kernel's kernels run on CUDA and this "
             "run is on cpu: use --loss-impl auto (or torch)")
    _require(liger_missing() is None, where, impl, f"{liger_missing()} (or --loss-impl auto/torch)")


NOT_AVAILABLE_YET: dict[str, tuple[str, ...]] = {}
"""Choices the config declares but the trainer does not run yet (their flags exist so that
scripts and docs can name them). Wiring one in means deleting it here, and only here."""


def check_available(cfg: PretrainConfig) -> None:
    """Refuse a choice of :data:`NOT_AVAILABLE_YET`.

    Raises:
        ConfigError: ``section.field=value: not available yet ...`` (the table is empty
            now: every declared choice runs).
    """
    for where, values in NOT_AVAILABLE_YET.items():
        section, name = where.split(".")
        value = getattr(getattr(cfg, section), name)
        _require(value not in values, where, value,
                 "not available yet in cp_rope.launch (declared for a coming release); "
                 "choose one of the others")
