"""Oracles for the transformers families of cp_rope.hf: tiny configs, the unpatched model run
document by document (transformers' SDPA attention in float64), and the router
load-balancing loss in float64.

GPT-OSS and Gemma 2 have no SDPA path in transformers (sinks, soft-capping): GPT-OSS's own
eager attention takes its softmax in the input dtype (float64 here), so it is the reference;
Gemma 2's eager takes it in float32, so its reference is :func:`eager64_attention`, that
function with the softmax in the input dtype (``test_hf_families`` checks it against
transformers' at float32 tolerance).

transformers' own ``load_balancing_loss_func`` accumulates in float32 even for float64
logits, so :func:`load_balancing_oracle` transcribes it with float64 accumulators (and
``test_hf_moe`` checks the transcription against transformers' function at float32
tolerance).

Gemma's RMSNorm computes in float32 whatever its input (``x.float()``): its weight gradient is
a float32 sum over the rows, whose order differs between the packed batch and the documents
one by one (~1e-7 relative, nothing to do with CP). :func:`family_model` runs Gemma's norms on
float64 inputs with the same formula in float64 (:func:`gemma_norm64`), in the reference and
the patched model alike.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F

import cp_rope.hf as H

transformers = H.transformers
V = 67
DOC_LENS = (5, 13, 1, 8, 3, 6)  # odd lengths: zigzag padding at every cp size

_COMMON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
               vocab_size=V, max_position_embeddings=128, attention_dropout=0.0,
               attn_implementation="sdpa", experts_implementation="eager")
SLIDING = 4  # the windows of the new families' sliding layers: shorter than most documents
NEW_FAMILIES = {
    # sliding + full layers (window 4), sinks, YaRN (truncate off), 4 experts top-2
    "gpt_oss": ("GptOssConfig", dict(
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
        sliding_window=SLIDING, output_router_logits=True, router_aux_loss_coef=0.5,
        attn_implementation="eager",
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 1e4})),
    # local + global layers, query_pre_attn_scalar != head_dim, final-logit soft-cap
    "gemma2": ("Gemma2Config", dict(
        intermediate_size=40, head_dim=8, sliding_window=SLIDING, query_pre_attn_scalar=10,
        attn_logit_softcapping=None, final_logit_softcapping=3.0,
        attn_implementation="cp_rope_test_eager64",
        rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # local + global layers with their own RoPE (default 1e4 / linear 1e6), q/k norms
    "gemma3_text": ("Gemma3TextConfig", dict(
        intermediate_size=40, head_dim=8, sliding_window=SLIDING, query_pre_attn_scalar=10,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6}})),
}
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
    name, kw = {**MOE_FAMILIES, **NEW_FAMILIES}[family]
    transformers.logging.set_verbosity_error()
    # a copy: a test that edits the config (its rope_parameters dict) leaves the table alone
    return getattr(transformers, name)(**copy.deepcopy({**_COMMON, **kw, **over}))


def gemma_norm64(self, x):
    """Gemma's ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float64 for a float64 input (its own
    forward otherwise)."""
    if x.dtype != torch.float64:
        return type(self).forward(self, x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def family_model(family: str, seed: int = 0, dtype=torch.float64, **over):
    """A tiny random model of ``family`` (seeded), in ``dtype``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, **over))
    with torch.no_grad():  # routers start at zero in transformers' init: give them a spread
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight", "sinks")):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight") and family.startswith("gemma"):
                p.normal_(0.0, 0.2)  # (1 + w) norms start at w = 0
    if family.startswith("gemma"):
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.forward = types.MethodType(gemma_norm64, m)
    return model.to(dtype)


def eager64_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      softcap=None, **kwargs):
    """transformers' Gemma 2 ``eager_attention_forward`` with its softmax in the input dtype
    (transformers upcasts to float32 only): [B, Hq, T, D] q, [B, Hkv, T, D] k/v -> [B, T, Hq, D]."""
    groups = query.shape[1] // key.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    scores = query @ k.transpose(2, 3) * (module.head_dim ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # SDPA-style mask
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    elif attention_mask is not None:  # eager-style additive mask
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(1, 2).contiguous(), probs


transformers.AttentionInterface.register("cp_rope_test_eager64", eager64_attention)
_masks = transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS  # eager's additive masks
_masks.register("cp_rope_test_eager64", _masks["eager"])


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
