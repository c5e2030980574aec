"""The one ring-communication helper of CP attention.

Each exchange sends a tuple of tensors (K and V as they are: no stacking
copy) to the next rank of the CP group and receives tensors of the same
shapes from the previous rank, in a single
``batch_isend_irecv`` (NCCL runs it as one group, so no rank can wait on a
partner that waits on it; gloo matches the point-to-point messages of a pair
in posting order, and every rank posts in the same order). The exchange is
started before the caller computes and waited for afterwards, so the next
block's communication overlaps the current block's compute. Waits use the
process group's timeout: a dead partner raises instead of hanging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["RingExchange", "Loopback", "ring_exchange", "PeerExchange"]


class RingExchange:
    """``start(xs)`` posts send(xs -> rank + 1) and recv(<- rank - 1); ``wait()`` returns the recvs."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        group = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(group, (rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (rank - 1) % self.size)
        self._works: list = []
        self._pending: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None

    def start(self, xs: tuple[torch.Tensor, ...]) -> None:
        if self._pending is not None:
            raise RuntimeError("RingExchange.start called twice without wait()")
        xs = tuple(x.contiguous() for x in xs)
        recvs = tuple(torch.empty_like(x) for x in xs)
        ops = []
        for x, recv in zip(xs, recvs, strict=True):
            ops += [dist.P2POp(dist.isend, x, self.next, self.group),
                    dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        self._works = dist.batch_isend_irecv(ops)
        self._pending = (xs, recvs)  # keep the send buffers alive until the wait

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self._pending is None:
            raise RuntimeError(f"{type(self).__name__}.wait called without start()")
        for w in self._works:
            w.wait()
        recv = self._pending[1]
        self._works, self._pending = [], None
        return recv


class Loopback:
    """The exchange of a *simulated* rank (a plan from ``CPAttentionPlan.simulated``, no
    group): ``wait()`` returns what was started, so every step computes against this rank's
    own K/V -- the same shapes and blocks as the real ring, no communication. Used to time
    one rank's share of a cp_size-C step on one GPU (``bench_cp_attention.py --simulate-cp``).
    """

    def __init__(self):
        self._pending = None

    def start(self, xs: tuple[torch.Tensor, ...]) -> None:
        if self._pending is not None:
            raise RuntimeError("Loopback.start called twice without wait()")
        self._pending = tuple(xs)

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self._pending is None:
            raise RuntimeError("Loopback.wait called without start()")
        xs, self._pending = self._pending, None
        return xs


class PeerExchange:
    """Step ``i`` of a windowed ring: ``start(i, sends, recvs, tag)`` posts send(sends ->
    rank + i) and recv(recvs <- rank - i) in one ``batch_isend_irecv`` (either side may be
    empty: nothing posted for it; the sizes come from the agreed plan, so a send is posted
    exactly where its receive is); ``offset=-1`` turns the direction around (send to rank
    - i, receive from rank + i: dK/dV going home). ``wait()`` returns ``recvs``. Messages
    carry ``tag`` (gloo matches a pair's messages by tag and order). ``group`` None: a
    simulated rank, nothing moves (the caller fills ``recvs`` itself)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        if group is not None:
            self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._works: list = []
        self._pending: tuple | None = None

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank % self.size)

    def start(self, i: int, sends: tuple, recvs: tuple, tag: int, offset: int = 1) -> None:
        if self._pending is not None:
            raise RuntimeError("PeerExchange.start called twice without wait()")
        ops, sends = [], tuple(x.contiguous() for x in sends)  # kept alive until wait()
        if self.group is not None:
            to, frm = self._peer(self.rank + offset * i), self._peer(self.rank - offset * i)
            ops += [dist.P2POp(dist.isend, x, to, self.group, tag) for x in sends]
            ops += [dist.P2POp(dist.irecv, x, frm, self.group, tag) for x in recvs]
        self._works = dist.batch_isend_irecv(ops) if ops else []
        self._pending = (sends, recvs)

    wait = RingExchange.wait  # the same pending works and receive buffers


def ring_exchange(group: dist.ProcessGroup | None) -> RingExchange | Loopback:
    """The ring exchange over ``group``; a :class:`Loopback` for a simulated rank (None)."""
    return RingExchange(group) if group is not None else Loopback()
