"""CPAttentionPlan and block-backend selection on the CPU (no process group needed).

* A plan used with other tensors, flags, a changed batch or another group raises
  ValueError naming ``plan`` (never a silent wrong answer).
* ``CPAttentionPlan.simulated`` (one rank of a cp_size-C group, loopback exchanges) runs
  the ring and all-gather blocks of that rank.
* Backend selection: ``auto`` picks ``cudnn`` on CUDA when the cuDNN frontend is usable,
  for any number of documents, and what it picked before otherwise; an explicit
  ``backend="cudnn"`` without the package names the install command. Only the
  availability probes are monkeypatched (the numerics run on the GPU tests).
* The frontend's import / version check in ``_compat``.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref

import pytest
import torch
from attention_utils import naive_attention, naive_lse
from utils import assert_close

from cp_rope.parallel import CPAttentionPlan, _blocks, _compat, context_parallel_attention

F64 = {"atol": 1e-10, "rtol": 0.0}


def _case(lens, hq=4, hkv=2, d=16, extra=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1]) + extra
    q, k, v = (torch.randn(n, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    return cu, q, k, v


def _plan(cu, q, k, **kw):
    return CPAttentionPlan.build(cu, int((cu[1:] - cu[:-1]).max()), q_heads=q.shape[1],
                                 kv_heads=k.shape[1], head_dim=q.shape[2], dtype=q.dtype,
                                 device=q.device, n_tokens=q.shape[0], **kw)


def test_plan_result_and_lse_match_the_oracle():
    """cp_size 1 with a plan: output and merged LSE against float64 naive attention."""
    cu, q, k, v = _case([5, 0, 1, 17], extra=3)
    for causal in (True, False):
        plan = _plan(cu, q, k, causal=causal)
        out, lse = context_parallel_attention(q, k, v, None, None, causal=causal, plan=plan,
                                              return_lse=True, backend="reference")
        assert_close(out, naive_attention(q, k, v, cu, causal, 0.25), **F64, name="out")
        assert_close(lse, naive_lse(q, k, cu, causal, 0.25), **F64, name="lse")
        assert lse.dtype == torch.float64 and lse.shape == (4, q.shape[0])


def test_plan_misuse_names_plan():
    cu, q, k, v = _case([6, 10], extra=2)
    plan = _plan(cu, q, k)
    cpa = context_parallel_attention
    with pytest.raises(ValueError, match="plan: built for q"):
        cpa(q[:-1], k[:-1], v[:-1], None, None, plan=plan)
    with pytest.raises(ValueError, match="plan: built for q"):
        cpa(q.float(), k.float(), v.float(), None, None, plan=plan)
    with pytest.raises(ValueError, match="plan: built for q"):
        cpa(q[:, :2], k, v, None, None, plan=plan)
    with pytest.raises(ValueError, match="plan: cu_seqlens is not the plan's"):
        cpa(q, k, v, cu.clone(), None, plan=plan)  # a new batch's tensor, even if equal
    with pytest.raises(ValueError, match="plan: built for max_seqlen 10"):
        cpa(q, k, v, None, 12, plan=plan)
    with pytest.raises(ValueError, match="plan: built for causal=True"):
        cpa(q, k, v, None, None, plan=plan, causal=False)
    with pytest.raises(ValueError, match="plan: built for causal=True, method='ring'"):
        cpa(q, k, v, None, None, plan=plan, method="allgather")
    with pytest.raises(ValueError, match="plan: seq_lens"):
        cpa(q, k, v, None, None, plan=_plan(cu, q, k, causal=False), causal=False,
            seq_lens=torch.tensor([6, 10]))
    with pytest.raises(TypeError, match="plan must be a CPAttentionPlan"):
        cpa(q, k, v, cu, 10, plan="plan")
    # the plan's own cu_seqlens / max_seqlen are accepted
    assert torch.equal(cpa(q, k, v, plan.cu_seqlens, plan.max_seqlen, plan=plan),
                       cpa(q, k, v, cu, 10))


def test_plan_build_errors():
    cu, q, k, _ = _case([6, 10])
    kw = dict(q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float64, device="cpu")
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        CPAttentionPlan.build(cu.long(), 10, **kw)
    with pytest.raises(ValueError, match="max_seqlen = 8 is below"):
        CPAttentionPlan.build(cu, 8, **kw)
    with pytest.raises(ValueError, match="exceeds the number of tokens"):
        CPAttentionPlan.build(cu, 10, n_tokens=15, **kw)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        CPAttentionPlan.build(cu, 10, **{**kw, "kv_heads": 3})
    with pytest.raises(TypeError, match="dtype"):
        CPAttentionPlan.build(cu, 10, **{**kw, "dtype": torch.int32})
    with pytest.raises(ValueError, match="method must be one of"):
        CPAttentionPlan.build(cu, 10, method="tree", **kw)


def test_plan_keeps_host_segments_and_keyless_rows():
    """The causal ring's second-half block at rank 0 of 2: the first-half query rows of every
    sequence see no key (keyless_rows) and every block knows its segments on the host."""
    cu = torch.tensor([0, 4, 4, 10], dtype=torch.int32)  # local lengths 4, 0, 6
    plan = CPAttentionPlan.simulated(cu, 6, cp_size=2, cp_rank=0, q_heads=2, kv_heads=1,
                                     head_dim=8, dtype=torch.float64, device="cpu")
    diag, second = plan.blocks["ring"]
    assert diag.keyless_rows is None and diag.dense == ((0, 4, 0, 4), (4, 6, 4, 6))
    assert second.keyless_rows.tolist() == [0, 1, 4, 5, 6]
    assert second.cu_q_host.tolist() == [0, 2, 4, 4, 4, 7, 10]


@pytest.mark.parametrize("method,ulysses_size", [("ring", None), ("allgather", None),
                                                 ("ulysses", None), ("hybrid", 2)])
def test_simulated_rank_runs_its_blocks(method, ulysses_size):
    """A simulated rank computes against its own K/V at every step: with one sequence whose
    K/V rows are all equal (v constant per head), every output row equals that v."""
    cp = 4
    cu = torch.tensor([0, 16], dtype=torch.int32)
    q = torch.randn(16, 4, 8, dtype=torch.float64, requires_grad=True)  # 4 heads: U <= 4
    k = torch.randn(1, 1, 8, dtype=torch.float64).expand(16, 1, 8).clone().requires_grad_()
    v = torch.randn(1, 1, 8, dtype=torch.float64).expand(16, 1, 8).clone().requires_grad_()
    for r in range(cp):
        plan = CPAttentionPlan.simulated(cu, 16, cp_size=cp, cp_rank=r, q_heads=4, kv_heads=1,
                                         head_dim=8, dtype=torch.float64, device="cpu",
                                         method=method, ulysses_size=ulysses_size)
        assert (plan.cp_size, plan.cp_rank, plan.group) == (cp, r, None)
        out = context_parallel_attention(q, k, v, None, None, plan=plan, method=method,
                                         ulysses_size=ulysses_size)
        assert_close(out, v.detach().expand(16, 4, 8), **F64, name=f"rank {r}")
        out.sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


# --------------------------------------------------------------------------- selection

class _FakeQ:
    """What backend selection reads of q: device, dtype, shape (no CUDA tensor needed)."""

    def __init__(self, dtype=torch.bfloat16, d=128, device="cuda:0"):
        self.device, self.dtype, self.shape = torch.device(device), dtype, (8, 4, d)


@pytest.fixture
def cuda_probes(monkeypatch):
    """A CUDA sm90 machine with cuDNN 9 and no flash_attn; the frontend as the test says."""
    state = {"frontend": None, "cap": (9, 0)}
    monkeypatch.setattr(_compat, "cudnn_frontend_unavailable", lambda: state["frontend"])
    monkeypatch.setattr(_compat, "flash_attn_available", lambda: False)
    monkeypatch.setattr(_compat, "fa4_unavailable", lambda: "flash-attn-4 absent (the probe)")
    monkeypatch.setattr(_compat, "torch_cudnn_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["cap"])
    return state


def test_auto_picks_cudnn_for_any_number_of_documents(cuda_probes):
    for n_seqs in (0, 1, 64, 512):
        assert _blocks.get_backend("auto", _FakeQ(), n_seqs).name == "cudnn"
    assert _blocks.get_backend("auto", _FakeQ(torch.float16, d=64), 3).name == "cudnn"


def test_auto_without_cudnn_picks_what_it_did(cuda_probes):
    cuda_probes["frontend"] = "needs the nvidia-cudnn-frontend package, which is not importable"
    assert _blocks.get_backend("auto", _FakeQ(), 1).name == "torch_cudnn"
    assert _blocks.get_backend("auto", _FakeQ(), 5).name == "torch_flash"
    with pytest.raises(ValueError, match=r"backend='cudnn' needs the nvidia-cudnn-frontend.*"
                                         r"pip install --no-deps \"nvidia-cudnn-frontend>=1.32\""):
        _blocks.get_backend("cudnn", _FakeQ(), 5)


def test_cudnn_refuses_what_it_cannot_run(cuda_probes):
    assert _blocks.get_backend("auto", _FakeQ(d=256), 5).name == "torch_flash"
    with pytest.raises(ValueError, match=r"backend='cudnn' supports head_dim <= 128.*got 256"):
        _blocks.get_backend("cudnn", _FakeQ(d=256), 5)
    with pytest.raises(ValueError, match=r"backend='cudnn' supports float16/bfloat16"):
        _blocks.get_backend("cudnn", _FakeQ(torch.float32), 5)
    assert _blocks.get_backend("auto", _FakeQ(torch.float32), 5).name == "reference"
    with pytest.raises(ValueError, match=r"backend='cudnn' needs CUDA tensors"):
        _blocks.get_backend("cudnn", _FakeQ(device="cpu"), 5)
    cuda_probes["cap"] = (7, 5)
    with pytest.raises(ValueError, match=r"backend='cudnn' needs an sm80\+ GPU"):
        _blocks.get_backend("cudnn", _FakeQ(), 5)
    assert _blocks.get_backend("auto", _FakeQ(), 5).name == "torch_flash"


def test_cudnn_frontend_import_and_version_check(monkeypatch):
    real = _compat._cudnn_frontend
    try:
        _compat._cudnn_frontend.cache_clear()
        monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(__version__="1.10.0"))
        why = _compat.cudnn_frontend_unavailable()
        assert why is not None and ">= 1.32" in why and "found 1.10.0" in why, why
        with pytest.raises(RuntimeError, match=r"backend='cudnn' .*found 1\.10\.0.*pip install"):
            _compat.cudnn_thd_fwd(None, None, None, None, None, 64, 64, True, 1.0)
        _compat._cudnn_frontend.cache_clear()
        monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
        assert "not importable" in _compat.cudnn_frontend_unavailable()
    finally:
        real.cache_clear()


class _CyclicFrontend:
    """cuDNN frontend 1.32's ops as far as memory goes: a graph build (the first call of a
    shape) catches a declined heuristic mode's exception and keeps it in a local, a reference
    cycle (frame -> exception -> traceback -> frame, and on to the callers' frames) that holds
    the call's locals; the build allocates enough objects to trigger automatic collections."""

    def __init__(self):
        self.built, self.workspaces, self.fail = set(), [], False

    def sdpa_fwd(self, q, k, v, scale, **kwargs):
        if self.fail:
            raise RuntimeError("cuDNN: bad graph")
        workspace = torch.empty(1 << 16)  # a local of the op's frame, as the real workspace is
        self.workspaces.append(weakref.ref(workspace))
        if tuple(q.shape) not in self.built:
            self.built.add(tuple(q.shape))
            self._build()
        return q.clone(), torch.zeros(q.shape[0], q.shape[1], 1)

    @staticmethod
    def _build():
        failure = None
        for mode in ("A", "FALLBACK"):
            try:
                if mode == "FALLBACK":
                    raise ValueError("no engine for this graph in mode FALLBACK")
            except ValueError as exc:
                failure = exc  # the frontend's pattern (cudnn/_pygraph.py _create_backend_plans)
        junk = [[i] for i in range(20000)]  # the rest of a build: tracked objects, collections
        return failure is not None and len(junk) > 0


@pytest.mark.parametrize("enabled", [True, False], ids=["gc-enabled", "gc-disabled"])
def test_cudnn_call_frees_what_a_graph_build_keeps(monkeypatch, enabled):
    """Every frontend call frees the cycle a graph build leaves as soon as it returns (measured:
    12 GiB of a layer's backward kept at 262K tokens until a collection), with a collection of
    the youngest generation only; the collector's state is restored, also when the op raises.
    Without _compat's handling the same fake keeps its workspace (checked first)."""
    fake = _CyclicFrontend()
    monkeypatch.setattr(_compat, "_cudnn_frontend", lambda: (fake, None))
    q, k, v = (torch.randn(256, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    was = gc.isenabled()
    gc.collect()
    gc.callbacks.append(count)
    try:
        (gc.enable if enabled else gc.disable)()
        fake.sdpa_fwd(q, k, v, 0.5)  # the fake itself: a build whose workspace outlives it
        assert fake.workspaces[-1]() is not None
        gc.collect()
        assert fake.workspaces[-1]() is None
        fake.built.clear()
        collections.clear()
        for s in (256, 256, 128):  # a build, a cached graph, another build
            _compat.cudnn_thd_fwd(q[:s], k[:s], v[:s], cu, cu, 156, 156, True, 0.5)
            assert fake.workspaces[-1]() is None, s
        assert collections == [0, 0, 0]  # one young-generation collection per call, no other
        assert gc.isenabled() == enabled
        fake.fail = True
        with pytest.raises(RuntimeError, match="bad graph"):
            _compat.cudnn_thd_fwd(q, k, v, cu, cu, 156, 156, True, 0.5)
        assert gc.isenabled() == enabled
    finally:
        gc.callbacks.remove(count)
        (gc.enable if was else gc.disable)()


def test_cudnn_call_pauses_collection_across_threads(monkeypatch):
    """Two threads in frontend calls at once: the collector stays paused until the last one
    leaves (no collection while the other may be inside a build), then is enabled again and
    collects once (a thread leaving first must not re-enable it, nor leave it disabled)."""
    inside, release = threading.Event(), threading.Event()

    class Ops:
        def sdpa_fwd(self, q, k, v, scale, **kwargs):
            if q.shape[0] == 2:  # the slow call, held inside the op
                inside.set()
                assert release.wait(30)
            return q.clone(), torch.zeros(q.shape[0], q.shape[1], 1)

    monkeypatch.setattr(_compat, "_cudnn_frontend", lambda: (Ops(), None))
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    cu = torch.tensor([0, 2], dtype=torch.int32)
    slow = threading.Thread(target=_compat.cudnn_thd_fwd,
                            args=(*(torch.randn(2, 1, 4) for _ in range(3)), cu, cu, 2, 2, True, 1.0))
    was = gc.isenabled()
    gc.enable()
    gc.callbacks.append(count)
    try:
        slow.start()
        assert inside.wait(30)
        assert not gc.isenabled()
        q = torch.randn(4, 1, 4)
        _compat.cudnn_thd_fwd(q, q, q, torch.tensor([0, 4], dtype=torch.int32),
                              torch.tensor([0, 4], dtype=torch.int32), 4, 4, True, 1.0)
        assert not gc.isenabled() and collections == []  # the other thread is still inside
        release.set()
        slow.join(30)
        assert not slow.is_alive() and gc.isenabled() and collections == [0]
    finally:
        release.set()
        gc.callbacks.remove(count)
        (gc.enable if was else gc.disable)()


def test_the_model_builds_one_plan_per_step(monkeypatch):
    """train_step builds the batch's plan once per step from the host batch; every layer (and
    the activation-checkpoint recompute in backward) reuses it."""
    from cp_rope.launch.config import ModelConfig
    from cp_rope.launch.model import Transformer
    from cp_rope.launch.parallelize import apply_activation_checkpointing
    from cp_rope.launch.pretrain import train_step
    from cp_rope.parallel import PackingCollator

    builds = []
    real = CPAttentionPlan.build.__func__
    monkeypatch.setattr(CPAttentionPlan, "build",
                        classmethod(lambda cls, *a, **kw: builds.append(1) or real(cls, *a, **kw)))
    cfg = ModelConfig(dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden_dim=64,
                      vocab_size=64, max_seq_len=64)
    model = Transformer(cfg)
    apply_activation_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    batch = PackingCollator(cp_size=1)([{"input_ids": torch.randint(0, 64, (n,), generator=g)}
                                        for n in (17, 23)])
    for step in range(2):
        train_step(model, batch, None, reduce_grads=False)
        assert len(builds) == step + 1, builds
    # the model takes the plan, never builds one: another batch's plan is refused, naming it
    other = PackingCollator(cp_size=1)([{"input_ids": torch.randint(0, 64, (9,), generator=g)}])
    with pytest.raises(ValueError, match=r"plan: built for a batch of 10 rows, got 42"):
        model(batch.input_ids, model.attention_plan(other))
    with pytest.raises(TypeError, match=r"plan must be the batch's attention plan"):
        model(batch.input_ids, batch.cu_seqlens)


# ------------------------------------------------------------------ issue 35: a peer's shard
def _peer_shard_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    from cp_rope.parallel import PackingCollator, attention_plan
    g = torch.Generator().manual_seed(5)
    docs = [{"input_ids": torch.randint(0, 50, (n,), generator=g)} for n in (37, 8, 3000, 1)]
    kw = dict(q_heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, group=dist.group.WORLD)
    for placement in ("zigzag", "per_document"):
        extra = {"split_threshold": 64} if placement == "per_document" else {}
        peer = PackingCollator(cp_size=2, cp_rank=1 - rank, placement=placement, **extra)(docs)
        with pytest.raises(ValueError, match=rf"source: the batch is the shard of cp_rank="
                           rf"{1 - rank}, but this is rank {rank} of the group"):
            attention_plan(peer, **kw)  # before: this rank's positions on the peer's rows
        own = PackingCollator(cp_size=2, cp_rank=rank, placement=placement, **extra)(docs)
        attention_plan(own, **kw)  # the group still agrees afterwards


def test_a_peers_shard_is_refused_naming_both_ranks():
    from dist_utils import run_distributed
    run_distributed(_peer_shard_body, 2, timeout_s=60)


# ------------------------------------------------------------------ round 5 #9: the meta device
_META = r"device='meta': the meta device holds no data"


def test_a_meta_device_is_refused_at_the_build():
    """Before: accepted; the call then failed inside torch ("Tensor.item() cannot be called on
    meta tensors")."""
    from cp_rope.parallel import attention_plan
    cu, q, k, v = _case([6, 10])
    kw = dict(q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float64)
    with pytest.raises(ValueError, match=_META):
        attention_plan(cu, 10, **kw, device="meta")
    with pytest.raises(ValueError, match=_META):
        attention_plan(cu, 10, **kw, device=torch.device("meta"), method="auto")
    with pytest.raises(ValueError, match=_META):
        CPAttentionPlan.simulated(cu, 10, cp_size=2, cp_rank=0, **kw, device="meta")
    with pytest.raises(ValueError, match=_META):  # the call builds its plan on q's device
        context_parallel_attention(q.to("meta"), k.to("meta"), v.to("meta"), cu.to("meta"), 10)


def _meta_on_one_rank_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    from cp_rope.parallel import PackingCollator, attention_plan
    docs = [{"input_ids": torch.arange(n)} for n in (3, 40, 7, 20)]
    kw = dict(q_heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, group=dist.group.WORLD,
              device="meta" if rank == 0 else "cpu")
    for placement in ("zigzag", "per_document"):
        extra = {"split_threshold": 16} if placement == "per_document" else {}
        batch = PackingCollator(cp_size=2, cp_rank=rank, placement=placement, **extra)(docs)
        want = (ValueError, _META) if rank == 0 else (
            RuntimeError, r"rank 0: ValueError: " + _META)
        with pytest.raises(want[0], match=want[1]):  # before: both built (device not agreed)
            attention_plan(batch, **kw)
        attention_plan(batch, **{**kw, "device": "cpu"})  # the group still agrees afterwards


def test_a_meta_device_on_one_rank_raises_on_every_rank():
    from dist_utils import run_distributed
    run_distributed(_meta_on_one_rank_body, 2, timeout_s=60)


# ------------------------------------------------------------------ round 5 #10: calibration
def _calibration_per_rank_body(rank: int, world: int) -> None:
    import dataclasses

    import torch.distributed as dist

    from cp_rope.parallel import PackingCollator, attention_plan
    from cp_rope.parallel._calibration import calibration_signature
    from cp_rope.parallel.calibrate import default_calibration
    docs = [list(range(n)) for n in (3, 20, 1, 31, 8)]
    batch = PackingCollator(cp_size=2, cp_rank=rank)(docs)
    kw = dict(q_heads=4, kv_heads=4, head_dim=8, dtype=torch.float64, group=dist.group.WORLD,
              method="auto")
    cal = default_calibration()
    # the same constants under another source (one file at a per-node path) agree
    same = dataclasses.replace(cal, source=f"file /node{rank}/cal.json")
    assert attention_plan(batch, **kw, calibration=same).calibration is same
    slow = dataclasses.replace(cal, a2a_gbps=1e-4)
    # before: "rank 0: method=ulysses / rank 1: method=ring", though both passed "auto"
    with pytest.raises(RuntimeError, match=r"(?s)rank 0: .*calibration=#\w+ \(shipped H200"
                                           r".*rank 1: .*calibration=#\w+ \(shipped H200") as e:
        attention_plan(batch, **kw, calibration=slow if rank == 1 else cal)
    for c in (cal, slow):  # every rank shows both
        assert f"calibration={calibration_signature(c)}" in str(e.value), str(e.value)
    assert calibration_signature(cal) != calibration_signature(slow)
    plan = attention_plan(batch, **kw, calibration=cal)  # the group still agrees afterwards
    assert plan.choice is not None


def test_a_calibration_that_differs_across_ranks_is_named():
    from dist_utils import run_distributed
    run_distributed(_calibration_per_rank_body, 2, timeout_s=60)
