"""cp-rope: a context-parallel (CP) long-sequence training toolkit for PyTorch.

Public API (the contract: ``docs/DESIGN.md``):

* :func:`rope_cache`, :func:`apply_rotary_emb`, :func:`apply_rotary_emb_qk`:
  the token-linear THD RoPE kernel with the load-balanced CP position formula.
* :func:`global_positions`: the reference CP position formula.
* :mod:`cp_rope.parallel`: packing, zigzag CP split, CP attention, CP loss.
* :mod:`cp_rope.launch`: the trainer (torchrun entry points for long-context pretraining).
* :mod:`cp_rope.validation`: the argument checks every part uses.

The folders ``parallel/`` and ``launch/`` beside this one are installed as
``cp_rope.parallel`` and ``cp_rope.launch`` (``pyproject.toml``'s package-dir);
run from an install (``pip install -e .`` for development, which
``scripts/setup.sh`` does), never with the repository root on ``PYTHONPATH``
alone.
"""

from __future__ import annotations

import pkgutil

# A regular (non-editable) install used from the repository root: the
# checkout's cp_rope/ comes first on sys.path (the current directory) and holds
# neither parallel/ nor launch/, so also search the installed cp_rope/ for
# submodules (pkgutil's documented way for a package spread over directories;
# a no-op for an editable install or when used from elsewhere).
__path__ = pkgutil.extend_path(__path__, __name__)

from cp_rope.cache import rope_cache  # noqa: E402
from cp_rope.module import RotaryEmbedding  # noqa: E402
from cp_rope.ops import apply_rotary_emb, apply_rotary_emb_qk  # noqa: E402
from cp_rope.positions import global_positions  # noqa: E402

__all__ = ["global_positions", "rope_cache", "apply_rotary_emb", "apply_rotary_emb_qk",
           "RotaryEmbedding"]
__version__ = "0.1.0"
