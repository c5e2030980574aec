"""The one door to transformers: the import, its version check, the supported families.

Nothing else in cp-rope imports transformers. ``import cp_rope.hf`` raises
ImportError naming the fix when transformers is missing or older than
:data:`MIN_TRANSFORMERS`.
"""

from __future__ import annotations

import re

MIN_TRANSFORMERS = "5.0"


def _check_transformers_version(version: str) -> None:
    """ImportError unless ``version`` (e.g. ``"5.24.0"``, ``"5.1.0.dev0"``) >= :data:`MIN_TRANSFORMERS`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    found = tuple(int(x) for x in match.groups()) if match else (0, 0)
    if found < tuple(int(x) for x in MIN_TRANSFORMERS.split(".")):
        raise ImportError(
            f"cp_rope.hf needs transformers>={MIN_TRANSFORMERS} (rope dicts in "
            f"config.rope_parameters, AttentionInterface); found {version}: "
            f"pip install -U 'transformers>={MIN_TRANSFORMERS}' (or pip install 'cp-rope[hf]')")


try:
    import transformers
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        "cp_rope.hf needs transformers, which is not installed: pip install 'cp-rope[hf]' "
        f"(transformers>={MIN_TRANSFORMERS})") from exc
_check_transformers_version(transformers.__version__)

from transformers import (  # noqa: E402
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedModel,
)
from transformers.models.gemma2 import modeling_gemma2  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

# model_type -> (modeling module, attention class name, rotary embedding class name)
FAMILIES = {
    "llama": (modeling_llama, "LlamaAttention", "LlamaRotaryEmbedding"),
    "mistral": (modeling_mistral, "MistralAttention", "MistralRotaryEmbedding"),
    "phi3": (modeling_phi3, "Phi3Attention", "Phi3RotaryEmbedding"),  # partial rotary
    "qwen2": (modeling_qwen2, "Qwen2Attention", "Qwen2RotaryEmbedding"),
    "qwen3": (modeling_qwen3, "Qwen3Attention", "Qwen3RotaryEmbedding"),
    # mixtures of experts: the MoE block is transformers' own (cp_rope.hf.moe: the router loss)
    "qwen3_moe": (modeling_qwen3_moe, "Qwen3MoeAttention", "Qwen3MoeRotaryEmbedding"),
    "mixtral": (modeling_mixtral, "MixtralAttention", "MixtralRotaryEmbedding"),
    # windows per layer type, sinks, YaRN, a mixture of experts (cp_rope.hf.families)
    "gpt_oss": (modeling_gpt_oss, "GptOssAttention", "GptOssRotaryEmbedding"),
    # local / global layers, query pre-scaling, sandwich norms, scaled embedding; Gemma 3:
    # a RoPE base per layer type and q/k norms (cp_rope.hf.families)
    "gemma2": (modeling_gemma2, "Gemma2Attention", "Gemma2RotaryEmbedding"),
    "gemma3_text": (modeling_gemma3, "Gemma3Attention", "Gemma3RotaryEmbedding"),
}
SUPPORTED_FAMILIES = tuple(FAMILIES)

__all__ = ["MIN_TRANSFORMERS", "FAMILIES", "SUPPORTED_FAMILIES", "AttentionInterface", "AutoConfig",
           "AutoModelForCausalLM", "PreTrainedModel", "transformers"]
