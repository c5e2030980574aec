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
from .families import check_sliding_window

__all__ = ["local_config", "load_causal_lm"]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


# families transformers runs without SDPA (sinks, attention soft-capping): eager until patched
_NO_SDPA = ("gemma2", "gpt_oss")

# output_loading_info keys that mean the checkpoint and its config disagree
_LOAD_PROBLEMS = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def local_config(path: str):
    """The transformers config in the local directory ``path`` (never downloads).

    Raises: ValueError naming ``model`` for a path that is not a local directory
    with ``config.json``, a ``config.json`` transformers cannot read, a model family :func:`patch_model` does not support,
    or a ``config.sliding_window`` that is not null or an int >= 1.
    """
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model={path!r}: not a local directory with config.json (cp_rope "
                         "never downloads: fetch the checkpoint first, e.g. `hf download "
                         "ORG/NAME --local-dir DIR`, or write a config with "
                         "AutoConfig.save_pretrained(DIR) for a random init)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # a damaged config.json: JSON, OSError, transformers' own errors
        raise ValueError(f"model={path!r}: config.json cannot be read as a transformers "
                         f"config: {_first_line(exc)}") from exc
    if config.model_type not in FAMILIES:
        raise ValueError(f"model={path!r}: model_type {config.model_type!r} is not supported by "
                         f"cp_rope.hf (supported: {', '.join(SUPPORTED_FAMILIES)})")
    try:
        check_sliding_window(config)
    except ValueError as exc:
        raise ValueError(f"model={path!r}: {exc}") from None
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
    from the config)``; attention implementation ``"sdpa"`` until :func:`patch_model`
    (``"eager"`` for Gemma 2 and GPT-OSS, which transformers runs without SDPA).

    Raises: ValueError as :func:`local_config`, and naming ``model`` for weight files that
    cannot be read (truncated, corrupt) or that do not match ``config.json`` (missing,
    unexpected or mismatched tensors).
    """
    config = local_config(path)
    attn = "eager" if config.model_type in _NO_SDPA else "sdpa"
    if any(os.path.isfile(os.path.join(path, f)) for f in _WEIGHT_FILES):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=dtype, attn_implementation=attn,
                output_loading_info=True)
        except Exception as exc:  # truncated / corrupt weight files, shapes that disagree
            raise ValueError(f"model={path!r}: its weights cannot be loaded "
                             f"({type(exc).__name__}: {_first_line(exc)}); check that the "
                             "weight files are complete and match config.json") from exc
        model, info = model
        bad = {k: v for k, v in info.items() if k in _LOAD_PROBLEMS and v}
        if bad:
            detail = "; ".join(f"{k}: {sorted(map(str, v))[:4]}" for k, v in bad.items())
            raise ValueError(f"model={path!r}: the weight files do not match config.json "
                             f"({detail}); a partly random model would train silently")
        return model, True
    torch.manual_seed(seed)
    config._attn_implementation = attn
    return AutoModelForCausalLM.from_config(config, dtype=dtype), False
