"""Corpora, tokenizers and the packed data pipeline of the pretraining entry point.

A corpus is held as one flat token array plus document offsets (a memmap for
pre-tokenized ``.bin`` files), so 30 MB of text or 10 GB of tokens cost one
array, not a Python object per document. Sources (``--data``):

* default (``None``): the running Python's standard library, every ``*.py``
  under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded),
  sorted by path, one document per file. Real code text that needs no
  download (~1800 files, ~30 MB on CPython 3.11).
* ``*.jsonl``: one JSON object per line, the document in ``--text-field``.
* a directory: every ``*.txt`` below it, sorted by relative path.
* ``*.bin``: pre-tokenized ids (``--bin-dtype`` uint16/uint32, e.g. nanoGPT /
  Megatron style), documents split after each ``--eos-id``.

Tokenizers (``--tokenizer``): ``bytes`` (ids 0..255 are the bytes of the
UTF-8 text, then BOS 256, EOS 257, PAD 258; vocabulary 320 after rounding up to
a multiple of 64), or a local HuggingFace ``tokenizer.json`` read with the
``tokenizers`` library (never a hub download). Here ``None`` means bytes; the
trainer's default for the stdlib corpus, a byte-level BPE trained on it (``bpe``),
is :mod:`cp_rope.launch.tokenizer`.

Held-out documents (``--eval-docs``): :func:`held_out_ids` picks them, evenly spaced
over the corpus; :func:`split_corpus` separates them from the training documents.

Every text document becomes ``[BOS] + tokens + [EOS]``. ``--seq-mode docs``
makes each document an example (cut at ``seq_len`` by the collator);
``--seq-mode concat`` cuts the document stream into ``seq_len``-token
sequences (GPT pretraining; attention crosses document boundaries), which is
how a 131072-token sequence is built from short files.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from cp_rope.parallel import (
    PackingCollator,
    SpanDataset,
    TokenBudgetBatchSampler,
    default_split_threshold,
)

from .config import ConfigError, DataConfig, ModelConfig, ParallelConfig
from .memory_shapes import Shapes

__all__ = [
    "ByteTokenizer", "HFTokenizer", "Corpus", "load_tokenizer", "load_corpus", "stdlib_files",
    "TokenDataset", "build_loader", "placement_args", "held_out_ids", "eval_doc_count",
    "split_corpus", "token_byte_lengths", "corpus_files",
]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus BOS/EOS/PAD specials."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    """Ids in use; the model's embedding is rounded up (see :func:`padded_vocab_size`)."""

    def encode(self, data: str | bytes) -> np.ndarray:
        """Text (str, encoded as UTF-8) or raw bytes -> uint16 ``[n]`` ids."""
        raw = data.encode("utf-8") if isinstance(data, str) else data
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)

    def token_bytes(self) -> np.ndarray:
        """int64 ``[259]`` bytes of text per id: 1 for the 256 bytes, 0 for BOS/EOS/PAD."""
        return np.concatenate([np.ones(256, np.int64), np.zeros(3, np.int64)])


class HFTokenizer:
    """A local HuggingFace ``tokenizer.json`` (the ``tokenizers`` library; no hub access).

    BOS/EOS come from the tokenizer's special tokens (Llama 3, Llama 2, GPT-2
    and ChatML spellings are tried); a tokenizer without an EOS token is
    rejected, since documents must be separable. PAD falls back to EOS (padding
    rows have no label, so its id never matters for the loss).

    Raises: ConfigError if ``tokenizers`` is missing, the file is not a tokenizer.json
    it reads, or it has no EOS token.
    """

    _BOS = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>", "[CLS]")
    _EOS = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "<|im_end|>", "[SEP]")

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ModuleNotFoundError:
            raise ConfigError(f"data.tokenizer={path!r}: needs the `tokenizers` package "
                              "(pip install tokenizers); or drop --tokenizer for byte-level "
                              "tokens") from None
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises plain Exception ("Model missing. at line 1 ...")
            raise ConfigError(f"data.tokenizer={path!r}: not a tokenizers tokenizer.json: "
                              f"{exc}") from exc
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        find = lambda names: next((i for n in names if (i := self._tok.token_to_id(n)) is not None), None)
        self.eos_id = find(self._EOS)
        if self.eos_id is None:
            raise ConfigError(f"data.tokenizer={path!r}: no EOS token among {list(self._EOS)}")
        bos = find(self._BOS)
        self.bos_id = self.eos_id if bos is None else bos
        self.pad_id = self.eos_id

    def encode(self, data: str | bytes) -> np.ndarray:
        """Text -> uint32 ``[n]`` ids (no special tokens added)."""
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def token_bytes(self) -> np.ndarray:
        """int64 ``[vocab_size]`` bytes of text per id, 0 for special tokens
        (:func:`token_byte_lengths`)."""
        return token_byte_lengths(self._tok)


def token_byte_lengths(tok) -> np.ndarray:
    """int64 ``[vocab_size]``: bytes of text each id of a ``tokenizers.Tokenizer`` stands for.

    Special / added tokens count 0 (BOS, EOS, PAD are not text). A byte-level vocabulary
    (GPT-2 / Llama 3 style, every symbol one byte) counts characters of the token string;
    otherwise SentencePiece conventions: ``<0xNN>`` byte-fallback tokens are 1 byte, ``▁``
    is a space, the rest their UTF-8 length.
    """
    vocab = tok.get_vocab(with_added_tokens=True)
    out = np.zeros(tok.get_vocab_size(with_added_tokens=True), np.int64)
    added = set(tok.get_added_tokens_decoder()) if hasattr(tok, "get_added_tokens_decoder") else set()
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = set(ByteLevel.alphabet())
    normal = {s: i for s, i in vocab.items() if i not in added}
    byte_level = all(set(s) <= alphabet for s in normal)
    for s, i in normal.items():
        if byte_level:
            out[i] = len(s)
        elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            out[i] = 1
        else:
            out[i] = len(s.replace("\u2581", " ").encode("utf-8"))
    return out


def load_tokenizer(cfg: DataConfig) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``cfg`` asks for (``None`` or ``"bytes"`` -> bytes).

    Raises: ConfigError for ``"bpe"``: the trainer trains it on the run's corpus
    (:func:`cp_rope.launch.tokenizer.prepare_corpora`); or see :class:`HFTokenizer`.
    """
    if cfg.tokenizer in (None, "bytes"):
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        raise ConfigError("data.tokenizer='bpe' (--tokenizer bpe): a BPE trained on the run's "
                          "corpus exists for cp_rope.launch.pretrain only (tokenizer."
                          "prepare_corpora); finetune_hf needs the ids of the model's own "
                          "vocabulary: --tokenizer MODEL_DIR/tokenizer.json (or bytes for a "
                          "byte-vocabulary model)")
    return HFTokenizer(cfg.tokenizer)


def padded_vocab_size(n: int, multiple: int = 64) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (tensor-core friendly embedding / head)."""
    return -(-n // multiple) * multiple


@dataclass(slots=True)
class Corpus:
    """Documents as one flat token array.

    Fields:
        tokens: ``[N]`` integer ids (numpy array or read-only memmap).
        offsets: int64 ``[D + 1]``; document ``d`` is ``tokens[offsets[d]:offsets[d + 1]]``.
        vocab_size: ids in use (< this).
        pad_id: id used for padding rows.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    vocab_size: int
    pad_id: int

    @property
    def num_docs(self) -> int:
        return self.offsets.size - 1

    def lengths(self) -> np.ndarray:
        """int64 ``[D]`` document lengths, in tokens."""
        return np.diff(self.offsets)


def stdlib_files() -> list[str]:
    """Sorted paths of the running Python's standard-library ``*.py`` files (no site-packages)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files)


def corpus_files(cfg: DataConfig) -> list[str]:
    """The files the corpus ``cfg.data`` reads, in reading order: the stdlib's or the
    directory's (the first ``max_docs``), else the one ``.jsonl`` / ``.bin`` file.

    Raises: ConfigError naming ``data.data`` (no files, an unreadable directory, a file of
    another kind)."""
    path = cfg.data
    if path is not None and (path.endswith(".jsonl") or path.endswith(".bin")):
        return [path]
    if path is None:
        files = stdlib_files()
        if not files:
            raise ConfigError(f"data.data=None: no *.py files under {sysconfig.get_paths()['stdlib']!r}")
    elif os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(f"data.data={path!r} (--data): the directory cannot be read")
        files = sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
        if not files:
            raise ConfigError(f"data.data={path!r}: directory holds no *.txt files")
    else:
        raise ConfigError(f"data.data={path!r}: expected a .jsonl file, a .bin file or a directory")
    return files[: cfg.max_docs]


def _read_texts(cfg: DataConfig) -> Iterable[bytes | str]:
    path = cfg.data
    if path is not None and path.endswith(".jsonl"):
        return _read_jsonl(path, cfg.text_field, cfg.max_docs)
    files = corpus_files(cfg)

    def gen():
        for f in files:
            with _open_corpus(path, f) as fh:
                yield fh.read()
    return gen()


def _open_corpus(path: str | None, file: str):
    """``open(file, "rb")``; an OSError becomes a ConfigError naming --data and the file."""
    try:
        return open(file, "rb")
    except OSError as exc:
        where = "" if file == path else f" (file {file!r})"
        raise ConfigError(f"data.data={path!r} (--data){where}: cannot be read: "
                          f"{exc.strerror or exc}") from None


def _read_jsonl(path: str, field: str, max_docs: int | None) -> Iterable[str]:
    with _open_corpus(path, path) as fh:
        n = 0
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"data.data={path!r}: line {lineno} is not valid UTF-8 "
                                  f"(byte {exc.start} of the line: {exc.reason})") from None
            if not line.strip():
                continue
            if max_docs is not None and n >= max_docs:
                return
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"data.data={path!r}: line {lineno} is not JSON ({exc})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                raise ConfigError(f"data.data={path!r}: line {lineno} has no string field "
                                  f"{field!r} (set --text-field)")
            text = obj[field]
            try:  # JSON can escape a lone surrogate ("\ud800"): no tokenizer can encode it
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ConfigError(f"data.data={path!r}: line {lineno}: field {field!r} holds "
                                  f"{text[exc.start:exc.end]!r} at character {exc.start}, a lone "
                                  "UTF-16 surrogate escape that is no Unicode text") from None
            n += 1
            yield text


def _load_bin(cfg: DataConfig, vocab_size: int) -> Corpus:
    dtype = np.dtype(cfg.bin_dtype)
    top = np.iinfo(dtype).max
    if vocab_size <= 0:
        raise ConfigError(f"model.vocab_size={vocab_size}: a pre-tokenized .bin corpus needs "
                          "--vocab-size")
    if cfg.eos_id is None or cfg.eos_id < 0 or cfg.eos_id > top or cfg.eos_id >= vocab_size:
        raise ConfigError(f"data.eos_id={cfg.eos_id!r} (--eos-id): the EOS id of a .bin corpus "
                          f"must be in [0, {min(top + 1, vocab_size)}) (model.vocab_size="
                          f"{vocab_size}, --bin-dtype {cfg.bin_dtype} holds ids up to {top})")
    with _open_corpus(cfg.data, cfg.data):  # readable (a memmap of an unreadable file fails raw)
        size = os.path.getsize(cfg.data)
    if size == 0:
        raise ConfigError(f"data.data={cfg.data!r} (--data): the .bin file is empty (0 tokens)")
    if size % dtype.itemsize:
        raise ConfigError(f"data.data={cfg.data!r}: {size} bytes is not a whole number of "
                          f"{cfg.bin_dtype} tokens (check --bin-dtype)")
    tokens = np.memmap(cfg.data, dtype=dtype, mode="r")
    ends = np.flatnonzero(tokens == cfg.eos_id) + 1  # each document ends with its EOS
    if ends.size == 0 or ends[-1] != tokens.size:
        ends = np.append(ends, tokens.size)  # a trailing document without EOS
    offsets = np.concatenate([[0], ends]).astype(np.int64)
    if cfg.max_docs is not None:
        offsets = offsets[: cfg.max_docs + 1]
    return Corpus(tokens=tokens, offsets=offsets, vocab_size=vocab_size, pad_id=int(cfg.eos_id))


def load_corpus(cfg: DataConfig, vocab_size: int = 0) -> Corpus:
    """Read and tokenize the corpus ``cfg`` names (see the module docstring).

    Args:
        cfg: data config (``data``, ``tokenizer``, ``max_docs``, ...).
        vocab_size: the model's vocabulary for a pre-tokenized ``.bin`` (ids
            must be below it; checked).

    Returns: a :class:`Corpus`; text documents are ``[BOS] + ids + [EOS]``.

    Raises: ConfigError naming the field for a missing/empty/unreadable source.
    """
    if cfg.data is not None and cfg.data.endswith(".bin"):
        corpus = _load_bin(cfg, vocab_size)
        top = int(corpus.tokens[: corpus.offsets[-1]].max(initial=0))
        if top >= vocab_size:
            raise ConfigError(f"model.vocab_size={vocab_size}: the .bin corpus holds id {top}")
        return corpus
    tok = load_tokenizer(cfg)
    parts, lengths = [], []
    for text in _read_texts(cfg):
        ids = tok.encode(text)
        parts.append(np.concatenate([[tok.bos_id], ids, [tok.eos_id]]).astype(ids.dtype))
        lengths.append(ids.size + 2)
    if not parts:
        raise ConfigError(f"data.data={cfg.data!r}: no documents")
    if max(lengths) == 2:  # BOS + EOS only: nothing to learn, bits per byte 0 / 0
        raise ConfigError(f"data.data={cfg.data!r}: all {len(parts)} documents are empty (no "
                          "text to train on)")
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Corpus(tokens=np.concatenate(parts), offsets=offsets, vocab_size=tok.vocab_size,
                  pad_id=tok.pad_id)


def eval_doc_count(eval_docs: int | None, num_docs: int) -> int:
    """Held-out documents of a corpus of ``num_docs``: ``eval_docs``, or when None
    ``min(8, num_docs // 10)`` (none for fewer than 10 documents).

    Raises: ConfigError naming ``data.eval_docs`` when it leaves no training document.
    """
    n = min(8, num_docs // 10) if eval_docs is None else eval_docs
    if n >= num_docs:
        raise ConfigError(f"data.eval_docs={eval_docs} (--eval-docs): the corpus has {num_docs} "
                          "documents; hold out fewer (0 = no held-out evaluation)")
    return n


def held_out_ids(num_docs: int, n_eval: int) -> np.ndarray:
    """int64 ``[n_eval]`` sorted ids of the held-out documents: ``floor((k + 1/2) num_docs /
    n_eval)`` for ``k < n_eval``, evenly spaced over the corpus (which is sorted by path, so
    they span its parts). Independent of the seed and the tokenizer: runs compare on the same
    text."""
    return ((np.arange(n_eval, dtype=np.int64) * 2 + 1) * num_docs) // (2 * max(n_eval, 1))


def split_corpus(corpus: Corpus, n_eval: int) -> tuple[Corpus, Corpus | None]:
    """``(training documents, held-out documents or None)``; disjoint, each in corpus order.

    Text corpora hold out :func:`held_out_ids`; a memmapped ``.bin`` corpus holds out its
    last ``n_eval`` documents (views: a 10 GB memmap is never copied).
    """
    if n_eval <= 0:
        return corpus, None
    d = corpus.num_docs
    if isinstance(corpus.tokens, np.memmap):
        cut = int(corpus.offsets[d - n_eval])
        held = Corpus(tokens=corpus.tokens[cut:int(corpus.offsets[-1])],
                      offsets=corpus.offsets[d - n_eval:] - cut, vocab_size=corpus.vocab_size,
                      pad_id=corpus.pad_id)
        train = Corpus(tokens=corpus.tokens, offsets=corpus.offsets[:d - n_eval + 1],
                       vocab_size=corpus.vocab_size, pad_id=corpus.pad_id)
        return train, held
    is_held = np.zeros(d, bool)
    is_held[held_out_ids(d, n_eval)] = True

    def take(mask: np.ndarray) -> Corpus:
        starts, ends = corpus.offsets[:-1][mask], corpus.offsets[1:][mask]
        offsets = np.zeros(starts.size + 1, np.int64)
        np.cumsum(ends - starts, out=offsets[1:])
        idx = np.repeat(starts - offsets[:-1], ends - starts) + np.arange(int(offsets[-1]))
        return Corpus(tokens=corpus.tokens[idx], offsets=offsets, vocab_size=corpus.vocab_size,
                      pad_id=corpus.pad_id)
    return take(~is_held), take(is_held)


class TokenDataset(Dataset):
    """Examples of a :class:`Corpus` for :class:`~cp_rope.parallel.PackingCollator`.

    ``mode="docs"``: example ``i`` is document ``i``. ``mode="concat"``:
    example ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len)`` of the
    document stream (the tail shorter than ``seq_len`` is dropped); its ids run
    one token further, with a ``span``, so that its last token is labelled with
    the stream's next token (GPT pretraining). Items are
    ``{"input_ids": int64 tensor}`` (plus ``"span"`` in concat mode).
    """

    def __init__(self, corpus: Corpus, mode: str, seq_len: int):
        if mode not in ("docs", "concat"):
            raise ValueError(f"mode must be 'docs' or 'concat', got {mode!r}")
        self.corpus, self.mode, self.seq_len = corpus, mode, seq_len
        total = int(corpus.offsets[-1])
        self._n = corpus.num_docs if mode == "docs" else total // seq_len
        if self._n == 0:
            raise ConfigError(f"data.seq_len={seq_len}: the corpus has {total} tokens, fewer "
                              "than one sequence")

    def __len__(self) -> int:
        return self._n

    def lengths(self) -> np.ndarray:
        """int64 ``[len(self)]`` example lengths, in tokens."""
        if self.mode == "docs":
            return self.corpus.lengths()
        return np.full(self._n, self.seq_len, np.int64)

    def __getitem__(self, i: int) -> dict:
        if self.mode == "docs":
            s, e = int(self.corpus.offsets[i]), int(self.corpus.offsets[i + 1])
            return {"input_ids": torch.from_numpy(self.corpus.tokens[s:e].astype(np.int64))}
        s = i * self.seq_len
        e = min(s + self.seq_len + 1, int(self.corpus.offsets[-1]))
        return {"input_ids": torch.from_numpy(self.corpus.tokens[s:e].astype(np.int64)),
                "span": (0, self.seq_len)}


def placement_args(parallel: ParallelConfig, model: ModelConfig, *,
                   dtype: torch.dtype = torch.bfloat16, calibration=None, shapes=None) -> dict:
    """``build_loader``'s ``placement`` / ``split_threshold`` for a run: ``--cp-placement``,
    and for ``per_document`` ``--cp-split-threshold`` or, unset,
    :func:`cp_rope.parallel.default_split_threshold` of the model's head_dim and cp_size.
    ``auto``: :class:`~cp_rope.parallel.cost_model.AutoPlacement`'s arguments: the run's compute
    ``dtype``, block backend (``--attn-backend``'s throughput table), ``calibration``
    (``--cp-calibration``'s; None: the shipped defaults), and the heads, head_dim and every
    layer's window of ``shapes`` (a transformers model's; default: ``model``'s)."""
    s, threshold = shapes or Shapes.from_model_config(model), parallel.cp_split_threshold
    window = list(s.windows) if any(w is not None for w in s.windows) else None
    if parallel.cp_placement == "auto":  # chosen per batch by the cost model (auto_args)
        return {"placement": "auto", "split_threshold": None, "auto_args": dict(
            q_heads=s.n_heads, kv_heads=s.n_kv_heads, head_dim=s.head_dim, window=window,
            method=parallel.cp_method, dtype=dtype, backend=parallel.attn_backend,
            calibration=calibration,
            ulysses_size=parallel.ulysses_size if parallel.cp_method == "hybrid" else None)}
    if parallel.cp_placement == "per_document" and threshold is None:
        threshold = default_split_threshold(s.head_dim, parallel.cp_size)
    return {"placement": parallel.cp_placement, "split_threshold": threshold}


def build_loader(cfg: DataConfig, dataset: TokenDataset, *, cp_size: int, cp_rank: int,
                 dp_size: int, dp_rank: int, seed: int, pin_memory: bool = False,
                 placement: str = "zigzag", split_threshold: int | None = None,
                 auto_args: dict | None = None) -> tuple[DataLoader, TokenBudgetBatchSampler]:
    """DataLoader of this rank's :class:`~cp_rope.parallel.PackedBatch` shards.

    Every rank of a CP group passes the same ``dp_rank``, so the group packs the
    same global batch (``tokens_per_batch`` tokens, padding for ``cp_size``
    included) and each rank keeps its zigzag shard; data-parallel ranks get
    different batches. Documents longer than ``seq_len`` are cut into
    ``seq_len``-token sequences by the collator.

    ``placement`` / ``split_threshold``: as :class:`~cp_rope.parallel.PackingCollator`
    (``"per_document"``: documents of at most ``split_threshold`` tokens stay whole
    on one rank). ``"auto"``: per batch, by the cost model
    (:class:`cp_rope.parallel.cost_model.AutoPlacement` with ``auto_args``: the layer's
    heads, head_dim, method, ulysses_size, dtype, backend, calibration; each batch then
    carries its choice, ``batch.choice``, which its plan takes).

    Returns: ``(loader, sampler)``; the sampler carries the resumable data position.
    """
    sampler = TokenBudgetBatchSampler(dataset.lengths(), cfg.tokens_per_batch, cp_size=cp_size,
                                      seed=seed, dp_size=dp_size, dp_rank=dp_rank)
    collate = PackingCollator(cp_size=cp_size, cp_rank=cp_rank, pad_id=dataset.corpus.pad_id,
                              max_tokens=cfg.tokens_per_batch, max_seqlen=cfg.seq_len,
                              vocab_size=dataset.corpus.vocab_size,
                              placement="zigzag" if placement == "auto" else placement,
                              split_threshold=split_threshold)
    if placement == "auto":
        from cp_rope.parallel.cost_model import AutoPlacement

        collate = AutoPlacement(collate, **auto_args)
    loader = DataLoader(SpanDataset(dataset), batch_sampler=sampler, collate_fn=collate,
                        num_workers=cfg.num_workers, pin_memory=pin_memory,
                        persistent_workers=cfg.num_workers > 0)
    return loader, sampler
