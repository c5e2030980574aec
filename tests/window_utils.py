"""The unsharded float64 oracle of sliding-window attention with sinks (tests only).

``window_attention(q, k, v, cu, window, sinks, scale)`` is written from the definitions,
not from cp_rope's code: per document, the causal mask ``k <= q`` and, with a window
``W``, ``q - k < W`` (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - W``);
with sinks, GPT-OSS's ``eager_attention_forward``: the sink logit is one more column of
every row's scores, the softmax is taken over it, and its column is dropped.
"""

from __future__ import annotations

import torch


def window_mask(n: int, window: int | None, device=None) -> torch.Tensor:
    """``[n, n]`` bool: query i sees key j (causal; ``i - j < window`` with a window)."""
    i = torch.arange(n, device=device)
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask &= (i[:, None] - i[None, :]) < window
    return mask


def window_attention(q, k, v, cu, window, sinks, scale):
    """``(out [T, Hq, D], lse [Hq, T])`` of causal (windowed) attention per document of
    ``cu`` (host ints), with GPT-OSS sinks ``[Hq]`` or None; autograd flows to every input.
    The LSE includes the sink term; rows past ``cu[-1]``: out 0, LSE -inf."""
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    cu = [int(x) for x in cu]
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        n = e - s
        if n == 0:
            continue
        kb, vb = k[s:e].repeat_interleave(g, 1), v[s:e].repeat_interleave(g, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], kb) * scale
        scores = scores.masked_fill(~window_mask(n, window, q.device), float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(-1, n, 1)], -1)
        p = torch.softmax(scores, -1)
        lses.append(torch.logsumexp(scores, -1))
        if sinks is not None:
            p = p[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", p, vb))
    pad = q.shape[0] - cu[-1]
    outs.append(q.new_zeros(pad, *q.shape[1:]))
    lses.append(torch.full((q.shape[1], pad), float("-inf"), dtype=q.dtype, device=q.device))
    return torch.cat(outs), torch.cat(lses, 1)


def layout_blocks(C: int, r: int, W: int, device):
    """``(query rows, [(block, key rows)])``: every block rank ``r`` of cp ``C`` runs in the
    windowed ring (keys: the local K/V, then the received compact buffers) and the windowed
    all-gather (local and gathered keys), for documents of chunks 16, 1, 0, 3, 9 rows (the
    diagonal, unmasked and bottom-right ``(0, -1)`` halo pieces, keyless and queryless filler
    segments included). For the GPU tests of the windowed blocks."""
    from cp_rope.parallel._schedule import Layout
    from cp_rope.parallel._window import window_allgather_schedule, window_ring_schedule

    lens = torch.tensor([2 * C * 16, 2 * C, 0, 2 * C * 3, 2 * C * 9])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), (lens // C).cumsum(0)])
    lay = Layout(cu, int(lens.max()) // C, int(cu[-1]), C, r, True, None, torch.device(device),
                 1, W)
    blocks = []
    for i, st in enumerate(window_ring_schedule(lay)[0]["window"]):
        blocks += [(b, st.n_recv if i else int(cu[-1])) for b in st.blocks]
    ag = window_allgather_schedule(lay, None)[0]
    blocks += [(b, int(cu[-1])) for b in ag["local"]]
    blocks += [(b, int(cu[-1]) * C) for b in ag["global"]]
    return int(cu[-1]), blocks
