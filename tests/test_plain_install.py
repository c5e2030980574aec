"""A plain install runs its default job (issue 35, item 6).

``pip install cp-rope`` (no extras) then ``python -m cp_rope.launch.pretrain``: the default
corpus (the stdlib) trains a byte-level BPE with ``tokenizers``, which was not a dependency,
so the README's first command failed on a plain install. The test runs the default job (its
corpus, tokenizer, logging, report; smaller shapes for a CPU test) in a subprocess that can
import only the standard library, cp_rope and the distributions that pyproject.toml's core
``dependencies`` bring (their installed requirements, transitively): transformers,
matplotlib, tensorboard and the other extras are installed here and unimportable there.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the child: only the allowed top-level names may come from site-packages
_CHILD = r"""
import importlib.util, json, os, runpy, sys
allowed = set(json.loads(os.environ["CP_ROPE_ALLOWED_IMPORTS"]))
def installed(spec):
    where = [spec.origin or "", *(spec.submodule_search_locations or [])]
    return any(p in ("site-packages", "dist-packages") for w in where for p in str(w).split(os.sep))
class Only:
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, fullname, path=None, target=None):
        spec = self.inner.find_spec(fullname, path, target)
        if spec is not None and fullname.partition(".")[0] not in allowed and installed(spec):
            return None
        return spec
    def __getattr__(self, name):
        return getattr(self.inner, name)
sys.meta_path[:] = [Only(f) for f in sys.meta_path]
print("blocked:", [m for m in ("transformers", "matplotlib", "tensorboard")
                   if importlib.util.find_spec(m) is None], flush=True)
sys.argv = ["cp_rope.launch.pretrain", *sys.argv[1:]]
runpy.run_module("cp_rope.launch.pretrain", run_name="__main__", alter_sys=True)
"""


def _name(req: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", req.strip()).group(0).lower().replace("_", "-")


def _core(reqs: list[str]) -> list[str]:
    return [_name(r) for r in reqs if not re.search(r"extra\s*==", r)]


def core_dependencies() -> list[str]:
    """pyproject.toml's ``[project] dependencies`` (read from the file: an editable install's
    metadata may be older than the file)."""
    text = open(os.path.join(REPO, "pyproject.toml")).read()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    return _core(re.findall(r'^\s*"([^"]+)"', block, re.M))


def allowed_imports() -> list[str]:
    """Top-level import names of the core dependencies and what they require, transitively."""
    seen, todo = set(), core_dependencies()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            todo += _core(md.requires(dist) or [])
        except md.PackageNotFoundError:  # a requirement for another platform / Python
            pass
    names = {top for top, dists in md.packages_distributions().items()
             if any(_name(d) in seen for d in dists)}
    return sorted(names | {"cp_rope"})


def test_tokenizers_is_a_core_dependency():
    assert "tokenizers" in core_dependencies()


def test_the_default_job_runs_on_a_plain_install(tmp_path):
    env = dict(os.environ, CP_ROPE_ALLOWED_IMPORTS=json.dumps(allowed_imports()),
               OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the default job on a CPU: torch RoPE
    # the default corpus, tokenizer (a BPE), logging, held-out evaluation and report, with
    # CPU-test shapes (the full default takes minutes on a shared 2-core machine)
    flags = ["--steps", "2", "--max-docs", "40", "--bpe-vocab-size", "300", "--eval-docs", "2",
             "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
             "--ffn-hidden-dim", "64", "--seq-len", "128", "--tokens-per-batch", "512",
             "--out-dir", str(tmp_path / "run")]
    proc = subprocess.run([sys.executable, "-c", _CHILD, *flags], capture_output=True,
                          text=True, cwd=str(tmp_path), env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert "blocked: ['transformers', 'matplotlib', 'tensorboard']" in out, out  # honest harness
    assert proc.returncode == 0, out
    assert "trained a 300-id byte-level BPE" in out and "done: steps 1..2" in out, out
    assert "pip install matplotlib" in out, out  # no report.png, and it says why
