"""cp-rope: a context-parallel (CP) long-sequence training toolkit for PyTorch.

Public API (see ``shared/DESIGN.md``):

* :func:`rope_cache`, :func:`apply_rotary_emb`, :func:`apply_rotary_emb_qk`:
  the token-linear THD RoPE kernel with the load-balanced CP position formula.
* :func:`global_positions`: the reference CP position formula.
* :mod:`cp_rope.parallel`: packing, zigzag CP split, CP attention, CP loss.
* :mod:`cp_rope.launch`: torchrun entry points for long-context pretraining.
"""

from __future__ import annotations

import os as _os

# The folders ``parallel/`` and ``launch/`` sit beside ``cp_rope/`` in the source
# tree and are installed as ``cp_rope.parallel`` / ``cp_rope.launch``
# (pyproject's package-dir). When this package is imported straight from a
# source checkout (repository root on sys.path, any kind of install or none),
# let the submodule search also look in the repository root so that those two
# names resolve to the same folders. Never taken in an installed copy: there
# is no pyproject.toml next to site-packages/cp_rope.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_root, "parallel", "__init__.py")
):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821

from cp_rope.cache import rope_cache  # noqa: E402
from cp_rope.module import RotaryEmbedding  # noqa: E402
from cp_rope.ops import apply_rotary_emb, apply_rotary_emb_qk  # noqa: E402
from cp_rope.positions import global_positions  # noqa: E402

__all__ = ["global_positions", "rope_cache", "apply_rotary_emb", "apply_rotary_emb_qk",
           "RotaryEmbedding"]
__version__ = "0.1.0"
