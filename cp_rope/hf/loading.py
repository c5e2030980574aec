"""Loading a supported causal LM from a local directory (never a download)."""

from __future__ import annotations

import os

import torch

from ._compat import (
    FAMILIES,
    SUPPORTED_FAMILIES,
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedModel,
)

__all__ = ["local_config", "load_causal_lm"]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def local_config(path: str):
    """The transformers config in the local directory ``path`` (never downloads).

    Raises: ValueError naming ``model`` for a path that is not a local directory
    with ``config.json``, or a model family :func:`patch_model` does not support.
    """
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model={path!r}: not a local directory with config.json (cp_rope "
                         "never downloads: fetch the checkpoint first, e.g. `hf download "
                         "ORG/NAME --local-dir DIR`, or write a config with "
                         "AutoConfig.save_pretrained(DIR) for a random init)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in FAMILIES:
        raise ValueError(f"model={path!r}: model_type {config.model_type!r} is not supported by "
                         f"cp_rope.hf (supported: {', '.join(SUPPORTED_FAMILIES)})")
    return config


def load_causal_lm(path: str, *, dtype: torch.dtype = torch.float32,
                   seed: int = 0) -> tuple[PreTrainedModel, bool]:
    """A causal LM of a supported family from a local directory; never downloads.

    Args:
        path: a directory with ``config.json`` and, optionally, weights
            (``model.safetensors`` or ``pytorch_model.bin``, sharded or not).
        dtype: the parameters' dtype (float32 master weights for training).
        seed: seeds ``torch`` before a random init (a config without weights).

    Returns: ``(model on the CPU, True if weights were loaded / False if initialised
    from the config)``; attention implementation ``"sdpa"`` until :func:`patch_model`.

    Raises: ValueError as :func:`local_config`.
    """
    config = local_config(path)
    if any(os.path.isfile(os.path.join(path, f)) for f in _WEIGHT_FILES):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                     attn_implementation="sdpa")
        return model, True
    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, dtype=dtype), False
