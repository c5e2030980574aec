"""pytest set-up shared by the whole suite.

* Without CUDA, Triton kernels run under ``TRITON_INTERPRET=1`` (set before
  any kernel module is imported), so CI on a CPU machine tests the kernel
  itself. The check does not create a CUDA context.
* ``@pytest.mark.gpu`` tests are skipped without CUDA.
* cp-rope must be installed (editable for development): a clear error otherwise.
* ``finished_run``: a one-step training run shared by the tests that damage a copy of it.
* Hypothesis: no deadlines (the Triton interpreter and process start-up are
  slow and uneven), a bounded number of examples.
"""

from __future__ import annotations

import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


try:  # cp_rope.parallel / cp_rope.launch exist only in an install (pyproject's package-dir)
    import cp_rope.launch  # noqa: F401
    import cp_rope.parallel  # noqa: F401
except ModuleNotFoundError as exc:
    raise pytest.UsageError(
        f"{exc}: install cp-rope first (bash scripts/setup.sh, or without network "
        "`pip install --no-deps --no-build-isolation -e .`); PYTHONPATH=. is not enough") from exc

try:
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, max_examples=25, print_blob=True)
    settings.register_profile("dev", deadline=None, max_examples=10)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A one-step ``pretrain`` run (the bad-input runs' size) with its checkpoint, config.json
    and metrics.jsonl, trained once per session; tests copy it before they damage it."""
    from utils import tiny_pretrain_argv

    from cp_rope.launch.pretrain import main

    out = tmp_path_factory.mktemp("finished")
    main(tiny_pretrain_argv(seq_len=64, tokens_per_batch=256, max_docs=16)
         + ["--steps", "1", "--out-dir", str(out)])
    return out


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
