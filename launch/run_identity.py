"""The run identity: what every rank of a job must agree on before step 1.

Every rank of a job must train the same run: the same resolved configuration (learning
rate, clipping, warmup, steps, checkpoint / evaluation / log cadence, model shape,
tokenizer, self-test, checkpointing, fused loss, seed, ...), the same corpus and tokenizer
*contents* and the same code. Ranks started from per-node config files, relaunched with an
edited command, or reading per-node copies of a corpus can disagree; without a check one
such rank trains silently wrong (a CP forward that mixes two models) or leaves its peers
waiting in a collective until the process-group timeout.

:func:`agree_run_identity` is one collective at set-up, before any other: every rank
all-gathers its local check (:func:`~cp_rope.launch.config.validate` and the content
hashes; its error, if any) and its identity (:func:`identity_fields`), over a gloo group
with a timeout of :data:`AGREE_TIMEOUT_S` seconds, and every rank raises the same
:class:`RunIdentityError` naming each differing field with its value on each rank.

Contents (:func:`content_digests`): SHA-256 of the corpus files (the stdlib's or the
directory's, as read; a ``.jsonl`` / ``.bin`` file), of a tokenizer file and of any extra
files a trainer names (finetune_hf: the model directory's config and weights). The ranks also
agree on their ``--cp-calibration`` file (auto's choices follow it; a resume may change it). A
file above :data:`WHOLE_FILE_BYTES` is hashed from its size and :data:`SAMPLES` evenly spaced
blocks of :data:`SAMPLE_BYTES` (a full read of a 100 GB corpus on every rank would take
minutes): a different file is found, an edit between two samples is not.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from cp_rope import __version__ as CP_ROPE_VERSION

from .config import ConfigError, PretrainConfig, head_dim_of, to_dict, validate
from .data import corpus_files
from .resume_config import resume_fixed

__all__ = ["AGREE_TIMEOUT_S", "RunIdentityError", "agree_run_identity", "content_digests",
           "file_digest", "identity_fields", "run_identity", "RANK_LOCAL_FIELDS", "ENV_VARS"]

AGREE_TIMEOUT_S = 30.0
"""Seconds every rank waits for its peers at the agreement (group creation and all-gather):
the time between two ranks' arrival is the spread of their start-up (imports, hashing), a
few seconds; a peer that never comes (it failed before) ends the wait with a named error."""
WHOLE_FILE_BYTES = 256 * 2**20
"""Files up to this size (bytes) are hashed whole."""
SAMPLES, SAMPLE_BYTES = 64, 2**20
"""Larger files: their size and this many evenly spaced blocks of this many bytes."""
RANK_LOCAL_FIELDS = ("train.progress", "train.tensorboard")
"""Fields only rank 0 reads (its progress bar and TensorBoard events): not compared."""
ENV_VARS = ("CP_ROPE_BACKEND", "CP_ROPE_DEBUG", "TRITON_INTERPRET")
"""Environment variables that change what a rank computes (RoPE backend, checks, Triton's
interpreter): compared as ``env.NAME``."""


class RunIdentityError(ConfigError):
    """The ranks of a job disagree on their run (or a peer's own check failed); raised on every
    rank with the same message."""


def file_digest(path: str) -> str:
    """``"sha256:<hex>"`` of the file at ``path`` (``"sha256-sampled:<hex>"`` above
    :data:`WHOLE_FILE_BYTES`, see the module docstring). Raises OSError."""
    size = os.path.getsize(path)
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            while block := f.read(2**22):
                h.update(block)
            return "sha256:" + h.hexdigest()
        for i in range(SAMPLES):
            f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return "sha256-sampled:" + h.hexdigest()


def _files_digest(paths: list[str], where: str) -> str:
    """One digest over the files (each one's digest and its name relative to the first's
    folder); ConfigError naming ``where`` and the file when one cannot be read."""
    if len(paths) == 1:
        try:
            return file_digest(paths[0])
        except OSError as exc:
            raise ConfigError(f"{where}={paths[0]!r}: cannot be read: {exc.strerror or exc}") from None
    h = hashlib.sha256()
    root = os.path.commonpath(paths) if paths else ""
    for p in paths:
        try:
            digest = file_digest(p)
        except OSError as exc:
            raise ConfigError(f"{where} (file {p!r}): cannot be read: {exc.strerror or exc}") from None
        h.update(f"{os.path.relpath(p, root)}\0{digest}\n".encode("utf-8", "surrogateescape"))
    return f"sha256:{h.hexdigest()} ({len(paths)} files)"


def content_digests(cfg: PretrainConfig, files: dict[str, list[str]] | None = None) -> dict[str, str]:
    """Content hashes of what the run reads: ``"corpus"`` (``data.data``; the stdlib's files
    for the default), ``"tokenizer"`` (a ``data.tokenizer`` file; the BPE a run trains is
    recorded after training, :func:`cp_rope.launch.run_dir.RunStart.record_tokenizer`) and
    one entry per name of ``files`` (a trainer's own inputs, e.g. a model directory).

    Returns: ``{name: "sha256:<hex>"}``. Raises: ConfigError naming the field and the file.
    """
    d = cfg.data
    out = {"data.data": _files_digest(corpus_files(d), "data.data")}
    if d.tokenizer not in (None, "bytes", "bpe"):
        out["data.tokenizer"] = _files_digest([d.tokenizer], "data.tokenizer")
    for name, paths in (files or {}).items():
        out[name] = _files_digest(sorted(paths), name) if paths else "none"
    return out


def identity_fields(cfg: PretrainConfig, contents: dict[str, str],
                    extra: dict[str, dict] | None = None) -> dict[str, object]:
    """The flat identity every rank compares: ``"section.field": value`` for every field of
    ``cfg`` and of the ``extra`` sections (but :data:`RANK_LOCAL_FIELDS`),
    ``"contents.NAME"``, ``"env.NAME"`` (:data:`ENV_VARS`) and the versions of cp_rope,
    torch and Python."""
    sections = to_dict(cfg) | (extra or {})
    out: dict[str, object] = {f"{s}.{k}": v for s, fields in sections.items()
                              for k, v in fields.items() if f"{s}.{k}" not in RANK_LOCAL_FIELDS}
    out |= {f"contents.{k}": v for k, v in contents.items()}
    out |= {f"env.{k}": os.environ.get(k) for k in ENV_VARS}
    return out | {"version.cp_rope": CP_ROPE_VERSION, "version.torch": torch.__version__,
                  "version.python": sys.version.split()[0]}


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def describe_differences(views: list[dict[str, object]]) -> list[str]:
    """``"field: value (ranks 0,1) vs value (rank 2)"`` for every key whose value differs."""
    lines = []
    for key in sorted(set().union(*views)):
        values: dict[str, list[int]] = {}
        for rank, view in enumerate(views):
            values.setdefault(_short(view.get(key, "<absent>")), []).append(rank)
        if len(values) > 1:
            lines.append(f"{key}: " + " vs ".join(f"{v} ({_ranks(r)})" for v, r in values.items()))
    return lines


_AGREE_GROUPS: dict[tuple[int, float], dist.ProcessGroup] = {}


def _agree_group(timeout_s: float) -> dist.ProcessGroup:
    """One gloo group per (default group, timeout), made at the first agreement of the process
    and kept: a group made and destroyed per run desynchronised the store keys of later groups
    on torch 2.7 (a run after another in one process hung in the next gather on one rank)."""
    key = (id(dist.distributed_c10d._get_default_group()), timeout_s)
    if key not in _AGREE_GROUPS:
        _AGREE_GROUPS[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return _AGREE_GROUPS[key]


def _gather(obj: object, timeout_s: float) -> list:
    """all_gather_object over a gloo group with a ``timeout_s`` timeout (the default
    group's may be 600 s, and a NCCL one cannot carry Python objects without a device)."""
    hint = (f"a peer did not reach the run-identity check within {timeout_s:g} s (it failed "
            "before it -- see its own error -- or runs another version of cp_rope)")
    try:
        group = _agree_group(timeout_s)
        views: list = [None] * dist.get_world_size()
        dist.all_gather_object(views, obj, group=group)
    except RuntimeError as exc:  # a timed-out group is not used again
        _AGREE_GROUPS.pop((id(dist.distributed_c10d._get_default_group()), timeout_s), None)
        raise RunIdentityError(f"rank {dist.get_rank()}: {hint}: {exc}") from None
    return views


def run_identity(cfg, world_size: int) -> dict:
    """What ties a checkpoint to its run, recorded in its manifest and compared before a load:
    the :func:`~cp_rope.launch.resume_config.resume_fixed` fields of ``cfg`` (model shapes, data
    order, seed, cp_size, optimizer hyper-parameters) as ``"section.field": value``, and the
    world size. ``model.head_dim`` is recorded as features per head (0 = dim / n_heads
    resolved)."""
    now = to_dict(cfg)
    ident = {f"{s}.{n}": now[s][n] for s, names in resume_fixed(cfg).items() for n in names}
    return ident | {"model.head_dim": head_dim_of(cfg.model), "world_size": world_size}


def agree_run_identity(cfg: PretrainConfig, *, extra: dict[str, dict] | None = None,
                       files: dict[str, list[str]] | None = None,
                       check: Callable[[], None] | None = None,
                       timeout_s: float = AGREE_TIMEOUT_S) -> dict[str, str]:
    """Collective (every rank, before any other collective of the run): check ``cfg`` locally
    (:func:`~cp_rope.launch.config.validate` for this world, ``check()`` if given, the content
    hashes), then agree on the run identity (:func:`identity_fields`) with every rank.

    Args:
        cfg: this rank's config, as given to the trainer (before the tokenizer resolves it).
        extra: a trainer's own config sections (finetune_hf: ``{"hf": {...}}``), compared too.
        files: a trainer's own input files by name, hashed into the contents.
        check: more local checks (raising ConfigError).
        timeout_s: how long a rank waits for its peers.

    Returns: the content digests (:func:`content_digests`), the same on every rank.

    Raises: the rank's own ConfigError on a rank whose local check failed;
    :class:`RunIdentityError` on every other rank naming the failed rank and its error, or,
    when the checks pass, naming every field that differs, with each rank's value; or naming
    the timeout when a peer does not come.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    error, contents, ident = None, {}, {}
    try:
        validate(cfg, world)
        if check is not None:
            check()
        contents = content_digests(cfg, files)
        ident = identity_fields(cfg, contents, extra)
        if cfg.parallel.cp_calibration:  # agreed, not kept for a resume (it may change there)
            ident["contents.parallel.cp_calibration"] = _files_digest(
                [cfg.parallel.cp_calibration], "parallel.cp_calibration")
    except ConfigError as exc:
        if world == 1:
            raise
        error = exc
    if world == 1:
        return contents
    views = _gather((None if error is None else str(error), ident), timeout_s)
    if error is not None:
        raise error
    failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(views) if e is not None]
    if failed:
        raise RunIdentityError("another rank refused its configuration: " + "; ".join(failed))
    diffs = describe_differences([v for _, v in views])
    if diffs:
        raise RunIdentityError(
            f"the {world} ranks of this job disagree on their run ({len(diffs)} field"
            f"{'s' if len(diffs) > 1 else ''}): " + "; ".join(diffs) + ". Start every rank with "
            "the same flags, config file, corpus, tokenizer and cp_rope (per-node copies must be "
            "identical)")
    return contents
