"""Corpus loaders, tokenizers and the packed loader of the pretraining entry point."""

from __future__ import annotations

import json
import os
import sys
import sysconfig

import numpy as np
import pytest
import torch
from utils import tiny_pretrain_argv

from cp_rope.launch import data as data_mod
from cp_rope.launch.config import ConfigError, DataConfig
from cp_rope.launch.data import (
    ByteTokenizer,
    TokenDataset,
    build_loader,
    load_corpus,
    load_tokenizer,
    padded_vocab_size,
    stdlib_files,
)
from cp_rope.launch.pretrain import main
from cp_rope.parallel import PackingCollator, SpanDataset, shard_batch

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def _doc(corpus, d):
    return corpus.tokens[corpus.offsets[d]:corpus.offsets[d + 1]].tolist()


def test_stdlib_files_sorted_real_and_without_site_packages():
    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert os.path.join(sysconfig.get_paths()["stdlib"], "os.py") in files
    assert not any("site-packages" in f for f in files)


def test_default_corpus_is_stdlib_bytes_with_bos_eos():
    corpus = load_corpus(DataConfig(max_docs=3))
    files = stdlib_files()[:3]
    assert corpus.num_docs == 3 and corpus.vocab_size == 259 and corpus.pad_id == 258
    for d, f in enumerate(files):
        with open(f, "rb") as fh:
            raw = list(fh.read())
        assert _doc(corpus, d) == [BOS, *raw, EOS]
    assert padded_vocab_size(corpus.vocab_size) == 320


def test_jsonl_corpus_and_bad_lines(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "héllo"}) + "\n\n" + json.dumps({"body": "x", "text": "ab"}) + "\n")
    corpus = load_corpus(DataConfig(data=str(path)))
    assert _doc(corpus, 0) == [BOS, *"héllo".encode(), EOS] and _doc(corpus, 1) == [BOS, 97, 98, EOS]
    path.write_text(json.dumps({"text": "ok"}) + "\nnot json\n")
    with pytest.raises(ConfigError, match=r"data.data=.*line 2 is not JSON"):
        load_corpus(DataConfig(data=str(path)))
    path.write_text(json.dumps({"txt": "ok"}) + "\n")
    with pytest.raises(ConfigError, match=r"line 1 has no string field 'text'"):
        load_corpus(DataConfig(data=str(path)))


def test_txt_directory_sorted_recursive(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zz")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "skip.md").write_text("no")
    corpus = load_corpus(DataConfig(data=str(tmp_path)))
    assert corpus.num_docs == 2
    assert _doc(corpus, 0) == [BOS, 97, EOS] and _doc(corpus, 1) == [BOS, 122, 122, EOS]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no \\*.txt files"):
        load_corpus(DataConfig(data=str(empty)))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_memmap_split_on_eos(tmp_path, dtype):
    ids = np.array([5, 6, 0, 7, 0, 0, 8, 9], dtype=dtype)  # EOS = 0; an empty doc; a tail without EOS
    path = tmp_path / "c.bin"
    ids.tofile(path)
    corpus = load_corpus(DataConfig(data=str(path), bin_dtype=dtype, eos_id=0), vocab_size=10)
    assert isinstance(corpus.tokens, np.memmap)
    assert [_doc(corpus, d) for d in range(corpus.num_docs)] == [[5, 6, 0], [7, 0], [0], [8, 9]]
    with pytest.raises(ConfigError, match="model.vocab_size=9"):
        load_corpus(DataConfig(data=str(path), bin_dtype=dtype, eos_id=0), vocab_size=9)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="not a whole number"):
        load_corpus(DataConfig(data=str(tmp_path / "odd.bin"), bin_dtype="uint16", eos_id=0), 10)


def test_hf_tokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ModuleNotFoundError:
        path.write_text("{}")
        with pytest.raises(ConfigError, match=r"data.tokenizer=.*pip install tokenizers"):
            load_tokenizer(DataConfig(tokenizer=str(path)))
        return
    vocab = {"[UNK]": 0, "</s>": 1, "<s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    (tmp_path / "d.txt").write_text("hello world zzz")
    corpus = load_corpus(DataConfig(data=str(tmp_path), tokenizer=str(path)))
    assert _doc(corpus, 0) == [2, 3, 4, 0, 1] and corpus.vocab_size == 5


def test_concat_mode_windows_label_across_the_cut():
    corpus = load_corpus(DataConfig(max_docs=2))
    ds = TokenDataset(corpus, "concat", seq_len=64)
    assert len(ds) == int(corpus.offsets[-1]) // 64 and (ds.lengths() == 64).all()
    stream = torch.from_numpy(corpus.tokens.astype(np.int64))
    batch = PackingCollator(cp_size=2)([SpanDataset(ds)[(3, 0, 64)]])
    assert batch.cu_seqlens.tolist() == [0, 64]
    assert torch.equal(batch.input_ids, stream[192:256])
    assert torch.equal(batch.labels, stream[193:257])  # the last token's label is the next window's first


def test_docs_mode_loader_cp_groups_share_dp_ranks_split():
    """Ranks of one CP group pack the same global batch (their shards unshard to it); the two
    data-parallel ranks see disjoint documents; documents longer than seq_len are cut."""
    cfg = DataConfig(max_docs=24, seq_len=256, tokens_per_batch=1024)
    ds = TokenDataset(load_corpus(cfg), "docs", cfg.seq_len)
    seen = []
    for dp_rank in range(2):
        glob = next(iter(build_loader(cfg, ds, cp_size=2, cp_rank=None, dp_size=2, dp_rank=dp_rank,
                                      seed=5)[0]))
        loaders = [build_loader(cfg, ds, cp_size=2, cp_rank=r, dp_size=2, dp_rank=dp_rank, seed=5)
                   for r in range(2)]
        shards = [next(iter(loader)) for loader, _ in loaders]
        for r in range(2):
            want = shard_batch(glob, 2, r)
            for f in ("input_ids", "labels", "position_ids", "cu_seqlens"):
                assert torch.equal(getattr(shards[r], f), getattr(want, f)), (dp_rank, r, f)
        assert int(shards[0].cu_seqlens[-1]) * 2 <= cfg.tokens_per_batch
        assert int((shards[0].cu_seqlens[1:] - shards[0].cu_seqlens[:-1]).max()) * 2 <= cfg.seq_len
        assert torch.equal(shards[0].seq_lens, shards[1].seq_lens)
        seen.append(set(glob.input_ids.tolist()[:64]))
        assert len(loaders[0][1]) == len(loaders[1][1]) > 1
    assert seen[0] != seen[1]  # different documents (the first 64 ids differ as sets)


def test_seq_len_longer_than_corpus():
    corpus = load_corpus(DataConfig(max_docs=1))
    with pytest.raises(ConfigError, match="data.seq_len"):
        TokenDataset(corpus, "concat", seq_len=int(corpus.offsets[-1]) + 2)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("text", ["{}", "not json"])
def test_hf_tokenizer_unreadable_file_names_the_field(tmp_path, text):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*not a tokenizers tokenizer\.json"):
        load_tokenizer(DataConfig(tokenizer=str(path)))


# ------------------------------------------------------------------ bad input: corpora and tokenizers (from the issue-15 and round-3 catalogues)
SMALL = tiny_pretrain_argv(seq_len=64, tokens_per_batch=256, max_docs=16)  # the bad-input runs' size


def _data_argv(path, *extra):
    return SMALL + ["--steps", "1", "--data", str(path), *extra]


def test_jsonl_invalid_utf8(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"c\.jsonl.*line 2 is not valid UTF-8"):
        main(_data_argv(f, "--out-dir", str(tmp_path / "out")))


def test_bin_empty(tmp_path):
    f = tmp_path / "c.bin"
    f.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"c\.bin.*--data.*empty"):
        main(_data_argv(f, "--eos-id", "1", "--vocab-size", "64", "--out-dir", str(tmp_path / "o")))


def test_eos_id_outside_vocab(tmp_path):
    f = tmp_path / "c.bin"
    np.arange(1, 200, dtype=np.uint16).tofile(f)
    with pytest.raises(ConfigError, match=r"--eos-id.*\[0, 256\)"):
        main(_data_argv(f, "--eos-id", "300", "--vocab-size", "256", "--out-dir", str(tmp_path / "o")))


def test_eos_id_outside_bin_dtype(tmp_path):
    f = tmp_path / "c.bin"
    np.arange(1, 200, dtype=np.uint16).tofile(f)
    with pytest.raises(ConfigError, match=r"--eos-id.*uint16"):
        main(_data_argv(f, "--eos-id", "70000", "--vocab-size", "100000", "--out-dir",
                        str(tmp_path / "o")))


def test_corpus_unreadable(tmp_path, monkeypatch):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "a"}\n')
    f.chmod(0)
    if os.geteuid() == 0:  # root reads anything: make this file's open fail as it would
        real = open

        def deny(file, *a, **k):
            if str(file) == str(f):
                raise PermissionError(13, "Permission denied", str(file))
            return real(file, *a, **k)
        monkeypatch.setattr(data_mod, "open", deny, raising=False)
    with pytest.raises(ConfigError, match=r"c\.jsonl.*--data.*cannot be read: Permission denied"):
        main(_data_argv(f, "--out-dir", str(tmp_path / "out")))


def test_jsonl_lone_surrogate_names_file_and_line(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "fine"}\n{"text": "bad \\ud800 text"}\n')
    with pytest.raises(ConfigError, match=r"c\.jsonl.*line 2.*'\\ud800'.*surrogate"):
        main(SMALL + ["--steps", "1", "--data", str(f), "--out-dir", str(tmp_path / "o")])


def test_eos_id_for_a_text_corpus(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "some text"}\n')
    with pytest.raises(ConfigError, match=r"data\.eos_id=999: is for a pre-tokenized \.bin"):
        main(SMALL + ["--steps", "1", "--data", str(f), "--eos-id", "999",
                     "--out-dir", str(tmp_path / "o")])


def test_tokenizer_bpe_outside_pretrain_says_why():
    from cp_rope.launch.config import DataConfig
    from cp_rope.launch.data import load_tokenizer
    with pytest.raises(ConfigError, match=r"--tokenizer bpe.*pretrain only.*finetune_hf needs"):
        load_tokenizer(DataConfig(tokenizer="bpe"))


def test_peeked_batch_is_not_consumed_and_resume_returns_it():
    """The trainer peeks at the next batch (to plan it while the GPU runs the step before): a
    state saved between the peek and the step resumes at the peeked batch, also when the peek
    crossed an epoch's end; the stream is the same with and without peeking."""
    from cp_rope.launch.batches import BatchStream

    cfg = DataConfig(max_docs=12, seq_len=128, tokens_per_batch=256)
    ds = TokenDataset(load_corpus(cfg), "docs", cfg.seq_len)

    def batches():
        loader, sampler = build_loader(cfg, ds, cp_size=1, cp_rank=0, dp_size=1, dp_rank=0, seed=3)
        return BatchStream(loader, sampler)

    n = len(batches().sampler)
    assert n >= 2
    plain, ref = batches(), []
    for _ in range(2 * n + 1):
        ref.append(next(plain).input_ids)
    b = batches()
    for i in range(2 * n):  # every position, the epoch's last batch included
        assert torch.equal(next(b).input_ids, ref[i])
        peeked = b.peek()
        assert b.peek() is peeked  # fetched once
        state = b.state_dict()
        resumed = batches()
        resumed.load_state_dict(state)
        assert torch.equal(next(resumed).input_ids, ref[i + 1]), i
        assert torch.equal(peeked.input_ids, ref[i + 1]), i
