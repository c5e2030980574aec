"""cp-rope: a context-parallel (CP) long-sequence training toolkit for PyTorch.

Public API (the contract: ``docs/DESIGN.md``):

* :func:`rope_cache`, :func:`apply_rotary_emb`, :func:`apply_rotary_emb_qk`:
  the token-linear THD RoPE kernel with the load-balanced CP position formula.
* :func:`global_positions`: the reference CP position formula.
* :mod:`cp_rope.parallel`: packing, zigzag CP split, CP attention, CP loss.
* :mod:`cp_rope.launch`: torchrun entry points for long-context pretraining.
"""

from __future__ import annotations

import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys

# The folders ``parallel/`` and ``launch/`` sit beside ``cp_rope/`` in the source
# tree and are installed as ``cp_rope.parallel`` / ``cp_rope.launch``
# (pyproject's package-dir). When this package is imported straight from a
# source checkout (repository root on sys.path, with any kind of install or
# none), map exactly those two names to those folders. Never taken in an
# installed copy: there is no pyproject.toml next to site-packages/cp_rope.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


class _SourceTreeFinder(_abc.MetaPathFinder):
    """``cp_rope.parallel`` -> ``<root>/parallel``, ``cp_rope.launch`` -> ``<root>/launch``."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, name = fullname.rpartition(".")
        if head != __name__ or name not in ("parallel", "launch"):
            return None
        folder = _os.path.join(_root, name)
        return _util.spec_from_file_location(fullname, _os.path.join(folder, "__init__.py"),
                                             submodule_search_locations=[folder])


if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_root, "parallel", "__init__.py")
) and not any(isinstance(f, _SourceTreeFinder) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _SourceTreeFinder())

from cp_rope.cache import rope_cache  # noqa: E402
from cp_rope.module import RotaryEmbedding  # noqa: E402
from cp_rope.ops import apply_rotary_emb, apply_rotary_emb_qk  # noqa: E402
from cp_rope.positions import global_positions  # noqa: E402

__all__ = ["global_positions", "rope_cache", "apply_rotary_emb", "apply_rotary_emb_qk",
           "RotaryEmbedding"]
__version__ = "0.1.0"
