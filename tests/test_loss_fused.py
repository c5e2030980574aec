"""cp_linear_cross_entropy == cp_cross_entropy(hidden @ weight.T): value and gradients, float64,
one process and CP groups of 1, 2 and 4 gloo ranks under both placements."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from utils import assert_close

from cp_rope.parallel import (
    PackingCollator,
    _loss_impl,
    cp_cross_entropy,
    cp_linear_cross_entropy,
    cp_shard_indices,
    shard_batch,
)
from cp_rope.parallel import loss as loss_module
from cp_rope.parallel.loss import auto_chunk_size, loss_impl


def _unfused(h, w, labels, group=None, softcap=None):
    z = h @ w.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return cp_cross_entropy(z, labels, group)


def _reference(h, w, labels, softcap=None):
    """The single-process mean CE in plain torch (no process group involved)."""
    z = h @ w.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if bool((labels != -100).any()):
        return F.cross_entropy(z, labels, ignore_index=-100)
    return z.sum() * 0.0


def _grads(fn, h, w, *args, **kw):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = fn(h, w, *args, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _data(t, d, v, seed, ignore_frac=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, d, generator=g, dtype=dtype)
    w = torch.randn(v, d, generator=g, dtype=dtype) * 0.5
    labels = torch.randint(0, v, (t,), generator=g)
    labels[torch.rand(t, generator=g) < ignore_frac] = -100
    return h, w, labels


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_equals_unfused_float64(chunk_size, softcap):
    h, w, labels = _data(61, 12, 29, seed=chunk_size or 0)
    got = _grads(cp_linear_cross_entropy, h, w, labels, chunk_size=chunk_size, softcap=softcap)
    ref = _grads(_unfused, h, w, labels, softcap=softcap)
    assert got[0].dtype == torch.float64
    for a, b, name in zip(got, ref, ("loss", "dhidden", "dweight"), strict=True):
        assert_close(a.reshape(-1), b.reshape(-1), name=name)


def test_tied_weight_and_no_grad_and_empty():
    # tied embeddings: the head weight is also read elsewhere; gradients add up
    h, w, labels = _data(20, 6, 11, seed=1)
    ids = torch.randint(0, 11, (20,))

    def tied(loss_fn):
        wt = w.clone().requires_grad_()
        hidden = torch.tanh(wt[ids] + h)  # "embedding" of the same weight feeds the hidden states
        loss_fn(hidden, wt, labels).backward()
        return wt.grad

    assert_close(tied(lambda a, b, c: cp_linear_cross_entropy(a, b, c, chunk_size=3)),
                 tied(_unfused), name="tied dweight")
    with torch.no_grad():  # value only
        assert_close(cp_linear_cross_entropy(h, w, labels, chunk_size=4).reshape(1),
                     _unfused(h, w, labels).reshape(1), name="no_grad loss")
    # no tokens at all, and all tokens ignored: 0 and exact zero gradients
    for hh, yy in ((h[:0], labels[:0]), (h, torch.full_like(labels, -100))):
        loss, gh, gw = _grads(cp_linear_cross_entropy, hh, w, yy, chunk_size=5)
        assert loss.item() == 0.0 and torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0
        assert gh.shape == hh.shape


def test_bfloat16_matches_float64_reference():
    h, w, labels = _data(50, 16, 37, seed=2, dtype=torch.bfloat16)
    got = _grads(cp_linear_cross_entropy, h, w, labels, chunk_size=16)
    ref = _grads(_unfused, h.double(), w.double(), labels)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    for a, b, name in zip(got, ref, ("loss", "dhidden", "dweight"), strict=True):
        assert_close(a.reshape(-1).double(), b.reshape(-1), dtype=torch.bfloat16, name=name)


def _fake_liger(h, w, y, *, ignore_index, reduction, softcap, accum_dtype):
    """Liger-Kernel's contract as cp_linear_cross_entropy calls it: the SUM of the per-token CE
    over the labels != ignore_index (its backward scales by the incoming gradient)."""
    assert reduction == "sum" and accum_dtype == torch.float32
    z = h @ w.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum")


def _liger_glue(h, w, labels, group=None, softcap=None):
    """impl="liger" with a float64 stand-in for Liger's kernel: checks the CP normalisation
    cp_rope puts around it (the kernel itself runs on CUDA only: test_cuda_* below)."""
    from unittest import mock

    with mock.patch.object(_loss_impl, "_LIGER", [(_fake_liger, "")]), \
            mock.patch.object(loss_module, "loss_impl", lambda impl, *_: impl):
        return cp_linear_cross_entropy(h, w, labels, group, softcap=softcap, impl="liger")


def test_loss_impl_choice():
    h = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert loss_impl("auto", h) == "torch" and loss_impl("torch", h) == "torch"  # CPU
    with pytest.raises(ValueError, match="impl='liger'.*CUDA"):
        loss_impl("liger", h)
    with pytest.raises(ValueError, match="impl='fast'.*--loss-impl"):
        loss_impl("fast", h)
    with pytest.raises(ValueError, match="impl=a Tensor"):  # arguments swapped: no tensor dump
        loss_impl(h, "auto")
    with pytest.raises(TypeError, match="hidden"):
        loss_impl("auto", None)
    cuda_bf16 = torch.empty(2, 3, dtype=torch.bfloat16, device="meta")
    from unittest import mock  # a CUDA bf16 tensor with liger-kernel present, as far as it asks

    with mock.patch.object(type(cuda_bf16), "is_cuda", property(lambda t: True)), \
            mock.patch.object(_loss_impl, "_LIGER", [(_fake_liger, "")]):
        assert loss_impl("auto", cuda_bf16) == "liger"
        assert loss_impl("auto", cuda_bf16, chunk_size=512) == "torch"  # its chunks: the loop
        with pytest.raises(ValueError, match="impl='liger'.*--loss-chunk-size"):
            loss_impl("liger", cuda_bf16, chunk_size=512)
        # what Liger's kernel does not cover runs the loop: no rows; dweight without dhidden
        assert loss_impl("liger", cuda_bf16[:0]) == "torch"
        w = torch.empty(5, 3, dtype=torch.bfloat16, device="meta", requires_grad=True)
        assert loss_impl("liger", cuda_bf16, weight=w) == "torch"
        assert loss_impl("liger", cuda_bf16.requires_grad_(), weight=w) == "liger"
    with mock.patch.object(type(cuda_bf16), "is_cuda", property(lambda t: True)), \
            mock.patch.object(_loss_impl, "_LIGER", [(None, "liger-kernel is not installed: "
                                                      "pip install 'cp-rope[liger]'")]):
        assert loss_impl("auto", cuda_bf16) == "torch"
        with pytest.raises(ValueError, match="not installed.*cp-rope\\[liger\\]"):
            loss_impl("liger", cuda_bf16)
    with pytest.raises(ValueError, match="impl='liger'"):  # the public door names it too
        cp_linear_cross_entropy(h, torch.zeros(5, 3, dtype=torch.bfloat16),
                                torch.tensor([0, 1]), impl="liger")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch", "liger"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cuda_bfloat16_matches_float64_reference(softcap, impl):
    """The CUDA paths (torch: bf16 matmuls, fp32 dweight accumulated by addmm's out_dtype;
    liger: Liger-Kernel's kernel, sum reduction, cp_rope's normalisation) against the float64
    CPU reference of the same bf16 inputs: normwise at least as close as the unfused bf16 loss
    (bf16 roundings differ elementwise)."""
    if impl == "liger" and _loss_impl.liger_function() is None:
        pytest.skip("liger-kernel not installed")
    h, w, labels = _data(3000, 256, 5000, seed=4, dtype=torch.bfloat16)
    chunk = {"chunk_size": 512} if impl == "torch" else {}  # Liger picks its own chunks
    got = _grads(cp_linear_cross_entropy, h.cuda(), w.cuda(), labels.cuda(), softcap=softcap,
                 impl=impl, **chunk)
    ref = _grads(_reference, h.double(), w.double(), labels, softcap=softcap)
    unfused = _grads(_unfused, h.cuda(), w.cuda(), labels.cuda(), softcap=softcap)
    for a, b, u, name in zip(got, ref, unfused, ("loss", "dhidden", "dweight"), strict=True):
        a, b, u = (t.reshape(-1).double().cpu() for t in (a, b, u))
        err, err_unfused = float((a - b).norm() / b.norm()), float((u - b).norm() / b.norm())
        assert err <= max(2 * err_unfused, 2 ** -8), (name, err, err_unfused)  # normwise


def test_second_backward_is_refused():
    h, w, labels = _data(8, 4, 5, seed=3)
    h.requires_grad_()
    loss = cp_linear_cross_entropy(h, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_auto_chunk_size():
    assert auto_chunk_size(151936) == 768 and auto_chunk_size(128256) == 1024
    assert auto_chunk_size(320) == 65536 and auto_chunk_size(10**9) == 256


@pytest.mark.parametrize("kw, exc, match", [
    ({"chunk_size": 0}, ValueError, "chunk_size.*--loss-chunk-size"),
    ({"chunk_size": 2.0}, TypeError, "chunk_size"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"weight": torch.zeros(5, 3, dtype=torch.float64)}, ValueError, "weight"),
    ({"weight": torch.zeros(5, 4, dtype=torch.float32)}, TypeError, "weight"),
    ({"weight": torch.zeros(5)}, ValueError, "weight"),
    ({"labels": torch.tensor([0, 1, 5, -100])}, ValueError, r"labels.*weight.shape\[0\]"),
    ({"hidden": torch.zeros(4, 4, dtype=torch.long)}, TypeError, "hidden"),
    ({"labels": torch.zeros(3, dtype=torch.long)}, ValueError, "labels"),
    # round 4 #4: a transposed weight was blamed on the labels (5 >= weight.shape[0] = 4)
    ({"hidden": torch.zeros(4, 5, dtype=torch.float64),
      "weight": torch.zeros(5, 6, dtype=torch.float64), "labels": torch.tensor([0, 1, 5, -100])},
     ValueError, r"weight must be \[V, d\] with d = hidden.shape\[1\] = 5, got shape \(5, 6\) "
                 r"\(transposed\?"),
    ({"softcap": True}, ValueError, "softcap=True"),  # round 4 #6 (fixed in 7c0d810)
    # round 4 #5: all on meta returned a meta "loss" (at 8f6c850: a raw .item() error)
    ({"hidden": torch.zeros(4, 4, dtype=torch.float64, device="meta"),
      "weight": torch.zeros(5, 4, dtype=torch.float64, device="meta"),
      "labels": torch.tensor([0, 1, 4, -100], device="meta")}, ValueError,
     "hidden is on the meta device"),
])
def test_bad_input_names_the_argument(kw, exc, match):
    args = {"hidden": torch.zeros(4, 4, dtype=torch.float64),
            "weight": torch.zeros(5, 4, dtype=torch.float64),
            "labels": torch.tensor([0, 1, 4, -100])}
    args.update({k: v for k, v in kw.items() if k in args})
    with pytest.raises(exc, match=match):
        cp_linear_cross_entropy(args["hidden"], args["weight"], args["labels"],
                                **{k: v for k, v in kw.items() if k not in args})


# ------------------------------------------------------------------------- CP groups
def _shards(world, placement, seed):
    """(global batch, per-rank local row indices into it or None for padding, local labels)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [37, 5, 0, 64, 9, 1, 22] if placement != "empty" else [6]
    ex = [{"input_ids": torch.randint(0, 40, (n,), generator=g)} for n in lengths]
    glob = PackingCollator(cp_size=world)(ex)
    out = []
    for r in range(world):
        if placement == "zigzag":
            idx = cp_shard_indices(glob.cu_seqlens, world, r)
            labels = shard_batch(glob, world, r).labels
            assert torch.equal(labels, glob.labels[idx])
        elif placement == "per_document":
            s = shard_batch(glob, world, r, placement="per_document", split_threshold=16)
            idx = s.placement.indices(r)
            labels = s.labels
            assert torch.equal(labels[:idx.numel()], glob.labels[idx])
        else:  # every token on the last rank, the others hold zero rows
            idx = torch.arange(glob.num_tokens) if r == world - 1 else torch.arange(0)
            labels = glob.labels[idx]
        out.append((idx, labels))
    return glob, out


def _cp_body(rank, world):
    group = dist.group.WORLD
    for placement in ("zigzag", "per_document", "empty"):
        for softcap in (None, 2.5) if placement == "zigzag" else (None,):
            glob, shards = _shards(world, placement, seed=10 + world)
            t, d, v = glob.num_tokens, 10, 40
            g = torch.Generator().manual_seed(99)
            h = torch.randn(t, d, generator=g, dtype=torch.float64)
            w = torch.randn(v, d, generator=g, dtype=torch.float64) * 0.5
            ref = _grads(_reference, h, w, glob.labels, softcap=softcap)  # one process, global
            idx, labels = shards[rank]
            n_pad = labels.numel() - idx.numel()
            local_h = torch.cat([h[idx], torch.randn(n_pad, d, generator=g, dtype=torch.float64)])
            tag = f"{placement} cp {world} rank {rank} softcap {softcap}"
            for fn, kw in ((cp_linear_cross_entropy, {"chunk_size": 8, "softcap": softcap}),
                           (_liger_glue, {"softcap": softcap}),
                           (_unfused, {"softcap": softcap})):
                loss, gh, gw = _grads(fn, local_h, w, labels, group, **kw)
                assert_close(loss.reshape(1), ref[0].reshape(1), name=f"loss {tag} {fn.__name__}")
                assert_close(gh[:idx.numel()], ref[1][idx], name=f"dhidden {tag}")
                assert torch.count_nonzero(gh[idx.numel():]) == 0, f"padding dhidden {tag}"
                dist.all_reduce(gw, group=group)  # the trainer's gradient SUM
                assert_close(gw, ref[2], name=f"dweight {tag} {fn.__name__}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_cp_group_equals_single_process(world):
    run_distributed(_cp_body, world)


def _refusal_body(rank, world):
    """One rank's bad labels under each implementation: every rank raises (none waits in a
    collective of another size: the liger path sends what the torch loop and a refusal send)."""
    h, w, labels = _data(12, 4, 7, seed=rank)
    if rank == 1:
        labels = labels[:-1]
    for fn in (cp_linear_cross_entropy, _liger_glue):
        with pytest.raises((ValueError, RuntimeError), match="labels|rank 1"):
            fn(h, w, labels, dist.group.WORLD)


def test_a_rank_refused_its_arguments_every_rank_raises():
    run_distributed(_refusal_body, 2, timeout_s=60)


# ------------------------------------------------------------------ bad input across the group and of the group (round 3)

def _loss_disagreement_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    from cp_rope.parallel import cp_cross_entropy, cp_linear_cross_entropy
    g = torch.Generator().manual_seed(7)
    h = torch.randn(6, 8, dtype=torch.float64, generator=g)
    w = torch.randn(11, 8, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 11, (6,), generator=g)

    def expect(fn, mine, other):
        with pytest.raises((ValueError, RuntimeError), match=mine if rank == 1 else other):
            fn()

    bad = labels.clone()
    if rank == 1:
        bad[0] = 11  # a label outside the vocabulary on one rank only
    # the refusing rank raises its own error, the other one names it (no wait, no gloo timeout)
    expect(lambda: cp_cross_entropy(h @ w.T, bad), r"labels must be in \[0, 11\)",
           r"cp_cross_entropy: rank 1 of the group refused its arguments")
    expect(lambda: cp_linear_cross_entropy(h, w, bad), r"labels must be in \[0, 11\)",
           r"cp_linear_cross_entropy: rank 1 of the group refused its arguments")
    expect(lambda: cp_linear_cross_entropy(h, w, labels, chunk_size=4 if rank == 0 else 0),
           r"chunk_size=0", r"rank 1 of the group refused")
    # arguments that must agree across the group: an error naming the field on every rank
    for kw, field in [({"ignore_index": -100 if rank == 0 else 0}, "ignore_index"),
                      ({"softcap": 30.0 if rank == 0 else None}, "softcap")]:
        with pytest.raises(RuntimeError, match=rf"disagree on {field}"):
            cp_linear_cross_entropy(h, w, labels, **kw)
    with pytest.raises(RuntimeError, match=r"disagree on V \(weight\.shape\[0\]\)"):
        cp_linear_cross_entropy(h, w[: 11 - rank], labels.clamp(max=9))
    with pytest.raises(RuntimeError, match=r"disagree on ignore_index"):
        cp_cross_entropy(h @ w.T, labels, ignore_index=-100 if rank == 0 else 0)
    # the group still works, and agrees with the unfused loss
    fused = cp_linear_cross_entropy(h, w, labels, group=dist.group.WORLD)
    assert torch.allclose(fused, cp_cross_entropy(h @ w.T, labels), rtol=1e-12, atol=0)


def test_loss_refused_on_one_rank_is_an_error_on_every_rank():
    from dist_utils import run_distributed
    run_distributed(_loss_disagreement_body, 2, timeout_s=30)


@pytest.mark.parametrize("which", ["cp_cross_entropy", "cp_linear_cross_entropy"])
def test_loss_group_not_a_process_group(which):
    import cp_rope.parallel as P
    h, w, labels = torch.randn(4, 8), torch.randn(5, 8), torch.randint(0, 5, (4,))
    args = (h @ w.T, labels) if which == "cp_cross_entropy" else (h, w, labels)
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed ProcessGroup or "
                                        r"None, got str 'world'"):
        getattr(P, which)(*args, group="world")


def _liger_chunk(n, vocab, hidden, c=1):
    """Liger 0.8.5's chunk size (liger_kernel/ops/fused_linear_cross_entropy.py)."""
    inc = -(-vocab // (c * hidden))
    return min(1 << (-(-n // inc) - 1).bit_length(), n)


@pytest.mark.parametrize("n,vocab,hidden", [(32768, 151936, 1024), (262144, 151936, 1024),
                                            (1048576, 151936, 1024), (65536, 32000, 4096),
                                            (4096, 151936, 1024), (65536, 128256, 4096),
                                            (16384, 32000, 4096), (100, 50, 8), (100, 16, 8)])
def test_liger_chunks_at_most_liger_chunk_tokens(n, vocab, hidden):
    """liger_chunking picks the chunk_mem_const whose chunks are the largest Liger's rule
    allows up to LIGER_CHUNK_TOKENS (brute force over every c), where that beats Liger's
    default; else no argument. A Liger without chunk_mem_const gets none."""
    def takes(*a, chunk_mem_const=1, **k):
        return None

    def old(*a, ignore_index, reduction, softcap, accum_dtype):
        return None

    cap = _loss_impl.LIGER_CHUNK_TOKENS
    kw = _loss_impl.liger_chunking(takes, n, vocab, hidden)
    default = _liger_chunk(n, vocab, hidden)
    got = _liger_chunk(n, vocab, hidden, kw.get("chunk_mem_const", 1))
    best = max(_liger_chunk(n, vocab, hidden, c) for c in range(1, -(-vocab // hidden) + 2)
               if _liger_chunk(n, vocab, hidden, c) <= max(cap, default))
    assert got == max(best, default), (default, got, best)
    assert (kw != {}) == (got > default)
    if kw:
        assert got <= cap
    assert _loss_impl.liger_chunk_tokens(n, vocab, hidden) == got  # what the planner prices
    if (n, vocab) in ((32768, 151936), (262144, 151936)):  # bench_memory's hf shapes
        assert default in (256, 2048) and got == 4096
    assert _loss_impl.liger_chunking(old, n, vocab, hidden) == {}


def test_liger_chunk_tokens_not_a_power_of_2(monkeypatch):
    """A LIGER_CHUNK_TOKENS that is not a power of 2 caps the chunks at the power of 2 below it
    (Liger's chunks are powers of 2: 3,000 would otherwise let 4,096-token chunks through)."""
    def takes(*a, chunk_mem_const=1, **k):
        return None

    monkeypatch.setattr(_loss_impl, "LIGER_CHUNK_TOKENS", 3000)
    for n, vocab, hidden in ((14492, 167563, 2552), (32768, 151936, 1024), (5000, 151936, 1024)):
        kw = _loss_impl.liger_chunking(takes, n, vocab, hidden)
        got = _liger_chunk(n, vocab, hidden, kw.get("chunk_mem_const", 1))
        assert got <= max(2048, _liger_chunk(n, vocab, hidden)), (n, vocab, hidden, got)
        assert kw and got == 2048, (n, vocab, hidden, kw, got)


def test_liger_called_with_its_chunking():
    """cp_linear_cross_entropy passes liger_chunking's arguments for its shapes to Liger."""
    from unittest import mock

    seen = []

    def fake(h, w, y, *, ignore_index, reduction, softcap, accum_dtype, chunk_mem_const=1):
        seen.append(chunk_mem_const)
        return _fake_liger(h, w, y, ignore_index=ignore_index, reduction=reduction,
                           softcap=softcap, accum_dtype=accum_dtype)

    h = torch.randn(64, 8, dtype=torch.float64)
    w = torch.randn(4096, 8, dtype=torch.float64)
    y = torch.randint(0, 4096, (64,))
    with mock.patch.object(_loss_impl, "_LIGER", [(fake, "")]), \
            mock.patch.object(loss_module, "loss_impl", lambda impl, *_: impl):
        cp_linear_cross_entropy(h, w, y, None, impl="liger")
    assert seen == [_loss_impl.liger_chunking(fake, 64, 4096, 8)["chunk_mem_const"]]
