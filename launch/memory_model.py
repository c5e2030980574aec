"""Per-GPU memory of a training step by component (:func:`estimate`) and its rough time
(:func:`step_seconds`), for the settings of a run (:class:`Settings`): the arithmetic
:mod:`cp_rope.launch.plan_memory` chooses with.

The model (bytes per GPU; ``T`` = tokens per step of a CP group, ``T/C`` per
rank; ``N = dp x cp`` FSDP2 ranks; bf16 compute on fp32 master weights):

* parameters: fp32 shards ``4P/N`` + the bf16 root (embedding, head) and two
  gathered layers (the current one and FSDP2's prefetch); a mixture of experts counts
  every expert and the router (:class:`~cp_rope.launch.memory_shapes.Shapes`);
* gradients: at the peak (the start of backward) only the root's and one
  layer's exist unsharded (fp32 reduce); the optimizer step holds ``4P/N``;
* optimizer: AdamW's two fp32 moments, ``8P/N``;
* saved activations: per token per layer, what autograd keeps (counted from
  the operators: norms keep their input, linears theirs, attention q, k, v, its
  output and fp32 LSE, an untiled SwiGLU four ``[T, ffn]`` tensors (three with cp_rope's fused
  SwiGLU, ``Shapes.fused_swiglu``: no ``silu(w1 x)``; a MoE token: of each
  of its ``num_experts_per_tok`` experts, and the router's probabilities); ``full``
  keeps the layer input, ``selective`` the input, attention output and LSE, and with
  offload a tiled MLP's output);
  with offload, two layers' worth in flight on the GPU (the last layer's stay there: at the
  loss, they and the copy in progress; in backward, the current layer's and the prefetch) and
  the other layers' in pinned host memory;
* the peak is the larger of two phases, and the components printed are that
  phase's: **the loss** (every layer's kept tensors, the layer outputs and the
  final norm's, and the loss: unfused ``[T, V]`` logits, their fp32 copy and
  gradient; fused (:func:`cp_rope.parallel.cp_linear_cross_entropy`): one chunk
  of logits (the torch loop: ``[chunk, V]`` fp32 and its gradient; Liger: ``[chunk, V]`` bf16,
  its gradient in place, Liger's own chunk), the hidden-state gradient and the fp32
  head-weight gradient) or
  **the first backward layer** (the other layers' kept tensors in flight, and
  its working set: the larger of its MLP backward, i.e. a checkpointed layer's
  recomputed tensors plus two ``[T, ffn]`` gradients untiled or one tile's worth
  tiled, and its attention backward, i.e. what is recomputed up to the
  attention, dout, dq/dk/dv, the residual's gradient and cuDNN's backward
  workspace ``3 T Hq (D + 1)`` fp32, :data:`CUDNN_BWD_WORKSPACE`);
* attention workspace: LSE and softmax statistics, fp32 dq/dk/dv accumulators under CP;
* communication: the ring's K/V receive buffers (all-gather: every rank's K/V); with
  sliding windows on every layer the windowed ring receives only the ``W - 1`` keys before
  each chunk (attention memory is per query otherwise: saved q/k/v/output/LSE and cuDNN's
  workspace do not grow with the keys a window reaches); the step time ranking settings
  counts each layer's windowed pairs (:func:`cp_rope.parallel.cost_model.causal_pairs`).

Calibrated on one H200 (docs/benchmarks.md, Memory rounds 1-4): every measured peak
within 10 %: ``--preset 1b`` none at 65,536 tokens (+0.4 %), full at 131,072 /
262,144 (-1.0 / -3.8 %), selective + offload + tiled MLP at 262,144 / 524,288
(-9.9 / +1.8 %); bench_memory's Qwen3 shape (packed documents) none at 32,768
(+7.3 %), selective + offload + tiled at 131,072 / 262,144 (-1.1 / -0.8 %),
selective + tiled at 262,144 (+0.8 %), full + offload + tiled at 1,048,576 (-0.1 %).
Since selective + offload + tiled keeps the tiled MLP's output (launch/offload.py), its
estimates against those peaks (measured before) are -6.6 / +6.5 % (1b) and +0.9 / +1.6 %
(Qwen3): those peaks are to be measured again. Every peak above was measured with PyTorch's
eager SwiGLU product (``Shapes.fused_swiglu`` False); with cp_rope's fused SwiGLU the Qwen3
shape's none at 32,768 peaked at 16.5 GiB on an H100 with Liger's loss (round 11; estimate
+4.0 % with Liger's chunks priced, ``--loss-impl liger``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cp_rope.parallel._loss_impl import liger_chunk_tokens
from cp_rope.parallel.cost_model import causal_pairs

from .memory_shapes import Shapes

__all__ = ["Settings", "estimate", "step_seconds", "GIB"]

GIB = 1 << 30
HOST_BW = 55e9
"""Pinned host <-> device copy bandwidth, bytes/s each way (H200, issue 21)."""
CUDNN_BWD_WORKSPACE = 3 * 4
"""Bytes per token, query head and (head_dim + 1) of the cuDNN SDPA backward's workspace
(frontend 1.32, cuDNN 9.19, H200: 6,492,869,760 bytes for a THD call of 262,144 tokens with
16 heads of 128, i.e. three fp32 ``[T, Hq, D + 1]`` buffers); assumed the same for dense calls."""
ASSUMED_FLOPS = 0.4 * 989e12
"""Achieved bf16 FLOP/s assumed when ranking settings by time (only the order matters)."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The memory knobs of a run (the trainers' flags of the same names)."""

    activation_checkpointing: str = "none"
    offload_activations: bool = False
    mlp_tile_tokens: int = 0
    """0 = untiled SwiGLU."""
    fused_loss: bool = True
    loss_chunk_size: int = 0
    """0 = cp_rope.parallel.loss.auto_chunk_size(V)."""
    loss_impl: Literal["torch", "liger"] = "torch"
    """The fused loss's kernel (``--loss-impl`` resolved, as the run's log names it): torch, its
    chunks of ``[loss_chunk_size, V]`` float32 logits and their gradient; liger, Liger-Kernel's
    chunks of :func:`~cp_rope.parallel._loss_impl.liger_chunk_tokens` tokens, ``[chunk, V]``
    bf16 logits whose gradient Liger writes in place (``--loss-impl auto`` on CUDA in bf16 with
    liger-kernel installed)."""

    def flags(self) -> str:
        out = [f"--activation-checkpointing {self.activation_checkpointing}"]
        if self.offload_activations:
            out.append("--offload-activations")
        if self.mlp_tile_tokens:
            out.append(f"--mlp-tile-tokens {self.mlp_tile_tokens}")
        out.append("--fused-loss" if self.fused_loss else "--no-fused-loss")
        return " ".join(out)


def _per_token_layer(s: Shapes, mode: str, tiled: bool, offload: bool) -> tuple[int, int]:
    """(bytes kept per token per layer in ``mode``, bytes a recomputed layer holds per token)."""
    q, kv, d = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim
    lse = 4 * s.n_heads
    # x, norm out (x2 norms), h; q', k', v, o; rstd of two norms (fp32)
    everything = 2 * (4 * d + 2 * q + 2 * kv) + lse + 8
    if s.qk_norm:
        everything += 2 * (q + kv)
    if s.n_moe:  # the router's fp32 probabilities, each token's copies for its experts
        everything += 4 * s.n_experts + 2 * s.experts_per_tok * d
    if not tiled:  # w1 x, w3 x, silu(w1 x), their product (a MoE token: of each of its experts);
        # the fused SwiGLU (cp_rope.swiglu) keeps no silu(w1 x)
        everything += 2 * (3 if s.fused_swiglu else 4) * s.act_ffn
    kept = {"none": everything, "full": 2 * d, "selective": 2 * d + 2 * q + lse}[mode]
    if mode == "selective" and tiled and offload:  # the tiled MLP's output (launch/offload.py)
        kept += 2 * d
    return kept, everything


def _fused_loss_bytes(s: Shapes, st: Settings, t: int) -> int:
    """The fused loss's own memory for ``t`` tokens on a rank: one chunk's logits (and, torch,
    their float32 gradient), the hidden states' bf16 gradient, the float32 head-weight
    gradient (Liger's ``accum_dtype``; the torch loop's accumulator)."""
    if st.loss_impl == "liger":
        chunk = liger_chunk_tokens(t, s.vocab, s.dim) * s.vocab * 2
    else:
        c = st.loss_chunk_size or min(65536, max(256, (1 << 27) // max(s.vocab, 1) // 256 * 256))
        chunk = min(c, t) * s.vocab * 8
    return chunk + t * s.dim * 2 + 4 * s.vocab * s.dim


def estimate(s: Shapes, st: Settings, *, tokens: int, cp: int = 1, dp: int = 1,
             doc_len: int | None = None, cp_method: str = "ring") -> dict[str, int]:
    """Peak bytes per GPU by component (and ``"total"``) for one step of ``tokens`` tokens per CP
    group (``doc_len``: documents' length, default ``tokens``: one sequence). The components
    are those of the peak phase (module docstring): ``"loss"`` is 0 when the first backward
    layer peaks, ``"layer working set"`` 0 when the loss does.

    Raises: ValueError naming the argument (non-positive sizes, unknown mode).
    """
    for name, v in (("tokens", tokens), ("cp", cp), ("dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if st.activation_checkpointing not in ("none", "full", "selective"):
        raise ValueError(f"activation_checkpointing={st.activation_checkpointing!r}: expected "
                         "none, full or selective")
    if st.loss_impl not in ("torch", "liger"):
        raise ValueError(f"loss_impl={st.loss_impl!r}: expected torch or liger (auto resolved "
                         "for the run's device, as its log names it)")
    n, t = dp * cp, -(-tokens // cp)
    q, kv, d = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim
    tiled = st.mlp_tile_tokens > 0
    kept, everything = _per_token_layer(s, st.activation_checkpointing, tiled,
                                        st.offload_activations)
    # layers whose kept tensors are on the GPU
    in_flight = min(2, s.n_layers) if st.offload_activations else s.n_layers
    out = {
        "parameters": 4 * s.params // n + 2 * s.root_params + 2 * 2 * s.layer_params,
        "gradients": 4 * (s.root_params + s.layer_params),
        "optimizer": 8 * s.params // n,
    }
    # The step peaks in one of two phases; the components are those of the larger.
    # (1) the loss: every kept tensor on the GPU, + the layer outputs between layers / the final
    # norm's input and output, + the loss's own memory.
    if st.fused_loss:
        loss = _fused_loss_bytes(s, st, t)
    else:
        loss = t * s.vocab * 12
    at_loss = {"saved activations": t * (in_flight * kept + 3 * 2 * d), "layer working set": 0,
               "loss": loss}
    # (2) the first backward layer: the other layers' kept tensors in flight (without
    # checkpointing its own are among them), + the larger of its MLP backward (its recomputed
    # tensors and the MLP's transients) and its attention backward (what is recomputed up to
    # the attention, dout, dq/dk/dv, the residual's gradient and cuDNN's backward workspace).
    checkpointed = st.activation_checkpointing != "none"
    transient = 2 * 2 * s.act_ffn if not tiled else 2 * 2 * d  # the MLP's input gradients
    tile = min(st.mlp_tile_tokens or t, t)
    mlp = t * ((everything if checkpointed else 0) + transient) + \
        (tile * 2 * 7 * s.act_ffn if tiled else 0)
    before_attention = everything - 2 * 2 * d - (0 if tiled else 2 * 4 * s.act_ffn)
    attention = t * ((before_attention if checkpointed else 0) + 2 * q + 2 * (q + 2 * kv)
                     + 2 * d + CUDNN_BWD_WORKSPACE * s.n_heads * (s.head_dim + 1))
    at_layer = {"saved activations": t * kept * (in_flight - checkpointed),
                "layer working set": max(mlp, attention), "loss": 0}
    out.update(max(at_loss, at_layer, key=lambda ph: sum(ph.values())))
    out["attention workspace"] = t * s.n_heads * 4 * 2 + (t * (q + 2 * kv) * 4 if cp > 1 else 0)
    if cp == 1:
        comm = 0
    elif cp_method == "allgather":
        comm = cp * t * 2 * kv * 2
    else:  # two receive buffers of the widest layer's step
        comm = 2 * _ring_rows(s, tokens, t, doc_len or tokens) * 2 * kv * 2
    out["communication"] = comm
    out["total"] = max(sum(out.values()), 16 * s.params // n)  # the optimizer step's peak
    # the last layer's kept tensors stay on the GPU (launch/parallelize.py), as in_flight counts
    out["host (pinned)"] = t * (s.n_layers - 1) * kept if st.offload_activations else 0
    return out


def _ring_rows(s: Shapes, tokens: int, t: int, doc: int) -> int:
    """K/V rows a ring step receives per rank in the layer that receives most: ``t`` for a
    full layer; a windowed one (cp_rope.parallel's windowed ring) receives only the ``W - 1``
    rows before each of its two chunks of each of the ``tokens / doc`` documents."""
    docs = -(-tokens // doc)
    return max(t if w is None else min(t, docs * 2 * (w - 1)) for w in (s.windows or (None,)))


def step_seconds(s: Shapes, st: Settings, *, tokens: int, cp: int = 1, dp: int = 1,
                 doc_len: int | None = None) -> float:
    """A rough time of one step per GPU, for ranking settings: 3x the forward FLOPs, plus what
    is recomputed, plus offload copies the compute does not hide."""
    t = tokens / cp
    doc = min(doc_len or tokens, tokens)
    q = s.n_heads * s.head_dim
    dense = 2 * s.n_layers * s.active_layer_params * t  # a MoE token: its experts only
    mlp = 2 * s.n_layers * 3 * s.dim * s.act_ffn * t
    # QK^T and PV over the (query, key) pairs each layer's causal window sees
    pairs = sum(int(causal_pairs([doc], w)[0]) for w in (s.windows or (None,) * s.n_layers))
    attn = 4 * t * q * pairs / doc
    flops = 3 * (dense + attn + 2 * s.vocab * s.dim * t)
    flops += {"none": 0, "selective": dense, "full": dense + attn}[st.activation_checkpointing]
    # the tiled MLP's own recomputation in backward, but for selective + offload, which keeps
    # its output: then the layer's recomputation (counted in dense above) skips it instead
    if st.mlp_tile_tokens and not (st.activation_checkpointing == "selective"
                                   and st.offload_activations):
        flops += mlp
    compute = flops / ASSUMED_FLOPS
    if st.offload_activations:
        kept, _ = _per_token_layer(s, st.activation_checkpointing, st.mlp_tile_tokens > 0, True)
        copy = 2 * (s.n_layers - 1) * kept * t / HOST_BW  # the last layer is not offloaded
        compute += max(0.0, copy - 0.5 * compute) + 0.02 * compute
    return compute
