"""Oracles for the transformers families of cp_rope.hf: tiny configs, the unpatched model run
document by document (transformers' SDPA attention in float64), and the router
load-balancing loss in float64.

transformers' own ``load_balancing_loss_func`` accumulates in float32 even for float64
logits, so :func:`load_balancing_oracle` transcribes it with float64 accumulators (and
``test_hf_moe`` checks the transcription against transformers' function at float32
tolerance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cp_rope.hf as H

transformers = H.transformers
V = 67
DOC_LENS = (5, 13, 1, 8, 3, 6)  # odd lengths: zigzag padding at every cp size

_COMMON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
               vocab_size=V, max_position_embeddings=128, attention_dropout=0.0,
               attn_implementation="sdpa", experts_implementation="eager")
MOE_FAMILIES = {
    # one dense layer (mlp_only_layers) and one MoE layer; yarn RoPE
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        intermediate_size=40, moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2,
        head_dim=8, mlp_only_layers=[0], norm_topk_prob=True, output_router_logits=True,
        router_aux_loss_coef=0.5, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32,
                                                   "rope_theta": 10000.0})),
    "mixtral": ("MixtralConfig", dict(
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.5, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def family_config(family: str, **over):
    """A tiny config of ``family`` (random weights come from ``from_config``)."""
    name, kw = MOE_FAMILIES[family]
    transformers.logging.set_verbosity_error()
    return getattr(transformers, name)(**{**_COMMON, **kw, **over})


def family_model(family: str, seed: int = 0, dtype=torch.float64, **over):
    """A tiny random model of ``family`` (seeded), in ``dtype``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, **over))
    with torch.no_grad():  # routers start at zero in transformers' init: give them a spread
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0.0, 0.5)
    return model.to(dtype)


def docs(seed: int = 1, lens=DOC_LENS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lens]


def load_balancing_oracle(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (no mask) with float64 accumulators."""
    counts = torch.zeros(num_experts, dtype=torch.float64)
    probs = torch.zeros(num_experts, dtype=torch.float64)
    rows = 0
    for x in router_logits:
        p = torch.softmax(x.double(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.bincount(chosen, minlength=num_experts).double()
        probs = probs + p.sum(0)
        rows += x.shape[0]
    return (counts / rows * probs / rows).sum() * num_experts


def per_document_reference(model, documents, coef: float | None = None):
    """The unpatched model on each document alone: (concatenated logits, the router loss of
    all documents' rows or None, the parameter gradients of mean CE + coef * router loss)."""
    model.zero_grad(set_to_none=True)
    outs = [model(input_ids=d[None], output_router_logits=coef is not None) for d in documents]
    logits = [o.logits[0] for o in outs]
    n = sum(len(d) - 1 for d in documents)
    loss = sum(F.cross_entropy(x[:-1], d[1:], reduction="sum")
               for x, d in zip(logits, documents, strict=True)) / n
    aux = None
    if coef is not None:
        layers = zip(*[o.router_logits for o in outs], strict=True)
        cfg = model.config
        aux = load_balancing_oracle([torch.cat(ls) for ls in layers], cfg.num_experts,
                                    cfg.num_experts_per_tok)
        loss = loss + coef * aux
    loss.backward()
    return (torch.cat(logits).detach(), None if aux is None else aux.detach(),
            {k: p.grad.clone() for k, p in model.named_parameters()})
