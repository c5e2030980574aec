"""cp_rope.parallel: packing, the zigzag CP split, CP attention and the CP-aware loss.

Names are resolved lazily (PEP 562) so that importing one part (say, the
sharding helpers in a DataLoader worker) does not import the others.
"""

from __future__ import annotations

import importlib

if __name__ != "cp_rope.parallel":
    # This folder is installed as cp_rope.parallel (pyproject.toml's package-dir). Imported
    # as the top-level "parallel" it would be a second copy with its own classes.
    raise ImportError(
        f"{__name__!r} is the folder of cp_rope.parallel: import cp_rope.parallel (after "
        f"`pip install -e .` or scripts/setup.sh), never the top-level name 'parallel'")

_EXPORTS = {
    # the data pipeline
    "PackedBatch": "batch",
    "PackingCollator": "collator",
    "TokenBudgetBatchSampler": "sampler",
    "SpanDataset": "sampler",
    "pack_iterable": "streaming",
    "PackedIterableDataset": "streaming",
    # zigzag CP split
    "cp_shard_indices": "sharding",
    "rank_major_index": "sharding",
    "shard_tensor": "sharding",
    "shard_batch": "sharding",
    "unshard": "sharding",
    "local_cu_seqlens": "sharding",
    # per-document placement (short documents whole on one rank)
    "place_documents": "placement",
    "DocumentPlacement": "placement",
    "default_split_threshold": "placement",
    "per_document_attention": "attention",
    "PerDocumentPlan": "per_document",
    # CP attention: one plan per batch, one door
    "attention_plan": "attention",
    "context_parallel_attention": "attention",
    "CPAttentionPlan": "plan",
    "check_plan": "plan_checks",
    # the one list of each choice
    "METHODS": "choices",
    "BACKENDS": "choices",
    "backend_unavailable": "_blocks",
    "PLACEMENTS": "choices",
    "LOSS_IMPLS": "choices",
    "comm_volume": "ulysses",
    # loss
    "cp_cross_entropy": "loss",
    # start-up parity check of the configured CP stack (module _self_test: the function
    # must not be shadowed by a submodule of the same name)
    "self_test": "_self_test",
    "SelfTestError": "_self_test",
    "cp_linear_cross_entropy": "loss",
    # sequence-tiled MLP (module _tiled_mlp: not shadowed by a submodule of the same name)
    "tiled_mlp": "_tiled_mlp",
    # process groups / DeviceMesh
    "ParallelDims": "mesh",
    # cross-rank agreement before data moves (module _agree)
    "agree_across_ranks": "_agree",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
