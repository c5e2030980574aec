"""cp_rope.hf with sliding-window models whose documents are longer than the window.

Mistral (``sliding_window`` on every layer) and Qwen2 (``use_sliding_window`` with
``max_window_layers``: windowed and full layers mixed, from ``config.layer_types``), patched
at cp 1 in float64 on the reference backend, against the unpatched model run on each
document alone with transformers' SDPA attention in float64 (its eager path takes the
softmax in float32): per-document logits within 1e-10; Qwen2 also at cp 2 over gloo
(ring, all-gather, Ulysses).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from utils import assert_close

from cp_rope.parallel import PackingCollator, unshard

transformers = pytest.importorskip("transformers")
H = importlib.import_module("cp_rope.hf")
V = 53
LENS = (9, 1, 14, 4, 11)  # longer and shorter than the windows below


def _config(name, **over):
    transformers.logging.set_verbosity_error()
    return getattr(transformers, name)(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, vocab_size=V, max_position_embeddings=64, attention_dropout=0.0,
        attn_implementation="sdpa", rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        **over)


@pytest.mark.parametrize("name,over", [
    ("MistralConfig", {"sliding_window": 3}),
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
])
def test_sliding_window_patched_equals_unpatched_per_document(name, over):
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(name, **over)).double().eval()
    model = transformers.AutoModelForCausalLM.from_config(_config(name, **over)).double().eval()
    model.load_state_dict(ref.state_dict())
    windows = {getattr(m, "sliding_window", getattr(ref.config, "sliding_window", None))
               for m in ref.modules() if type(m).__name__.endswith("Attention")}
    if name == "Qwen2Config":  # layer 0 full, layers 1-2 windowed (max_window_layers=1)
        assert windows == {None, 4}, windows
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, V, (n,), generator=g) for n in LENS]
    with torch.no_grad():
        want = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
    batch = PackingCollator()([{"input_ids": d} for d in docs])
    cu = batch.cu_seqlens.tolist()
    for rope_kernel in (False,):  # the RoPE kernel takes no float64 (its own tests: test_hf.py)
        H.patch_model(model, backend="reference", rope_kernel=rope_kernel)
        layers = model.cp_rope_patch.layers[0]  # every layer's, so that auto weighs them
        assert len(layers) == model.config.num_hidden_layers and set(layers) == windows
        with torch.no_grad():
            got = model(**H.model_inputs(batch)).logits[0]
        got = torch.cat([got[cu[i]:cu[i] + n] for i, n in enumerate(LENS)])
        assert_close(got, want, name=f"{name} rope_kernel={rope_kernel} logits")
    # the window matters: the same model without it differs
    full = transformers.AutoModelForCausalLM.from_config(_config(name)).double().eval()
    full.load_state_dict(ref.state_dict())
    with torch.no_grad():
        nowin = torch.cat([full(input_ids=d[None]).logits[0] for d in docs])
    assert (nowin - want).abs().max() > 1e-3


def test_llama_config_sliding_window_key_runs_full_attention():
    """Round 5 #8: a Llama config.json with a sliding_window key (transformers' Llama reads
    none: full attention) built a plan for window 4, then every layer's call raised 'window=None:
    the plan was built for windows [4]'. Only Mistral, Phi-3 and Mixtral read
    config.sliding_window in their attention; the patched Llama equals the unpatched one."""
    torch.manual_seed(0)
    cfg = _config("LlamaConfig", sliding_window=4)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).double().eval()
    model = transformers.AutoModelForCausalLM.from_config(cfg).double().eval()
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, V, (n,), generator=g) for n in LENS]
    with torch.no_grad():
        want = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
    H.patch_model(model, backend="reference", rope_kernel=False)
    assert set(model.cp_rope_patch.layers[0]) == {None}
    batch = PackingCollator()([{"input_ids": d} for d in docs])
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        got = model(**H.model_inputs(batch)).logits[0]
    got = torch.cat([got[cu[i]:cu[i] + n] for i, n in enumerate(LENS)])
    assert_close(got, want, name="llama with a sliding_window key")


def _cp2_body(rank, world):
    group = dist.group.WORLD
    name, over = "Qwen2Config", {"use_sliding_window": True, "sliding_window": 5,
                                 "max_window_layers": 1}
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(name, **over)).double().eval()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, V, (n,), generator=g) for n in (23, 3, 17, 8)]
    with torch.no_grad():
        want = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
    examples = [{"input_ids": d} for d in docs]
    glob = PackingCollator(cp_size=world)(examples).cu_seqlens.tolist()
    for method in ("ring", "allgather", "ulysses"):
        model = transformers.AutoModelForCausalLM.from_config(_config(name, **over)).double()
        model.load_state_dict(ref.state_dict())
        H.patch_model(model.eval(), group=group, method=method, backend="reference",
                      rope_kernel=False)
        batch = PackingCollator(cp_size=world, cp_rank=rank)(examples)
        with torch.no_grad():
            logits = unshard(model(**H.model_inputs(batch)).logits[0], batch.cu_seqlens, group)
        got = torch.cat([logits[glob[i]:glob[i] + len(d)] for i, d in enumerate(docs)])
        assert_close(got, want, name=f"cp{world} {method} logits")


def test_sliding_window_cp2_equals_unpatched():
    """Qwen2 with windowed and full layers at cp 2 (ring, all-gather, Ulysses)."""
    run_distributed(_cp2_body, 2, timeout_s=300)
