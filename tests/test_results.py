"""Run results (issue 24): bits per byte, the held-out split, the run's BPE tokenizer, plots."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from utils import tiny_pretrain_argv

from cp_rope.launch import plot
from cp_rope.launch.cli import parse_args
from cp_rope.launch.config import ConfigError, DataConfig, validate
from cp_rope.launch.data import (
    Corpus,
    eval_doc_count,
    held_out_ids,
    load_corpus,
    split_corpus,
)
from cp_rope.launch.metrics import StepStats, bits_per_byte, cp_rank_work
from cp_rope.launch.pretrain import main
from cp_rope.launch.tokenizer import prepare_corpora, token_byte_lengths, train_bpe
from cp_rope.parallel import PackingCollator

tokenizers = pytest.importorskip("tokenizers")
# the launch tests' tiny model, with this file's subjects switched back on
TINY = [a for a in tiny_pretrain_argv(max_docs=30) if a not in ("--tokenizer", "bytes",
                                                                "--eval-docs", "0")]


def _docs(tmp_path, texts) -> str:
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    for i, t in enumerate(texts):
        (d / f"doc{i:03d}.txt").write_text(t)
    return str(d)


def _cfg(argv):
    cfg = parse_args(argv)
    validate(cfg)
    return cfg


def _doc_texts(corpus: Corpus) -> list[tuple]:
    return [tuple(corpus.tokens[corpus.offsets[i]:corpus.offsets[i + 1]].tolist())
            for i in range(corpus.num_docs)]


# ------------------------------------------------------------------ bits per byte
def test_bits_per_byte_hand_computed():
    """Three predicted tokens of 1, 2 and 5 bytes with probabilities 1/2, 1/4, 1/8:
    NLL = ln 2 + ln 4 + ln 8 = 6 ln 2 nats over 8 bytes = 6 bits / 8 bytes = 0.75."""
    assert bits_per_byte(6 * math.log(2), 8) == pytest.approx(0.75, rel=1e-15)
    assert math.isnan(bits_per_byte(1.0, 0))
    # StepStats: the step's mean loss x the labelled tokens = the NLL sum; bytes from the table
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.75, 0.125, 0.125],
                                     [0.25, 0.125, 0.625], [0.3, 0.3, 0.4]], dtype=torch.float64))
    labels = torch.tensor([0, 1, -100, 2])
    table = np.array([1, 2, 5])  # bytes of text of ids 0, 1, 2
    mean = float(F.cross_entropy(logits, labels, ignore_index=-100))  # over the 3 labelled rows
    expected = -(math.log(0.5) + math.log(0.125) + math.log(0.4)) / (math.log(2) * (1 + 2 + 5))

    class Shard:  # what StepStats reads of a host PackedBatch
        cp_size, placement = 1, None

    shard = Shard()
    shard.labels = labels
    stats = StepStats(table, cp_size=1, group=None, device=torch.device("cpu"))
    stats.add(shard)
    fields = stats.fields(7, {7: mean})
    assert fields["bpb"] == pytest.approx(expected, rel=1e-12) and stats.bpb == {7: (fields["bpb"], 1)}
    # a log window of two steps: (NLL_1 + NLL_2) / (ln 2 * (bytes_1 + bytes_2))
    second = Shard()
    second.labels = torch.tensor([2, 2, -100])  # 10 bytes, mean loss 0.9 over 2 tokens
    stats.add(shard)
    stats.add(second)
    two = stats.fields(9, {8: mean, 9: 0.9})["bpb"]
    assert two == pytest.approx((3 * mean + 2 * 0.9) / (math.log(2) * (8 + 10)), rel=1e-12)
    assert stats.done_text() == (f"; bits/byte {expected:.3f} (first 1 step) -> {two:.3f} "
                                 "(last 2)")


def _group_bpb_body(rank, world_size):
    """Each rank holds different labels; bits per byte use the group's tokens and bytes."""
    table = np.array([1, 3, 0, 2])
    labels = [torch.tensor([0, 1, -100, 1]), torch.tensor([3, -100, 2, 2, 0])][rank]

    class Shard:
        cp_size, placement = 1, None

    shard = Shard()
    shard.labels = labels
    stats = StepStats(table, cp_size=1, group=None, device=torch.device("cpu"))
    stats.add(shard)
    loss = 1.7  # the group mean over all 3 + 4 labelled tokens
    bpb = stats.fields(1, {1: loss})["bpb"]
    n_bytes = (1 + 3 + 3) + (2 + 0 + 0 + 1)
    assert bpb == pytest.approx(loss * 7 / (math.log(2) * n_bytes), rel=1e-12), (rank, bpb)


def test_bits_per_byte_sums_over_the_group():
    run_distributed(_group_bpb_body, 2)


def test_cp_rank_work_from_the_plan():
    """Zigzag: every rank w(L) / C pairs of each sequence; per-document: the placement's work."""
    docs = [{"input_ids": torch.randint(0, 50, (n,))} for n in (37, 5, 120, 64, 9)]
    total = sum(L * (L + 1) // 2 for L in (40, 8, 120, 64, 16))  # padded to 2C = 8 (C = 4)
    zig = cp_rank_work(PackingCollator(cp_size=4, cp_rank=1)(docs))
    assert zig.tolist() == [total / 4] * 4
    shard = PackingCollator(cp_size=4, cp_rank=2, placement="per_document",
                            split_threshold=64)(docs)
    per_doc = cp_rank_work(shard)
    assert per_doc.tolist() == [shard.placement.work(r) for r in range(4)]
    assert per_doc.sum() == total and per_doc.max() > per_doc.min()  # whole docs: LPT, uneven


# ------------------------------------------------------------------ held-out split
def test_eval_documents_are_disjoint_from_training_documents(tmp_path):
    texts = [f"document {i} " + "x" * i for i in range(37)]
    corpus = load_corpus(DataConfig(data=_docs(tmp_path, texts)))
    n = eval_doc_count(None, corpus.num_docs)
    assert n == 3 and held_out_ids(37, 3).tolist() == [6, 18, 30]  # floor((2k + 1) 37 / 6)
    train, held = split_corpus(corpus, n)
    a, b = _doc_texts(train), _doc_texts(held)
    assert not set(a) & set(b) and sorted(a + b) == sorted(_doc_texts(corpus))
    assert b == [_doc_texts(corpus)[i] for i in (6, 18, 30)]
    again = split_corpus(load_corpus(DataConfig(data=_docs(tmp_path, texts))), n)[1]
    assert _doc_texts(again) == b  # deterministic
    # a memmapped .bin corpus holds out its last documents, as views
    path = tmp_path / "t.bin"
    np.array([5, 6, 0, 7, 0, 8, 9, 9, 0, 4, 0], np.uint16).tofile(path)
    binc = load_corpus(DataConfig(data=str(path), eos_id=0), vocab_size=10)
    tr, ev = split_corpus(binc, 2)
    assert _doc_texts(tr) == [(5, 6, 0), (7, 0)] and _doc_texts(ev) == [(8, 9, 9, 0), (4, 0)]
    assert isinstance(ev.tokens, np.memmap)
    with pytest.raises(ConfigError, match=r"data\.eval_docs=37 \(--eval-docs\)"):
        eval_doc_count(37, 37)


def test_the_bpe_never_sees_held_out_documents(tmp_path):
    """A word repeated only in a held-out document is no token of the BPE; the same kind of
    word repeated in a training document is."""
    texts = [f"common words here {i}\n" * 20 for i in range(20)]
    texts[10] = "zqxjvk " * 400  # a training document
    texts[5] = "wmfpyb " * 400  # held out
    assert held_out_ids(20, 2).tolist() == [5, 15]
    cfg = _cfg(["--data", _docs(tmp_path, texts), "--tokenizer", "bpe", "--eval-docs", "2",
                "--bpe-vocab-size", "400", "--out-dir", str(tmp_path / "run")])
    data = prepare_corpora(cfg)
    vocab = tokenizers.Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json")).get_vocab()
    assert "\u0120zqxjvk" in vocab  # GPT-2's byte-level space, then the word: one token
    assert not any("fpy" in t for t in vocab)
    assert data.eval.num_docs == 2 and data.train.num_docs == 18


# ------------------------------------------------------------------ the run's tokenizer
def test_bpe_is_deterministic_with_the_seed(tmp_path):
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 5) for i in range(200)]
    one, two = (train_bpe(texts, vocab_size=400, seed=3, sample_chars=3000).to_str()
                for _ in range(2))
    assert one == two
    assert train_bpe(texts, vocab_size=400, seed=4, sample_chars=3000).to_str() != one
    tok = tokenizers.Tokenizer.from_str(one)
    assert 258 < tok.get_vocab_size() <= 400  # fewer when the sample runs out of pairs
    assert tok.token_to_id("<|endoftext|>") == 1
    table = token_byte_lengths(tok)
    ids = tok.encode(texts[7]).ids
    assert int(table[ids].sum()) == len(texts[7].encode())  # bytes per token add up
    assert table[0] == table[1] == 0  # the special tokens are no text


def test_tokenizer_is_reused_on_resume_and_retrained_for_a_changed_corpus(tmp_path):
    texts = [f"line {i} of some text, with words\n" * 30 for i in range(30)]
    corpus = _docs(tmp_path, texts)
    out = str(tmp_path / "run")
    argv = ["--data", corpus, "--tokenizer", "bpe", "--bpe-vocab-size", "300", "--out-dir", out]
    first = prepare_corpora(_cfg(argv))
    assert "trained a 300-id byte-level BPE on 27 training documents" in first.notes[0]
    files = [os.path.join(out, f) for f in ("tokenizer.json", "corpus_tokens.npz")]
    stamps = [os.stat(f).st_mtime_ns for f in files]
    again = prepare_corpora(_cfg(argv + ["--resume"]))
    assert again.notes == [f"tokenizer: reusing {files[0]} (trained on this corpus)"]
    assert [os.stat(f).st_mtime_ns for f in files] == stamps  # neither retrained nor re-encoded
    assert _doc_texts(again.train) == _doc_texts(first.train)
    (tmp_path / "corpus" / "doc000.txt").write_text("a changed document\n" * 30)
    changed = prepare_corpora(_cfg(argv + ["--resume"]))
    assert "was trained on another corpus" in changed.notes[0] and "training a new" in changed.notes[0]
    # an unreadable tokenizer.json the run made: an error naming the field, never a silent retrain
    with open(files[0], "w") as f:
        f.write('{"model": {"type": "BPE", "vocab": 3')
    with pytest.raises(ConfigError, match=r"data\.tokenizer: the run's .*tokenizer\.json cannot "
                                          r"be read .*delete it"):
        prepare_corpora(_cfg(argv + ["--resume"]))


# ------------------------------------------------------------------ the trainer, end to end
def test_run_logs_bits_per_byte_and_held_out_eval_and_draws_its_report(tmp_path, capsys):
    out = tmp_path / "run"
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # small\n" * (2 + i % 9) for i in range(40)]
    argv = TINY + ["--data", _docs(tmp_path, texts), "--tokenizer", "bpe", "--bpe-vocab-size",
                   "300", "--eval-docs", "3", "--eval-every", "2", "--out-dir", str(out)]
    main(argv + ["--steps", "3"])
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["bpb"] > 0 for r in records)
    assert [r["step"] for r in records if "eval_bpb" in r] == [2, 3]  # every 2 steps + the last
    held = records[-1]
    assert held["eval_loss"] == pytest.approx(held["eval_bpb"] * math.log(2) * held["eval_bytes"]
                                              / held["eval_tokens"], rel=1e-12)
    assert re.search(r"done: .*bits/byte [\d.]+ \(first 1 step\) -> [\d.]+ \(last 1\); "
                     r"held-out [\d.]+ bits/byte \(step 3\)", printed), printed
    assert "held-out loss" in printed and os.path.isfile(out / "report.png")
    assert f"report: {out / 'report.png'}" in printed
    main(argv + ["--steps", "4", "--resume"])
    assert "tokenizer: reusing" in capsys.readouterr().out


# ------------------------------------------------------------------ plots
def _fake_run(path, steps, *, cp=False, partial=False):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for s in steps:
            rec = {"step": s, "loss": 5 - s / 10, "bpb": 2 - s / 50, "lr": 1e-3, "grad_norm": 1.0,
                   "tokens_per_s_per_gpu": 900.0 + s, "peak_mem_gib": 0.5}
            if s % 5 == 0:
                rec.update(eval_loss=4.9 - s / 10, eval_bpb=2.1 - s / 50)
            if cp:
                rec.update(cp_work=[100.0 + s, 100.0 - s], cp_balance=(100 + s) / 100)
            f.write(json.dumps(rec) + "\n")
        if partial:
            f.write('{"step": 99, "loss": 1.2')  # the line a running trainer is writing


def test_plot_finished_and_partial_runs(tmp_path):
    pytest.importorskip("matplotlib")
    done, running = str(tmp_path / "done"), str(tmp_path / "running")
    _fake_run(done, range(1, 21), cp=True)
    _fake_run(running, range(1, 8), partial=True)
    assert plot.main([done]) == 0 and os.path.getsize(os.path.join(done, "report.png")) > 10_000
    fig = plot.make_figure([done, running])
    labels = {ax.get_title(): (ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes}
    assert labels["loss"] == ("step", "loss (nats / token)")
    assert labels["bits per byte"] == ("step", "bits / byte")
    assert labels["CP balance"] == ("step", "attention work / group mean")
    assert {x for x, _ in labels.values()} == {"step"} and all(y for _, y in labels.values())
    (bpb_ax,) = [ax for ax in fig.axes if ax.get_title() == "bits per byte"]
    names = [line.get_label() for line in bpb_ax.get_lines()]
    assert "running train (each log window)" in names and "done held-out" in names
    (running_line,) = [ln for ln in bpb_ax.get_lines()
                       if ln.get_label() == "running train (each log window)"]
    assert list(running_line.get_xdata()) == list(range(1, 8))  # the half-written line skipped
    out = str(tmp_path / "cmp.png")
    assert plot.main([done, running, "--out", out]) == 0 and os.path.getsize(out) > 10_000


def test_plot_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        plot.main([str(tmp_path)])
    assert exit_.value.code == 2
    assert re.search(r"run_dir=.*: no metrics\.jsonl there", capsys.readouterr().err)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo')
    with pytest.raises(ValueError, match=r"run_dir=.*holds no step record"):
        plot.load_metrics(str(tmp_path))


def test_report_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    _fake_run(str(tmp_path), range(1, 4))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    lines = []
    assert plot.write_report(str(tmp_path), lines.append) is None
    assert len(lines) == 1 and "pip install" in lines[0] and "[plot]" in lines[0]
    assert not os.path.exists(tmp_path / "report.png")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_eval_every_must_be_positive(value):
    with pytest.raises(ConfigError, match=r"train\.eval_every \(--eval-every\)="):
        _cfg(["--eval-every", value])


def test_eval_docs_and_bpe_size_bad_values():
    with pytest.raises(ConfigError, match=r"data\.eval_docs \(--eval-docs\)=-1"):
        _cfg(["--eval-docs", "-1"])
    with pytest.raises(ConfigError, match=r"data\.bpe_vocab_size=100"):
        _cfg(["--bpe-vocab-size", "100"])


# ------------------------------------------------------------------ plots of damaged or odd inputs (round 3)

@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("logged")
    rec = {"step": 1, "loss": 5.0, "lr": 1e-3, "tokens_per_s_per_gpu": 10.0, "peak_mem_gib": 0.1}
    (d / "metrics.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "step": 2}) + "\n")
    return d


def test_plot_out_without_extension_names_the_file_written(logged_run, tmp_path):
    pytest.importorskip("matplotlib")
    from cp_rope.launch.plot import plot_runs
    target = tmp_path / "report"
    assert plot_runs([str(logged_run)], str(target)) == str(target) + ".png"
    assert os.path.isfile(str(target) + ".png")
    with pytest.raises(ValueError, match=r"out=.*is a directory"):
        plot_runs([str(logged_run)], str(tmp_path))


def test_plot_damaged_metrics_says_damaged(tmp_path):
    from cp_rope.launch.plot import load_metrics
    (tmp_path / "metrics.jsonl").write_text("{not json\n{nor this\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: 2 lines are not JSON records"):
        load_metrics(str(tmp_path))
