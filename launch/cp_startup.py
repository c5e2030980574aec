"""The trainers' CP start-up steps (pretrain and finetune_hf, through ``pretrain.set_up``): the
cost model's calibration (``--cp-calibration``, loaded once and handed to the model's plans and
the auto-placement collator), the CP self-test (``--cp-self-test``), and the step log of the
auto choice, read from the step's plan (``plan.choice``).

The self-test uses its own random generator: a run's losses are bit-for-bit the same with it
on or off (``tests/test_self_test.py``).
"""

from __future__ import annotations

import time

import torch

from cp_rope.parallel import calibrate
from cp_rope.parallel._self_test import self_test
from cp_rope.parallel.cost_model import candidate_methods

from .config import ConfigError, PretrainConfig, head_dim_of

__all__ = ["cp_calibration", "cp_start_up", "log_auto_choice"]


def cp_calibration(cfg: PretrainConfig, device: torch.device) -> calibrate.Calibration | None:
    """``--cp-calibration``'s constants for this run's ``device`` (None without the flag: the
    plans use the shipped defaults). The trainer loads it once, before the data and the model,
    and passes it on: to :class:`~cp_rope.parallel.cost_model.AutoPlacement`, to the model
    (every ``attention_plan`` it builds) and to the self-test.

    Raises: ConfigError naming ``parallel.cp_calibration`` for a file that cannot be used.
    """
    path = cfg.parallel.cp_calibration
    if path is None:
        return None
    try:
        return calibrate.load_calibration(path, device)
    except calibrate.CalibrationError as exc:
        raise ConfigError(f"parallel.cp_calibration: {exc}") from exc


def cp_start_up(cfg: PretrainConfig, cp_group, cp_size: int, device: torch.device,
                dtype: torch.dtype, log, *, layers: tuple = ((None,), False),
                calibration: calibrate.Calibration | None = None) -> None:
    """Log the cost model's constants (``calibration``, :func:`cp_calibration`'s) and run the
    CP self-test on ``cp_group`` with them.

    ``log``: a callable taking one line (rank 0 prints it). ``layers``: the model's
    ``(windows, sinks)`` (its layers' attention windows, None for full ones, and whether
    they carry sink logits): the self-test runs a layer of each. Runs on every rank
    (collective over the CP group).

    Raises: :class:`~cp_rope.parallel.self_test.SelfTestError` (every rank) when the check
    fails.
    """
    p, m = cfg.parallel, cfg.model
    if calibration is not None:
        log(f"cp cost model: {calibration.source} ({calibration.device_name}, torch "
            f"{calibration.torch_version})")
    if p.cp_self_test != "on" or cp_size == 1 and "auto" not in (p.cp_method, p.cp_placement):
        return
    head_dim = head_dim_of(m)
    if p.cp_method == "auto":  # every (method, U) the chooser may pick for these heads
        methods = candidate_methods(cp_size, m.n_heads, m.n_kv_heads)
    else:
        methods = [(p.cp_method, p.ulysses_size if p.cp_method == "hybrid" else None)]
    threshold = p.cp_split_threshold
    places = ("zigzag", "per_document") if p.cp_placement == "auto" else (p.cp_placement,)
    t0 = time.perf_counter()
    worst = 0.0
    for place in places:
        for method, u in methods:
            res = self_test(cp_group if cp_size > 1 else None, method=method,
                            backend=p.attn_backend, placement=place, ulysses_size=u,
                            split_threshold=threshold, q_heads=m.n_heads,
                            kv_heads=m.n_kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                            window=list(layers[0]), sinks=layers[1], calibration=calibration)
            worst = max(worst, max(res.errors.values()))
    log(f"cp self-test: passed in {time.perf_counter() - t0:.2f} s ("
        + ", ".join(m if u is None else f"{m}(U={u})" for m, u in methods)
        + f"; {', '.join(places)}; cp {cp_size}, "
        f"{str(dtype).removeprefix('torch.')}; largest relative difference {worst:.1e})")


def log_auto_choice(write, cfg: PretrainConfig, step: int, plan) -> None:
    """Under ``--cp-method auto`` / ``--cp-placement auto``: ``write`` the cost model's pick for
    the step's batch, as its plan carries it (``plan.choice``, with the runners-up and their
    predicted times)."""
    choice = getattr(plan, "choice", None)
    if "auto" in (cfg.parallel.cp_method, cfg.parallel.cp_placement) and choice is not None:
        write(f"step {step} cp {choice.summary()}")
