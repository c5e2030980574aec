"""RotaryEmbedding's cos/sin cache: float32 whatever the module is cast to, on the inputs' device."""

from __future__ import annotations

import pytest
import torch

import cp_rope
from cp_rope import apply_rotary_emb_qk, rope_cache


def test_casts_never_reach_the_tables():
    rope = cp_rope.RotaryEmbedding(8, 256, base=10000.0)
    want_cos, want_sin = rope_cache(256, 8, 10000.0)
    for cast in (lambda m: m.bfloat16(), lambda m: m.half(), lambda m: m.double(),
                 lambda m: m.to(torch.bfloat16), lambda m: m.to("cpu", torch.float16)):
        cast(rope)
        assert rope.cos.dtype == rope.sin.dtype == torch.float32
        assert torch.equal(rope.cos, want_cos) and torch.equal(rope.sin, want_sin)
    assert not list(rope.buffers()) and not rope.state_dict()


def test_tables_on_the_inputs_device_with_the_module_cast():
    rope = cp_rope.RotaryEmbedding(8, 256).bfloat16()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(24, 4, 8, generator=gen).to(torch.bfloat16)
    k = torch.randn(24, 2, 8, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    got = rope(q, k, cu)
    cos, sin = rope_cache(256, 8)
    want = apply_rotary_emb_qk(q, k, cos, sin, cu)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_cache_moves_to_the_inputs_device_once():
    rope = cp_rope.RotaryEmbedding(8, 256).cuda()
    assert rope.cos.device.type == "cpu"  # .cuda() does not touch the cache
    q = torch.randn(24, 4, 8, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 24], dtype=torch.int32, device="cuda")
    rope(q, q.clone(), cu)
    cos = rope.cos
    assert cos.device.type == "cuda" and cos.dtype == torch.float32
    rope(q, q.clone(), cu)
    assert rope.cos is cos  # reused, not copied again
    assert torch.equal(cos.cpu(), rope_cache(256, 8)[0])


# ------------------------------------------------------------------ RotaryEmbedding's bad input (round 3)

@pytest.mark.parametrize("kw,match", [({"scaling": "linear"}, r"scaling must be a mapping"),
                                      ({"interleaved": "no"}, r"interleaved must be a bool")])
def test_rotary_embedding_argument_types(kw, match):
    from cp_rope import RotaryEmbedding
    with pytest.raises(TypeError, match=match):
        RotaryEmbedding(8, 64, **kw)


def test_rope_max_position_id_without_explicit_positions_names_them():
    """The positions come from cu_seqlens here: the error must not name start_positions."""
    from cp_rope import RotaryEmbedding
    rope = RotaryEmbedding(8, 64)
    q, k = torch.randn(12, 4, 8), torch.randn(12, 2, 8)
    with pytest.raises(ValueError, match=r"^positions \(from cu_seqlens\): position 6 exceeds "
                                         r"max_position_id \(3\)"):
        rope(q, k, torch.tensor([0, 5, 12], dtype=torch.int32), max_position_id=3)
