"""cp_rope.launch: torchrun entry points for long-context pretraining.

* :mod:`cp_rope.launch.pretrain`: ``torchrun ... -m cp_rope.launch.pretrain --cp-size C``
  (its docstring shows single- and multi-node command lines; ``--help`` lists every flag).
* :mod:`cp_rope.launch.config`: typed configs, presets (tiny, 125m, 1b, 8b), argparse / TOML / JSON.
* :mod:`cp_rope.launch.model`: the Llama-style decoder (cp_rope RoPE, CP attention, GQA, SwiGLU).
* :mod:`cp_rope.launch.data`: corpora (Python stdlib, JSONL, .txt, .bin), tokenizers, the packed loader.
* :mod:`cp_rope.launch.checkpoint`: torch.distributed.checkpoint save / resume.
* :mod:`cp_rope.launch.metrics`: rank-0 logging, MFU peak table.
* ``slurm_pretrain.sh``: multi-node launch under SLURM.
"""

if __name__ != "cp_rope.launch":
    # This folder is installed as cp_rope.launch (pyproject.toml's package-dir). Imported
    # as the top-level "launch" it would be a second copy with its own classes.
    raise ImportError(
        f"{__name__!r} is the folder of cp_rope.launch: import cp_rope.launch (after "
        f"`pip install -e .` or scripts/setup.sh), never the top-level name 'launch'")
