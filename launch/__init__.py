"""cp_rope.launch: the trainer -- torchrun pretraining of a Llama-style decoder with context parallelism.

Read in this order (torchtitan's shape):

* :mod:`cp_rope.launch.pretrain`: the entry point, ``torchrun ... -m cp_rope.launch.pretrain
  --cp-size C`` (its docstring shows single- and multi-node command lines; ``--help`` lists
  every flag); ``set_up`` -> ``train_loop`` -> ``summarize``, and ``train_step`` (the batch's
  attention plan from the host batch, once, then the batch to the device, then
  ``model(input_ids, plan, labels=...)``); :mod:`cp_rope.launch.stop_flag`: SIGTERM / SIGINT
  between steps.
* :mod:`cp_rope.launch.config`: typed configs with per-field docs, presets (tiny, 125m, 1b,
  8b), ``validate`` (errors name the field).
* :mod:`cp_rope.launch.cli`: reading a config with tyro: preset < TOML/JSON file < flags;
  :mod:`cp_rope.launch.start_gate`: under torchrun every rank's parse / validate outcome is
  agreed on the rendezvous store before the process group (another rank's error printed,
  an early exit stops every rank).
* :mod:`cp_rope.launch.model`: the Llama-style decoder (cp_rope RoPE, CP attention, GQA, SwiGLU);
  ``model.attention_plan(batch)`` builds the plan it takes.
* :mod:`cp_rope.launch.parallelize`: ``parallelize(model, mesh, cfg)``: CP wiring, activation
  checkpointing, FSDP2, in that order.
* :mod:`cp_rope.launch.optim`: AdamW groups, the LR schedule, gradient reduction and clipping.
* :mod:`cp_rope.launch.data`: corpora (Python stdlib, JSONL, .txt, .bin), tokenizers, the packed loader.
* :mod:`cp_rope.launch.checkpoint`: torch.distributed.checkpoint save / resume.
* :mod:`cp_rope.launch.run_dir`: the ``--out-dir`` rules (fresh, ``--overwrite``, ``--resume``);
  :mod:`cp_rope.launch.resume_config`: the fields a ``--resume`` must keep.
* :mod:`cp_rope.launch.run_identity`: the ranks' agreement on the run (config, input contents)
  before step 1; :mod:`cp_rope.launch.run_lock`: one run per ``--out-dir``.
* :mod:`cp_rope.launch.tokenizer`: the run's tokenizer (the main job's byte-level BPE, trained
  once per run directory) and held-out split; :mod:`cp_rope.launch.evaluate`: the held-out loss.
* :mod:`cp_rope.launch.metrics`: throughput, MFU and bits-per-byte arithmetic, rank-0 logging.
* :mod:`cp_rope.launch.plot`: ``report.png`` of a run, ``python -m cp_rope.launch.plot RUN...``.
* :mod:`cp_rope.launch.plan_memory`: the memory planner (``--memory auto``, ``python -m
  cp_rope.launch.plan_memory``), over :mod:`cp_rope.launch.memory_model` (the per-GPU bytes
  by component of a setting, and its calibration) and :mod:`cp_rope.launch.memory_shapes` (a
  model's shapes: experts, per-layer windows, a transformers ``config.json``).
* :mod:`cp_rope.launch.finetune_hf`: the same trainer on a local transformers checkpoint
  (``torchrun ... -m cp_rope.launch.finetune_hf --model DIR``; :mod:`cp_rope.hf`, extra ``hf``);
  :mod:`cp_rope.launch.hf_model`: its model, ``HFCausalLM`` (the same ``attention_plan`` /
  ``forward(input_ids, plan)`` interface over a patched transformers model).
* ``slurm_pretrain.sh``: multi-node launch under SLURM.
"""

if __name__ != "cp_rope.launch":
    # This folder is installed as cp_rope.launch (pyproject.toml's package-dir). Imported
    # as the top-level "launch" it would be a second copy with its own classes.
    raise ImportError(
        f"{__name__!r} is the folder of cp_rope.launch: import cp_rope.launch (after "
        f"`pip install -e .` or scripts/setup.sh), never the top-level name 'launch'")
