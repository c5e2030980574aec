"""The supported torch range, and checkpoints on every torch of it (issue 19).

scripts/test_matrix.sh runs this file (with the trainer, checkpoint, data, HF,
RoPE-kernel and fast CP tests) in one venv per supported torch: the oldest, 2.11
(what CUDA images ship) and the newest; .ci/run runs it with the README's torch.
With ``CP_ROPE_OTHER_PYTHON`` (set by the matrix) pointing at another venv's
python, a checkpoint written by that torch is resumed under this one.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from utils import tiny_pretrain_argv

from cp_rope.launch._compat import SUPPORTED_TORCH
from cp_rope.launch.checkpoint import MANIFEST, verify_checkpoint
from cp_rope.launch.pretrain import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = tiny_pretrain_argv(seq_len=64, tokens_per_batch=256, max_docs=16)


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def test_supported_range_is_declared_once_and_holds():
    """pyproject's torch requirement is launch._compat.SUPPORTED_TORCH, the README states it, and
    the running torch is inside it."""
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        deps = re.search(r"^dependencies = \[(.*?)^\]", f.read(), re.S | re.M).group(1)
    assert re.findall(r'"torch([^";]*)"', deps) == [SUPPORTED_TORCH], deps
    with open(os.path.join(REPO, "README.md")) as f:
        assert f"torch{SUPPORTED_TORCH}" in f.read().replace(" ", "")
    oldest = _version(SUPPORTED_TORCH.removeprefix(">="))
    assert _version(torch.__version__) >= oldest, (torch.__version__, SUPPORTED_TORCH)


def _steps(summary) -> dict[int, float]:
    return dict(summary["losses"])


def test_pretrain_checkpoint_every_and_resume(tmp_path):
    """The issue's command (4 steps, --checkpoint-every 2; the tests' tiny model, of a 6-step
    schedule): both checkpoints verify and record this torch; --resume continues from step 4 and
    its losses equal an uninterrupted 6-step run's bit for bit."""
    full = main(TINY + ["--steps", "6", "--out-dir", str(tmp_path / "full"), "--no-save-final"])
    first = main(TINY + ["--steps", "6", "--stop-at-step", "4", "--checkpoint-every", "2",
                         "--out-dir", str(tmp_path / "a")])
    root = tmp_path / "a" / "checkpoints"
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004"]
    for name in os.listdir(root):
        assert verify_checkpoint(str(root / name)) is None
        with open(root / name / MANIFEST) as f:
            assert json.load(f)["torch"] == torch.__version__
    second = main(TINY + ["--steps", "6", "--out-dir", str(tmp_path / "a"), "--resume"])
    assert second["start_step"] == 4
    assert _steps(first) | _steps(second) == _steps(full)


def test_finetune_hf_qwen3_save_and_resume(tmp_path, capsys):
    """finetune_hf of a tiny local Qwen3 directory (random weights from a config): checkpoint
    every 2 steps, stop at 2, resume to 4: the same losses as 4 steps at once, and the two
    save_pretrained directories hold the same weights."""
    transformers = pytest.importorskip("transformers")
    from cp_rope.hf import load_causal_lm
    from cp_rope.launch.finetune_hf import main as finetune

    transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
                             vocab_size=320, max_position_embeddings=256,
                             ).save_pretrained(tmp_path / "model")
    here = os.path.dirname(os.path.abspath(__file__))
    texts = [open(os.path.join(here, f)).read()[:400] for f in sorted(os.listdir(here))
             if f.endswith(".py")][:12]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    common = ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "corpus.jsonl"),
              "--steps", "4", "--lr", "1e-2", "--warmup-steps", "0", "--seq-len", "64",
              "--tokens-per-batch", "128", "--log-every", "1", "--device", "cpu", "--no-progress",
              "--no-tensorboard", "--checkpoint-every", "2"]
    full = finetune(common + ["--out-dir", str(tmp_path / "full")])
    assert "cp-rope finetune_hf: world 1" in capsys.readouterr().out  # not "cp-rope pretrain"
    first = finetune(common + ["--out-dir", str(tmp_path / "split"), "--stop-at-step", "2"])
    second = finetune(common + ["--out-dir", str(tmp_path / "split"), "--resume"])
    assert first["hf_model"] is None and second["start_step"] == 2
    assert _steps(first) | _steps(second) == _steps(full)
    a, loaded_a = load_causal_lm(full["hf_model"])
    b, loaded_b = load_causal_lm(second["hf_model"])
    assert loaded_a and loaded_b
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


OTHER = os.environ.get("CP_ROPE_OTHER_PYTHON")


@pytest.mark.skipif(not OTHER, reason="needs CP_ROPE_OTHER_PYTHON: another venv's python with "
                                      "another torch (scripts/test_matrix.sh sets it)")
def test_checkpoint_of_another_torch_resumes_here(tmp_path):
    """A run saved by the other venv's torch (2 steps, checkpoint at 1 and 2) resumes here to
    step 3; the manifest names the torch that wrote it."""
    code = ("import json, torch, sys; from cp_rope.launch.pretrain import main; "
            "main(sys.argv[1:]); print('TORCH', torch.__version__)")
    out = subprocess.run([OTHER, "-c", code, *TINY, "--steps", "2", "--checkpoint-every", "1",
                          "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    other = re.search(r"^TORCH (\S+)$", out.stdout, re.M).group(1)
    with open(tmp_path / "checkpoints" / "step_00000002" / MANIFEST) as f:
        assert json.load(f)["torch"] == other
    resumed = main(TINY + ["--steps", "3", "--out-dir", str(tmp_path), "--resume"])
    assert resumed["start_step"] == 2 and sorted(resumed["losses"]) == [3]
    assert math.isfinite(resumed["losses"][3])
    print(f"resumed a torch {other} checkpoint under torch {torch.__version__}", file=sys.stderr)


def test_finetune_hf_help_without_transformers_is_one_line():
    """`python -m cp_rope.launch.finetune_hf --help` with transformers missing: the install hint
    on one line, exit status 2, no traceback (issue 19 item 4)."""
    code = ("import runpy, sys; sys.modules['transformers'] = None; sys.argv = ['finetune_hf', "
            "'--help']; runpy.run_module('cp_rope.launch.finetune_hf', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: cp_rope.hf needs transformers") and "cp-rope[hf]" in out.stderr
