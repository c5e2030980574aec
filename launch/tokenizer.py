"""The run's tokenizer and data split: the main job's byte-level BPE, bytes per token, held-out docs.

:func:`prepare_corpora` is what the trainer calls. ``--tokenizer`` decides:

* unset, with the default corpus (the Python stdlib): ``bpe``; unset otherwise: ``bytes``;
* ``bytes``: UTF-8 bytes as ids (256 + BOS/EOS/PAD), as before;
* ``bpe``: a byte-level BPE (GPT-2's byte-to-unicode alphabet and pre-tokenizer regex,
  HuggingFace ``tokenizers``; ``--bpe-vocab-size`` ids = 256 bytes + 2 specials +
  merges) trained **once** on the training documents (never the held-out ones),
  deterministic for a given corpus and ``--seed``, saved as ``<out-dir>/tokenizer.json``
  with ``tokenizer_meta.json`` (a SHA-256 of what it was trained on). A later run in
  the same directory (``--resume``) reuses it; a changed corpus (or seed, vocabulary
  size) retrains it, with a note. Rank 0 trains and encodes the corpus once
  (``<out-dir>/corpus_tokens.npz``, reused while corpus and tokenizer match); the other
  ranks read the result;
* a path: a local HuggingFace ``tokenizer.json``.

Bits per byte need the bytes of text each predicted token stands for:
:func:`token_byte_lengths` gives that per id (0 for special tokens), so a batch's bytes
are ``table[labels]`` summed over its labelled rows (nanoGPT/nanochat's ``token_bytes``).
A pre-tokenized ``.bin`` corpus has no such table (no bits per byte).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from .config import ConfigError, PretrainConfig
from .data import (
    Corpus,
    HFTokenizer,
    _read_texts,
    eval_doc_count,
    held_out_ids,
    load_corpus,
    load_tokenizer,
    split_corpus,
    token_byte_lengths,
)

__all__ = ["RunData", "prepare_corpora", "train_bpe", "token_byte_lengths", "tokenizer_mode",
           "BPE_SPECIALS", "BPE_SAMPLE_BYTES"]

BPE_SPECIALS = ("<|startoftext|>", "<|endoftext|>")
"""BOS and EOS of the trained BPE (ids 0 and 1; :class:`~cp_rope.launch.data.HFTokenizer` finds
them by name; PAD is EOS)."""
BPE_SAMPLE_BYTES = 2_000_000
"""Text the BPE is trained on: a ``--seed``-shuffled sample of the training documents up to this
many characters (the whole training set when smaller): 2 MB learn 4096 ids in a few seconds."""
_FILES = ("tokenizer.json", "tokenizer_meta.json", "corpus_tokens.npz")


@dataclass(slots=True)
class RunData:
    """What :func:`prepare_corpora` returns.

    Fields:
        train: the training documents.
        eval: the held-out documents (never in ``train``), or None without a split.
        token_bytes: int64 ``[vocab]`` bytes of text per id (0 for specials), or None (.bin).
        tokenizer: what the run trains on, for the banner (``"bytes"``, ``"bpe 4096 ids (path)"``).
        notes: lines for the log (a reused or retrained tokenizer).
        trained_tokenizer: the BPE's ``tokenizer.json`` the run trained or reuses, or None.
    """

    train: Corpus
    eval: Corpus | None
    token_bytes: np.ndarray | None
    tokenizer: str
    notes: list[str]
    trained_tokenizer: str | None = None


def tokenizer_mode(cfg: PretrainConfig) -> str:
    """``"bin"``, ``"bytes"``, ``"bpe"`` or ``"file"``: what ``--tokenizer`` means for this corpus."""
    d = cfg.data
    if d.data is not None and d.data.endswith(".bin"):
        return "bin"
    if d.tokenizer is None:
        return "bpe" if d.data is None else "bytes"
    return d.tokenizer if d.tokenizer in ("bytes", "bpe") else "file"


def _tokenizers():
    try:
        import tokenizers
    except ModuleNotFoundError:
        raise ConfigError("data.tokenizer='bpe' (the default for the stdlib corpus): needs the "
                          "`tokenizers` package (pip install tokenizers), or pass --tokenizer "
                          "bytes") from None
    return tokenizers


def train_bpe(texts: list[str], *, vocab_size: int, seed: int,
              sample_chars: int = BPE_SAMPLE_BYTES):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` ids learned from ``texts``.

    Ids: :data:`BPE_SPECIALS` (0, 1), the 256 byte symbols, then ``vocab_size - 258`` merges.
    Trained on a ``seed``-shuffled sample of ``texts`` of at most ``sample_chars`` characters
    (at least one text). Deterministic: the same texts, size and seed give the same file
    (``tokenizers``' trainer breaks count ties by the pair, not by hash order).

    Raises: ConfigError if ``tokenizers`` is missing or ``vocab_size < 259``.
    """
    tk = _tokenizers()
    if vocab_size < 259:
        raise ConfigError(f"data.bpe_vocab_size={vocab_size}: must be >= 259 (256 bytes + 2 "
                          "special tokens + at least one merge)")
    order = np.random.default_rng(seed).permutation(len(texts))
    sample, total = [], 0
    for i in order.tolist():
        if sample and total + len(texts[i]) > sample_chars:
            continue
        sample.append(texts[i])
        total += len(texts[i])
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BPE_SPECIALS),
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    tok.train_from_iterator(sample, trainer, length=len(sample))
    return tok


def _sha(texts: list[str], *extra) -> str:
    h = hashlib.sha256(repr(extra).encode())
    for t in texts:
        h.update(len(t).to_bytes(8, "little"))
        h.update(t.encode("utf-8", errors="surrogatepass"))
    return h.hexdigest()


def _file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _load_meta(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return {}


def _bpe_files(cfg: PretrainConfig, notes: list[str]) -> None:
    """Rank 0: make sure out_dir holds the BPE of this corpus and the corpus encoded with it."""
    out, d, seed = cfg.train.out_dir, cfg.data, cfg.train.seed
    tok_path, meta_file, cache = (os.path.join(out, f) for f in _FILES)
    os.makedirs(out, exist_ok=True)
    texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t
             for t in _read_texts(d)]
    if not texts:
        raise ConfigError(f"data.data={d.data!r}: no documents")
    if not any(texts):
        raise ConfigError(f"data.data={d.data!r}: all {len(texts)} documents are empty (no "
                          "text to train on)")
    held = set(held_out_ids(len(texts), eval_doc_count(d.eval_docs, len(texts))).tolist())
    train = [t for i, t in enumerate(texts) if i not in held]
    key = _sha(train, "bpe", d.bpe_vocab_size, seed, BPE_SAMPLE_BYTES)
    meta = _load_meta(meta_file)
    tk = _tokenizers()
    if os.path.isfile(tok_path) and meta.get("trained_on") == key:
        try:
            tok = tk.Tokenizer.from_file(tok_path)
        except Exception as exc:  # tokenizers raises plain Exception
            raise ConfigError(f"data.tokenizer: the run's {tok_path} cannot be read ({exc}); "
                              "delete it (and tokenizer_meta.json) to train a new one, or pass "
                              "--tokenizer bytes / --out-dir") from None
        if meta.get("sha256") not in (None, _file_sha(tok_path)):
            raise ConfigError(f"data.tokenizer: the run's {tok_path} changed since it was "
                              "trained (its SHA-256 is not the one tokenizer_meta.json records; "
                              "the run's checkpoints embed its ids): restore it, delete it and "
                              "tokenizer_meta.json to train it again, or pass --out-dir")
        notes.append(f"tokenizer: reusing {tok_path} (trained on this corpus)")
    else:
        if os.path.isfile(tok_path):
            notes.append(f"tokenizer: {tok_path} was trained on another corpus, seed or "
                         f"--bpe-vocab-size{'' if meta else ' (no tokenizer_meta.json)'}: "
                         "training a new one")
        tok = train_bpe(train, vocab_size=d.bpe_vocab_size, seed=seed)
        tok_text = tok.to_str()
        for path, text in ((tok_path, tok_text), (meta_file, json.dumps(
                {"trained_on": key, "vocab_size": d.bpe_vocab_size, "seed": seed,
                 "train_docs": len(train), "sample_chars": BPE_SAMPLE_BYTES,
                 "sha256": hashlib.sha256(tok_text.encode("utf-8")).hexdigest()}, indent=1))):
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
        notes.append(f"tokenizer: trained a {d.bpe_vocab_size}-id byte-level BPE on "
                     f"{len(train)} training documents -> {tok_path}")
    corpus_key = _sha(texts, _file_sha(tok_path))
    if os.path.exists(cache):
        try:
            if _read_cache(cache, corpus_key) is not None:
                return
        except ConfigError as exc:
            notes.append(f"{exc}: encoding the corpus again")
    bos, eos = (tok.token_to_id(s) for s in BPE_SPECIALS)
    dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.uint32
    docs = []  # in chunks: an Encoding object per document costs far more than its ids
    for k in range(0, len(texts), 64):
        docs += [np.array([bos, *e.ids, eos], dtype) for e in
                 tok.encode_batch_fast(texts[k:k + 64], add_special_tokens=False)]
    tokens = np.concatenate(docs)
    offsets = np.zeros(len(texts) + 1, np.int64)
    np.cumsum([d.size for d in docs], out=offsets[1:])
    with open(cache + ".tmp", "wb") as f:
        np.savez(f, key=np.array(corpus_key), tokens=tokens, offsets=offsets)
    os.replace(cache + ".tmp", cache)


def _read_cache(path: str, key: str | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The encoded corpus ``(tokens, offsets)`` of ``corpus_tokens.npz``, read whole (each
    member's CRC checked) and checked (offsets from 0, non-decreasing, ending at the token
    count); None when its key is not ``key`` (another corpus or tokenizer).

    Raises: ConfigError naming the file when it is damaged (truncated, flipped bytes, not an
    archive this trainer wrote)."""
    try:
        with np.load(path) as z:
            if key is not None and str(z["key"]) != key:
                return None
            tokens, offsets = z["tokens"], z["offsets"]
    except Exception as exc:  # zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError...
        raise ConfigError(f"the run's encoded corpus {path} is damaged "
                          f"({type(exc).__name__}: {exc})") from None
    ok = (tokens.ndim == 1 and offsets.ndim == 1 and offsets.size >= 2 and offsets[0] == 0
          and offsets[-1] == tokens.size and bool(np.all(np.diff(offsets) >= 0)))
    if not ok:
        raise ConfigError(f"the run's encoded corpus {path} is damaged (its document offsets do "
                          "not fit its tokens)")
    return tokens, offsets


def _on_rank0(fn, rank: int):
    """Run ``fn()`` on rank 0; every rank raises its ConfigError (rank 0 decides)."""
    error: list[str | None] = [None]
    if rank == 0:
        try:
            fn()
        except ConfigError as exc:
            error[0] = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ConfigError(error[0])


def prepare_corpora(cfg: PretrainConfig, rank: int = 0) -> RunData:
    """The run's tokenized training and held-out documents (every rank calls it together).

    ``--eval-docs`` documents (:func:`~cp_rope.launch.data.held_out_ids`) are held out;
    the BPE (see the module docstring) never sees them.

    Raises: ConfigError naming the field: an unreadable corpus or tokenizer file, a
    missing ``tokenizers`` package, too few documents to hold some out.
    """
    mode, notes = tokenizer_mode(cfg), []
    table = tok_path = None
    if mode == "bpe":
        _on_rank0(lambda: _bpe_files(cfg, notes), rank)
        tok_path, _, cache = (os.path.join(cfg.train.out_dir, f) for f in _FILES)
        tok = HFTokenizer(tok_path)
        tokens, offsets = _read_cache(cache)  # rank 0 checked it; damaged since: named
        corpus = Corpus(tokens=tokens, offsets=offsets, vocab_size=tok.vocab_size,
                        pad_id=tok.pad_id)
        table = tok.token_bytes()
        name = f"bpe {tok.vocab_size} ids ({tok_path})"
    else:
        corpus = load_corpus(cfg.data, cfg.model.vocab_size)
        if mode != "bin":
            table = load_tokenizer(cfg.data).token_bytes()
        name = {"bin": "pre-tokenized", "bytes": "bytes"}.get(mode, cfg.data.tokenizer)
    train, held = split_corpus(corpus, eval_doc_count(cfg.data.eval_docs, corpus.num_docs))
    return RunData(train=train, eval=held, token_bytes=table, tokenizer=name, notes=notes,
                   trained_tokenizer=tok_path)
