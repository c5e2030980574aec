"""Activation memory: per-layer checkpointing modes and offloading saved tensors to host memory.

Three pieces, applied to each decoder layer by :func:`wrap_layer` (which
:func:`cp_rope.launch.parallelize.apply_activation_checkpointing` calls):

* ``mode="full"``: the layer runs under :func:`torch.utils.checkpoint.checkpoint`
  (non-reentrant): only its inputs are kept, everything is recomputed in backward.
* ``mode="selective"``: the same, but the attention kernels' outputs (the
  attention output and its log-sum-exp, :data:`ATTENTION_OPS`) are kept from the
  forward and replayed in the recomputation instead of being computed again
  (:func:`selective_context`, torch's selective-checkpoint idea: a
  ``TorchDispatchMode`` pair given as ``context_fn``). Norms, projections, RoPE
  and the MLP are recomputed; attention, quadratic in the sequence, is not. With
  offload, a tiled MLP's output (``[T, d]``, to host memory) is kept too, with the RNG
  state its tiles left: its node recomputes its tiles in its own backward, so
  recomputing them with the layer would be a third forward of the MLP, for an output
  only what follows it in the layer reads (without offload it is recomputed: kept, it
  would add about half to what selective keeps on the GPU).
* ``offload=True`` (:class:`ActivationOffloader`): whatever a layer keeps for
  its backward (its inputs under checkpointing, the kept attention outputs, or
  every saved tensor without checkpointing) is copied to pinned host memory on
  a side stream (:func:`torch.autograd.graph.saved_tensors_hooks`); in backward
  the first use of layer ``i``'s tensors brings them back and starts the copy of
  layer ``i - 1``'s, so that the host-to-device copies overlap the backward of
  the layer before. torchtune's ``OffloadActivations`` and torch's ``save_on_cpu``
  are the models; this one groups by layer to prefetch. ``keep_from`` leaves the last
  layers' tensors on the device (:func:`~cp_rope.launch.parallelize.apply_activation_checkpointing`
  keeps the last layer's: backward needs them first).

Values are exact: every mode computes the same numbers as no checkpointing
(recomputation is deterministic; offloaded tensors come back bit for bit).
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode  # torch's own SAC is built on it
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from cp_rope.parallel._tiled_mlp import tiled_output_hook

__all__ = ["CHECKPOINT_MODES", "ATTENTION_OPS", "TILED_MLP_OUTPUT", "ActivationOffloader",
           "selective_context", "wrap_layer", "is_attention_op", "checkpoint_flag_argv"]

CHECKPOINT_MODES = ("none", "full", "selective")

ATTENTION_OPS = (
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "cudnn::sdpa_fwd", "flash_attn::_flash_attn_varlen_forward", "flash_attn::_flash_attn_forward",
    "cp_rope::fa4_varlen_fwd",
)
"""Operators whose outputs ``selective`` keeps (every attention forward kernel a block backend of
:mod:`cp_rope.parallel` or transformers' SDPA calls)."""

TILED_MLP_OUTPUT = "cp_rope tiled MLP output"
"""What ``selective`` with offload also keeps: a tiled MLP's output
(:func:`cp_rope.parallel.tiled_mlp`), so that the recomputation does not run its tiles (the
tiled node recomputes them in its own backward)."""


def checkpoint_flag_argv(argv: list[str]) -> list[str]:
    """``argv`` with the former boolean spellings of ``--activation-checkpointing`` rewritten:
    the flag without a value means ``full``, ``--no-activation-checkpointing`` means ``none``."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--no-activation-checkpointing":
            out += ["--activation-checkpointing", "none"]
            continue
        out.append(arg)
        if arg == "--activation-checkpointing" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("full")
    return out


def is_attention_op(func) -> bool:
    """True for an operator of :data:`ATTENTION_OPS` (an ``OpOverload``)."""
    name = getattr(getattr(func, "_schema", None), "name", None)
    return name in ATTENTION_OPS


# --------------------------------------------------------------------------- offload
class _Stored:
    """One storage's bytes in host memory (and, in backward, back on the device)."""

    __slots__ = ("host", "device", "dev", "event", "group", "handles")

    def __init__(self, host, dev, group):
        self.host, self.device, self.dev, self.event, self.group = host, None, dev, None, group
        self.handles = 0


class _Handle:
    """What autograd keeps instead of an offloaded tensor: a view description of a stored storage."""

    __slots__ = ("stored", "dtype", "size", "stride", "offset")

    def __init__(self, stored, t):
        self.stored, self.dtype = stored, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    @property
    def group(self) -> int:
        """The layer the tensor belongs to (as :attr:`_Kept.group`)."""
        return self.stored.group


class _Kept:
    """What autograd keeps for a tensor of a layer that stays on the device (``keep_from``): the
    tensor detached (the live one would close a reference cycle through its own grad_fn, which
    the garbage collector cannot break: a graph dropped without backward would leak), its
    version (autograd's in-place check, which the hooks bypass) and the layer whose unpack
    prefetches the layer before."""

    __slots__ = ("t", "group", "version")

    def __init__(self, t, group):
        self.t, self.group, self.version = t.detach(), group, t._version


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over ``t``'s whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter)


class ActivationOffloader:
    """Saved tensors of each layer in (pinned) host memory, copies on a side stream.

    Use :meth:`layer` around layer ``index``'s forward. Tensors smaller than
    ``min_bytes``, parameters (and views of them: FSDP2 re-gathers those) and
    tensors saved outside a :meth:`layer` block stay where they are. A storage
    saved several times in one layer (a tensor and its views) is copied once.

    On CUDA the device-to-host copy runs on a side stream after the work queued
    so far, and the device memory is released to the allocator only once that
    copy is done (``record_stream``); in backward, the first unpack of layer
    ``i`` waits for its copies and queues layer ``i - 1``'s (a prefetch). On
    CPU (tests) the copies are plain clones.

    Args:
        min_bytes: smallest tensor offloaded, in bytes (default 1 MiB).
        keep_from: layers of this index and above keep their tensors on the device (None:
            none). The last layers' tensors are the first that backward needs, right after the
            forward: kept, they are not copied out and back, and backward does not start by
            waiting for a copy; the first unpack of a kept layer prefetches the layer before.

    Raises: ValueError naming ``min_bytes`` or ``keep_from`` when negative.
    """

    def __init__(self, *, min_bytes: int = 1 << 20, keep_from: int | None = None):
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        if keep_from is not None and keep_from < 0:
            raise ValueError(f"keep_from must be >= 0 or None, got {keep_from}")
        self.min_bytes, self.keep_from = min_bytes, keep_from
        self._stream = None
        self._group = None
        self._pending: dict[int, list[_Stored]] = {}  # group -> stored, not yet brought back
        self._seen: dict[int, tuple[_Stored, torch.Tensor]] = {}  # storage ptr -> (stored, tensor)
        self.bytes_offloaded = 0
        """Bytes copied to the host since the last :meth:`reset_stats` (all layers)."""

    def reset_stats(self) -> None:
        self.bytes_offloaded = 0

    @contextlib.contextmanager
    def layer(self, index: int):
        """Offload what autograd saves inside the block as layer ``index``'s tensors."""
        outer, self._group = self._group, index
        if self.keep_from is None or index < self.keep_from:
            self._pending[index] = []
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            self._group = outer
            self._seen.clear()  # device tensors kept alive only while the layer runs

    def pack(self, t: torch.Tensor):
        """The saved-tensor pack hook: a :class:`_Handle` for an offloaded tensor, else ``t``."""
        if (self._group is None or t.numel() * t.element_size() < self.min_bytes
                or _is_parameter(t) or t.layout != torch.strided):
            return t
        if self.keep_from is not None and self._group >= self.keep_from:
            return _Kept(t, self._group)
        ptr = (t.device, t.untyped_storage().data_ptr())
        hit = self._seen.get(ptr)
        if hit is None:
            hit = (self._copy_out(t), t)
            self._seen[ptr] = hit  # keeps the storage alive: its address is not reused meanwhile
        stored = hit[0]
        stored.handles += 1
        return _Handle(stored, t)

    def _copy_out(self, t: torch.Tensor) -> _Stored:
        src = _as_bytes(t)
        self.bytes_offloaded += src.numel()
        if t.device.type != "cuda":
            stored = _Stored(src.clone(), t.device, self._group)
        else:
            if self._stream is None:
                self._stream = torch.cuda.Stream(t.device)
            self._stream.wait_stream(torch.cuda.current_stream(t.device))
            host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(self._stream):
                host.copy_(src, non_blocking=True)
            src.record_stream(self._stream)  # its memory is reused only after the copy
            stored = _Stored(host, t.device, self._group)
        self._pending[self._group].append(stored)
        return stored

    def _bring_back(self, group: int) -> None:
        for stored in self._pending.pop(group, ()):
            if stored.dev.type != "cuda":
                stored.device = stored.host
                continue
            with torch.cuda.stream(self._stream):
                stored.device = torch.empty(stored.host.numel(), dtype=torch.uint8,
                                            device=stored.dev)
                stored.device.copy_(stored.host, non_blocking=True)
                stored.event = torch.cuda.Event()
                stored.event.record(self._stream)

    def unpack(self, h):
        """The saved-tensor unpack hook: the tensor back on its device (prefetching the layer before)."""
        if isinstance(h, _Kept):
            if h.t._version != h.version:  # what autograd raises without the hooks
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: a {h.t.dtype} {list(h.t.shape)} tensor of layer "
                    f"{h.group} is at version {h.t._version}; expected version {h.version}")
            self._bring_back(h.group - 1)
            return h.t
        if not isinstance(h, _Handle):
            return h
        stored = h.stored
        if stored.host is None and stored.device is None:
            raise RuntimeError("offloaded activations were already used by an earlier backward: "
                               "--offload-activations does not support retain_graph=True")
        if stored.device is None:
            self._bring_back(stored.group)
        self._bring_back(stored.group - 1)  # overlaps this layer's backward
        data = stored.device
        if stored.event is not None:
            cur = torch.cuda.current_stream(stored.dev)
            cur.wait_event(stored.event)
            data.record_stream(cur)  # allocated on the side stream, read on this one
        out = torch.empty(0, dtype=h.dtype, device=stored.dev).set_(
            data.untyped_storage(), h.offset, h.size, h.stride)
        stored.handles -= 1
        if stored.handles <= 0:  # the last user: the autograd nodes hold what they need
            stored.device = stored.host = None
        return out


# --------------------------------------------------------------------------- selective
class _SelectiveMode(TorchDispatchMode):
    """One side of a selectively checkpointed layer; while active it is also the tiled MLP nodes'
    output hook (:func:`~cp_rope.parallel._tiled_mlp.tiled_output_hook`)."""

    def __init__(self, kept: deque, offloader: ActivationOffloader | None):
        super().__init__()
        self.kept, self.offloader, self._hooks, self._in_tiles = kept, offloader, [], False

    def __enter__(self):  # the tiled MLP's output is kept only with an offloader
        hook = tiled_output_hook(self._tiled_output) if self.offloader is not None else \
            contextlib.nullcontext()
        hook.__enter__()
        self._hooks.append(hook)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._hooks.pop().__exit__(None, None, None)


class _KeepAttention(_SelectiveMode):
    """Forward of a selectively checkpointed layer: keep a copy of each attention op's outputs
    and of each tiled MLP's output."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_attention_op(func) and not self._in_tiles:  # the replay skips the tiles' ops
            self.kept.append((func, tree_map(self._keep, out)))
        return out

    def _tiled_output(self, compute):
        self._in_tiles = True
        try:
            out = compute()
        finally:
            self._in_tiles = False
        # with the RNG states after the tiles: the replay skips their draws (a dropout in the
        # MLP), and a random op later in the layer must draw what it drew in forward
        self.kept.append((TILED_MLP_OUTPUT, (self._keep(out), _rng_states(out.device))))
        return out

    def _keep(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        # a private copy, made now on the compute stream: CP merging updates the first block's
        # output in place later, possibly before a side-stream copy to the host has read it
        t = t.detach().clone()
        if self.offloader is not None:
            return self.offloader.pack(t)  # a handle, or t itself when it stays on the device
        return t


class _ReplayAttention(_SelectiveMode):
    """Recomputation of a selectively checkpointed layer: attention ops and tiled MLPs return
    what was kept."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_attention_op(func):
            return func(*args, **(kwargs or {}))
        return self._replay(func)

    def _tiled_output(self, compute):
        out, (cpu, device, state) = self._replay(TILED_MLP_OUTPUT)
        torch.set_rng_state(cpu)
        if state is not None:
            getattr(torch, device.type).set_rng_state(state, device)
        return out

    def _replay(self, what):
        if not self.kept or self.kept[0][0] is not what:
            raise RuntimeError(f"selective activation checkpointing: the recomputation called {what} "
                               "where the forward had no such call (a forward that depends on "
                               "state that changed between forward and backward?)")
        _, out = self.kept.popleft()
        if self.offloader is None:
            return out
        return tree_map(self.offloader.unpack, out)  # handles back, anything else as it is


def _rng_states(device: torch.device) -> tuple:
    """(CPU RNG state, ``device``, its generator's state or None): what the tiles left."""
    mod = getattr(torch, device.type, None) if device.type != "cpu" else None
    state = mod.get_rng_state(device) if mod is not None and hasattr(mod, "get_rng_state") else None
    return torch.get_rng_state(), device, state


def selective_context(offloader: ActivationOffloader | None = None):
    """``context_fn`` for :func:`torch.utils.checkpoint.checkpoint`: a fresh (forward, recompute)
    pair of modes sharing the kept attention outputs (offloaded by ``offloader`` when given)."""
    kept: deque = deque()
    return _KeepAttention(kept, offloader), _ReplayAttention(kept, offloader)


_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


def wrap_layer(layer: nn.Module, index: int, mode: str,
               offloader: ActivationOffloader | None = None) -> None:
    """Make ``layer.forward`` run with checkpointing ``mode`` and ``offloader`` (in place).

    Works for any layer (cp_rope's ``TransformerBlock``, transformers' decoder
    layers): ``forward`` is replaced on the instance, so parameter names and
    state dicts do not change; FSDP2's hooks, registered on the module, still
    run around it. Checkpointing applies only while gradients are enabled, and then
    drops a KV cache passed to the layer (``use_cache=False``), as transformers'
    own gradient checkpointing does.

    Raises: ValueError naming ``mode`` when it is not one of :data:`CHECKPOINT_MODES`.
    """
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"mode must be one of {CHECKPOINT_MODES}, got {mode!r}")
    if mode == "none" and offloader is None:
        return
    inner = layer.forward
    context_fn = functools.partial(selective_context, offloader) if mode == "selective" else None

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with offloader.layer(index) if offloader is not None else contextlib.nullcontext():
            if mode == "none" or not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            # a KV cache would be updated again by the recomputation (transformers does the same)
            kwargs.update({k: None for k in _CACHE_KWARGS if kwargs.get(k) is not None})
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    layer.forward = forward
    layer.checkpoint_mode = mode  # for inspection (tests, logs)
