"""A resume checks the contents of its inputs, not their paths (issue 35, class 3).

Before: a corpus or tokenizer file changed at the same path gave a sampler traceback after
the model was loaded, or (a tokenizer with permuted ids) resumed silently onto the wrong
embeddings; a damaged ``corpus_tokens.npz`` gave a raw zip error. Now config.json and the
checkpoint manifests record the inputs' SHA-256, a resume with other contents is refused
before anything is built, naming the file, and the trained BPE and its encoded corpus are
encoded again when damaged; an edited trained BPE is refused, naming it.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from utils import tiny_pretrain_argv

from cp_rope.launch.checkpoint import CheckpointError
from cp_rope.launch.config import ConfigError
from cp_rope.launch.pretrain import main
from cp_rope.launch.tokenizer import _read_cache, train_bpe

TINY = tiny_pretrain_argv()
TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (i + 2) for i in range(12)]


def _jsonl(path, texts) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def test_resume_refuses_a_corpus_changed_at_the_same_path(tmp_path, capsys):
    corpus = _jsonl(tmp_path / "c.jsonl", TEXTS)
    argv = TINY + ["--data", corpus, "--max-docs", "12", "--out-dir", str(tmp_path / "run")]
    main(argv + ["--steps", "1"])
    _jsonl(tmp_path / "c.jsonl", [t.upper() for t in TEXTS])  # same lengths, other text
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"--resume: the contents of the run's input files "
                       r"changed since the checkpoints were written .*config\.json\): "
                       rf"data\.data='{corpus}': sha256:\w+ \(then\) != sha256:\w+ \(now\)"):
        main(argv + ["--steps", "2", "--resume"])
    assert "cp-rope pretrain" not in capsys.readouterr().out  # refused before the set-up's banner


def _tokenizer_file(path, permute: bool = False) -> str:
    tok = json.loads(train_bpe(TEXTS, vocab_size=300, seed=0).to_str())
    if permute:  # the same strings, other ids (merges name strings: still a valid BPE)
        vocab = tok["model"]["vocab"]
        names = sorted(vocab, key=vocab.get)[2:]  # keep the two specials
        ids = sorted(vocab[n] for n in names)
        vocab.update(zip(names, reversed(ids), strict=True))
    path.write_text(json.dumps(tok))
    return str(path)


def test_resume_refuses_a_tokenizer_whose_ids_were_permuted(tmp_path):
    tok = _tokenizer_file(tmp_path / "tok.json")
    corpus = _jsonl(tmp_path / "c.jsonl", TEXTS)
    argv = TINY + ["--data", corpus, "--tokenizer", tok, "--max-docs", "12",
                   "--out-dir", str(tmp_path / "run")]
    main(argv + ["--steps", "1"])
    _tokenizer_file(tmp_path / "tok.json", permute=True)
    with pytest.raises(ConfigError, match=rf"data\.tokenizer='{tok}': sha256:\w+ \(then\) != "):
        main(argv + ["--steps", "2", "--resume"])


def test_trained_bpe_and_encoded_corpus_are_rebuilt_when_edited_or_damaged(tmp_path, capsys):
    out = tmp_path / "run"
    argv = TINY + ["--tokenizer", "bpe", "--bpe-vocab-size", "300", "--max-docs", "12",
                   "--out-dir", str(out)]
    main(argv + ["--steps", "1"])
    original = (out / "tokenizer.json").read_bytes()
    tok = json.loads(original)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped
    (out / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=rf"data\.tokenizer: the run's {out}/tokenizer\.json "
                       r"changed since it was trained"):
        main(argv + ["--steps", "2", "--resume"])
    os.remove(out / "tokenizer.json")  # the remedy the message gives: trained again, the same
    os.remove(out / "tokenizer_meta.json")
    main(argv + ["--steps", "2", "--resume"])
    assert (out / "tokenizer.json").read_bytes() == original

    cache = out / "corpus_tokens.npz"
    for step, damage in ((3, lambda raw: raw[: len(raw) // 2]),  # truncated
                         (4, lambda raw: raw[:600] + bytes([raw[600] ^ 0xFF]) + raw[601:])):
        cache.write_bytes(damage(cache.read_bytes()))
        with pytest.raises(ConfigError, match=rf"encoded corpus {cache} is damaged"):
            _read_cache(str(cache))  # what a rank reading it after rank 0 says
        capsys.readouterr()
        resumed = main(argv + ["--steps", str(step), "--resume"])
        assert f"{cache} is damaged" in capsys.readouterr().out and sorted(resumed["losses"]) == [step]
    _read_cache(str(cache))  # encoded again, intact


def test_a_changed_trained_bpe_is_named_by_the_checkpoint(tmp_path):
    """The manifest records the BPE the run trained: a checkpoint beside another tokenizer.json
    (its tokenizer_meta.json rewritten to match) is refused, naming it, before loading."""
    out = tmp_path / "run"
    argv = TINY + ["--tokenizer", "bpe", "--bpe-vocab-size", "300", "--max-docs", "12",
                   "--out-dir", str(out)]
    main(argv + ["--steps", "1"])
    manifest = next(out.glob("checkpoints/step_*/checksums.json"))
    assert "contents.out_dir/tokenizer.json" in json.loads(manifest.read_text())["run"]
    assert set(json.loads((out / "config.json").read_text())["contents"]) == {
        "data.data", "out_dir/tokenizer.json"}
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    text = json.dumps(tok)
    (out / "tokenizer.json").write_text(text)
    meta = json.loads((out / "tokenizer_meta.json").read_text())
    meta["sha256"] = hashlib.sha256(text.encode()).hexdigest()  # as if trained so
    (out / "tokenizer_meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"was written by another run \(contents\.out_dir/"
                       r"tokenizer\.json: 'sha256:\w+' \(checkpoint\) != 'sha256:\w+' \(this run\)"):
        main(argv + ["--steps", "2", "--resume"])
