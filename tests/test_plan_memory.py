"""The memory model and planner (cp_rope.launch.plan_memory): its arithmetic, its calibration
against issue 21's measured peaks, the choice, the --memory auto hook and the command line."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from cp_rope.launch.config import ConfigError, PretrainConfig, preset
from cp_rope.launch.plan_memory import (
    GIB,
    Settings,
    Shapes,
    auto_settings,
    choose,
    estimate,
    main,
    step_seconds,
)

S = Shapes(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, vocab=100)


def test_the_arithmetic_by_component():
    """Hand-counted bytes of a tiny model: FSDP2 shards, saved tensors per mode, offload, CP, and
    which of the two phases (the loss; the first backward layer) is the peak."""
    p = 3 * (64 * (2 * 64 + 2 * 32) + 3 * 64 * 96 + 128) + 2 * 100 * 64 + 64
    assert S.params == p
    everything = 2 * (4 * 64 + 2 * 64 + 2 * 32) + 16 + 8 + 8 * 96  # one layer, untiled
    grads = 2 * 64 + 2 * (64 + 2 * 32) + 2 * 64  # dout, dq/dk/dv, the residual's gradient
    workspace = 3 * 4 * 4 * 17  # cuDNN's backward: three fp32 [T, Hq, D + 1]
    unfused = 1000 * 100 * 12
    fused = 1000 * 100 * 8 + 1000 * 64 * 2 + 4 * 100 * 64  # one chunk, dhidden, fp32 dW
    full = estimate(S, Settings(activation_checkpointing="full", fused_loss=False), tokens=1000,
                    dp=2)
    assert full["optimizer"] == 8 * p // 2 and full["parameters"] >= 4 * p // 2
    # the loss phase (3 layer inputs + 3 between, the logits: 1.97 MB) < the layer phase:
    assert 1000 * (3 * 128 + 3 * 128) + unfused < 1000 * 2 * 128 + 1000 * (everything + 4 * 96)
    assert full["saved activations"] == 1000 * 2 * 128  # the other two layers' inputs
    assert full["layer working set"] == 1000 * (everything + 4 * 96)  # its MLP backward (> attn)
    assert 1000 * (everything - 4 * 64 - 8 * 96 + grads + workspace) < full["layer working set"]
    assert full["loss"] == 0
    none = estimate(S, Settings(fused_loss=False), tokens=1000, dp=2)  # the loss phase peaks
    assert none["saved activations"] == 1000 * (3 * everything + 3 * 2 * 64)
    assert none["layer working set"] == 0 and none["loss"] == unfused
    sel = estimate(S, Settings(activation_checkpointing="selective"), tokens=1000)
    assert sel["saved activations"] == 1000 * 2 * (2 * 64 + 2 * 64 + 16)
    assert sel["layer working set"] == 1000 * (everything + 4 * 96) and sel["loss"] == 0
    off = estimate(S, Settings(offload_activations=True), tokens=1000)  # two layers on the GPU
    assert off["saved activations"] == 1000 * (2 * everything + 3 * 2 * 64)
    # the last layer stays on the GPU: two of the three layers in host memory
    assert off["loss"] == fused and off["host (pinned)"] == 1000 * 2 * everything
    long = estimate(S, Settings(activation_checkpointing="full", mlp_tile_tokens=256),
                    tokens=1 << 20)  # tiled: the attention backward is the layer's peak
    tiled = everything - 8 * 96
    assert long["layer working set"] == (1 << 20) * (tiled - 4 * 64 + grads + workspace)
    half = estimate(S, Settings(), tokens=1000, cp=2)
    assert half["saved activations"] == estimate(S, Settings(), tokens=500)["saved activations"]
    assert half["communication"] > 0 == estimate(S, Settings(), tokens=1000)["communication"]
    assert all(v >= 0 for v in full.values())
    assert full["total"] == sum(v for k, v in full.items() if k not in ("total", "host (pinned)"))


def test_the_order_of_the_modes_and_knobs():
    big = dict(tokens=65536)
    m = {mode: estimate(S, Settings(activation_checkpointing=mode), **big)["total"]
         for mode in ("none", "selective", "full")}
    assert m["none"] > m["selective"] > m["full"]
    tiled = estimate(S, Settings(mlp_tile_tokens=1024), **big)
    assert tiled["saved activations"] < estimate(S, Settings(), **big)["saved activations"]
    wide = Shapes(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, vocab=150000)
    assert estimate(wide, Settings(fused_loss=True), **big)["loss"] < \
        estimate(wide, Settings(fused_loss=False), **big)["loss"] / 10


@pytest.mark.parametrize("mode,tokens,measured_gib", [
    ("none", 65536, 103.5), ("full", 131072, 34.5), ("full", 262144, 59.2)])
def test_calibration_against_issue_21s_h200_peaks(mode, tokens, measured_gib):
    """--preset 1b on one H200 (torch 2.11, bf16, FSDP2, unfused loss, untiled MLP, measured
    before the fused SwiGLU: PyTorch's eager product): within 10%."""
    s = dataclasses.replace(Shapes.from_model_config(preset("1b").model), fused_swiglu=False)
    got = estimate(s, Settings(activation_checkpointing=mode, fused_loss=False), tokens=tokens)
    assert abs(got["total"] / GIB / measured_gib - 1) < 0.10, got["total"] / GIB


def test_choose_takes_the_fastest_setting_that_fits_and_says_what_it_would_need():
    s = Shapes.from_model_config(preset("1b").model)
    st, est = choose(s, tokens=8192, gpu_bytes=141 * 10**9)
    assert st.activation_checkpointing == "none" and not st.offload_activations
    st, est = choose(s, tokens=262144, gpu_bytes=40 * GIB, headroom=1.0)
    assert est["total"] <= 40 * GIB  # by saving memory (none alone needs more):
    assert st.activation_checkpointing != "none" or st.offload_activations
    assert estimate(s, Settings(), tokens=262144)["total"] > 40 * GIB
    with pytest.raises(ConfigError, match=r"nothing fits 4,194,304 tokens .* needs [\d.]+ GiB "
                                          r"per GPU; use a larger --cp-size"):
        choose(s, tokens=1 << 22, gpu_bytes=40 * GIB)
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        estimate(s, Settings(), tokens=0)
    with pytest.raises(ValueError, match="activation_checkpointing='most'"):
        estimate(s, Settings(activation_checkpointing="most"), tokens=8)


HOST = 100 * GIB  # pinned host memory per GPU for --memory auto (its default: this machine's share)


def test_memory_auto_sets_the_flags():
    cfg = PretrainConfig()
    cfg.model.vocab_size, cfg.model.memory = 320, "auto"
    cfg.data.tokens_per_batch = 1 << 20
    import torch

    out, note = auto_settings(cfg, torch.device("cuda"), dp=1, cp=1, host_bytes=HOST, gpu_bytes=8 * GIB,
                              loss_kernel="torch")
    assert out.model.memory == "manual" and "memory=auto: --activation-checkpointing" in note
    assert out.model.activation_checkpointing != "none" or out.model.offload_activations
    same, note = auto_settings(cfg, torch.device("cpu"), dp=1, cp=1)
    assert same is cfg and "cpu" in note
    with pytest.raises(ConfigError, match="memory=auto: nothing fits"):
        auto_settings(cfg, torch.device("cuda"), dp=1, cp=1, host_bytes=HOST, gpu_bytes=1 << 20,
                      loss_kernel="torch")


def test_command_line(tmp_path, capsys):
    out = main(["--preset", "1b", "--seq-len", "1048576", "--cp-size", "8"])
    text = capsys.readouterr().out
    assert "cp 8 x dp 1, per GPU" in text and "saved activations" in text
    assert out["estimate"]["total"] <= 0.88 * 141e9
    cfg = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = Shapes.from_hf_dir(str(tmp_path))
    assert (s.head_dim, s.tied, s.qk_norm) == (128, True, True)
    out = main(["--model", str(tmp_path), "--seq-len", "262144", "--activation-checkpointing",
                "full", "--offload-activations"])
    assert out["settings"]["offload_activations"] and out["estimate"]["host (pinned)"] > 0
    main(["--preset", "8b", "--seq-len", "8192", "--activation-checkpointing", "full"])
    assert "(peak: the optimizer step" in capsys.readouterr().out  # 16 P / N beats both phases
    out = main(["--preset", "8b", "--seq-len", "1048576", "--gpu-memory-gib", "80"])
    assert out["settings"] is None and "needs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--preset", "1b", "--seq-len", "0"])
    with pytest.raises(ConfigError, match="no config.json"):
        Shapes.from_hf_dir(str(tmp_path / "nothing"))


QWEN3_SHAPED = Shapes(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=128, ffn=3072,
                      vocab=151936, tied=True, qk_norm=True)


@pytest.mark.parametrize("model,tokens,flags,measured_gib", [
    ("1b", 262144, ("selective", True, 16384), 30.6),
    ("1b", 524288, ("selective", True, 16384), 43.0),
    ("qwen3", 32768, ("none", False, 0), 17.1),
    ("qwen3", 131072, ("selective", True, 16384), 12.57),
    ("qwen3", 262144, ("selective", True, 16384), 20.91),
    ("qwen3", 262144, ("selective", False, 16384), 29.6),
    ("qwen3", 1048576, ("full", True, 16384), 66.6),
])
def test_calibration_against_round_2_h200_peaks(model, tokens, flags, measured_gib):
    """docs/benchmarks.md, Memory (rounds 1, 2 and 4): every peak scripts/bench_memory.py measured
    on one H200 (the Qwen3 shape's since round 4's fix of the cuDNN frontend's kept cycle) within
    10%, the two-phase model of round 4 (the loss; the first backward layer)."""
    s = Shapes.from_model_config(preset("1b").model) if model == "1b" else QWEN3_SHAPED
    mode, offload, tile = flags
    st = Settings(activation_checkpointing=mode, offload_activations=offload, mlp_tile_tokens=tile)
    got = estimate(s, st, tokens=tokens, doc_len=tokens if model == "1b" else 16384)
    assert abs(got["total"] / GIB / measured_gib - 1) < 0.10, got["total"] / GIB


def test_fused_swiglu_keeps_one_ffn_tensor_less_and_matches_round_11s_peak():
    """The fused SwiGLU keeps gate and up but no silu(gate): 2 bytes x ffn per token per untiled
    layer less; bench_memory's Qwen3 shape, none at 32,768 tokens, peaked at 16.48 GiB with it
    and Liger's loss (docs/benchmarks.md, round 11, H100; 17.97 GiB with PyTorch's product):
    within 10%."""
    fused = dataclasses.replace(QWEN3_SHAPED, fused_swiglu=True)
    kw = dict(tokens=32768, doc_len=16384)
    got, eager = (estimate(s, Settings(loss_impl="liger"), **kw) for s in (fused, QWEN3_SHAPED))
    t, f, n = 32768, QWEN3_SHAPED.ffn, QWEN3_SHAPED.n_layers
    assert eager["saved activations"] - got["saved activations"] == n * t * 2 * f
    assert abs(got["total"] / GIB / 16.48 - 1) < 0.10, got["total"] / GIB
    tiled = Settings(activation_checkpointing="selective", mlp_tile_tokens=4096)
    assert estimate(fused, tiled, **kw) == estimate(QWEN3_SHAPED, tiled, **kw)  # nothing kept


def test_liger_loss_is_priced_by_its_own_chunks(capsys):
    """Liger's fused loss holds one chunk of [chunk, V] bf16 logits (its gradient written in
    place) of liger_chunk_tokens tokens, not the torch loop's [chunk, V] float32 logits and
    gradient: bench_memory's Qwen3 shape at 32,768 tokens, 4,096 x 151,936 x 2 bytes against
    768 x 151,936 x 8; the 1,000-token tiny model (V = 5,000), one chunk of 1,000 rows."""
    from cp_rope.parallel._loss_impl import liger_chunk_tokens

    t, v, d = 32768, QWEN3_SHAPED.vocab, QWEN3_SHAPED.dim
    rest = t * d * 2 + 4 * v * d  # dhidden, fp32 dW
    kw = dict(tokens=t, doc_len=16384)
    assert liger_chunk_tokens(t, v, d) == 4096
    assert estimate(QWEN3_SHAPED, Settings(loss_impl="liger"), **kw)["loss"] == 4096 * v * 2 + rest
    assert estimate(QWEN3_SHAPED, Settings(), **kw)["loss"] == 768 * v * 8 + rest
    wide = dataclasses.replace(S, vocab=5000)  # the loss phase peaks
    tiny = estimate(wide, Settings(loss_impl="liger"), tokens=1000)
    assert tiny["loss"] == 1000 * 5000 * 2 + 1000 * 64 * 2 + 4 * 5000 * 64
    argv = ["--preset", "tiny", "--vocab-size", "151936", "--seq-len", "32768",
            "--activation-checkpointing", "none"]
    assert main(argv + ["--loss-impl", "liger"])["estimate"]["loss"] > \
        main(argv)["estimate"]["loss"] > 0
    liger, torch_loop = capsys.readouterr().out.split("tokens/step")[1:]
    assert "(peak: the loss; the fused loss by liger)" in liger
    assert "(peak: the loss; the fused loss by torch)" in torch_loop
    with pytest.raises(ValueError, match="loss_impl='auto': expected torch or liger"):
        estimate(S, Settings(loss_impl="auto"), tokens=8)
    with pytest.raises(ValueError, match="n_tokens must be an int >= 1"):
        liger_chunk_tokens(0, v, d)


def test_memory_auto_holds_the_flags_given_and_prices_the_runs_loss():
    """--memory auto chooses only the memory flags left at their defaults: one given
    (--activation-checkpointing selective, --mlp-tile-tokens 4096) is held where the search
    alone picks none and no tiling, and the log line says so; the loss is priced for the
    kernel the run uses (loss_kernel; --loss-chunk-size for the torch loop)."""
    import torch

    cfg = PretrainConfig()
    cfg.model.vocab_size, cfg.model.memory = 151936, "auto"
    cfg.data.tokens_per_batch = cfg.data.seq_len = 8192
    cuda, big = torch.device("cuda"), 141 * 10**9
    free, _ = auto_settings(cfg, cuda, dp=1, cp=1, host_bytes=HOST, gpu_bytes=big, loss_kernel="torch")
    assert (free.model.activation_checkpointing, free.model.mlp_tile_tokens) == ("none", 0)
    cfg.model.activation_checkpointing, cfg.model.mlp_tile_tokens = "selective", 4096
    held, note = auto_settings(cfg, cuda, dp=1, cp=1, host_bytes=HOST, gpu_bytes=big, loss_kernel="torch")
    assert (held.model.activation_checkpointing, held.model.mlp_tile_tokens) == ("selective",
                                                                                 4096)
    assert held.model.memory == "manual"
    assert "held: --activation-checkpointing selective --mlp-tile-tokens 4096" in note
    s = Shapes.from_model_config(held.model)
    peak = {(k, c): estimate(s, Settings(activation_checkpointing="selective", mlp_tile_tokens=4096,
                                    loss_impl=k, loss_chunk_size=c), tokens=8192,
                        doc_len=8192)["total"]
            for k, c in (("torch", 0), ("liger", 0), ("torch", 256))}
    assert len(set(peak.values())) == 3  # the three loss prices differ here
    for kernel, chunk in (("torch", 0), ("liger", 0), ("torch", 256)):
        cfg.model.loss_chunk_size = chunk
        _, note = auto_settings(cfg, cuda, dp=1, cp=1, host_bytes=HOST, gpu_bytes=big, loss_kernel=kernel)
        assert f"predicted peak {peak[kernel, chunk] / GIB:.1f} of" in note, (kernel, note)
    for bad, match in ((dict(gpu_bytes=0), "gpu_bytes must be > 0, got 0"),
                       (dict(gpu_bytes=big, host_bytes=-1), "host_bytes must be >= 0, got -1")):
        with pytest.raises(ValueError, match=match):
            choose(s, tokens=8, **bad)
    with pytest.raises(ValueError, match="given=.*expected loss_impl"):
        choose(s, tokens=8, gpu_bytes=big, given={"fused_loss": False})


def test_memory_auto_chooses_a_presets_memory_knobs_and_holds_the_flags_given(tmp_path):
    """A fresh user's try: --preset 8b --memory auto held the preset's own
    --activation-checkpointing full as if given (the planner would pick selective + offload +
    tiled). parse_args resets the memory knobs no flag or --config file gives to the trainers'
    defaults under --memory auto; a flag or the file holds one; --memory manual keeps the
    preset's."""
    import torch

    from cp_rope.launch.cli import parse_args

    base = ["--preset", "8b"]
    assert parse_args(base).model.activation_checkpointing == "full"  # manual: the preset's
    auto = parse_args(base + ["--memory", "auto"]).model
    assert (auto.activation_checkpointing, auto.offload_activations, auto.mlp_tile_tokens,
            auto.fused_loss) == ("none", False, 0, True)
    for flags in (["--activation-checkpointing", "full"], ["--activation-checkpointing=full"],
                  ["--activation-checkpointing"]):  # a bare flag is full
        assert parse_args(base + ["--memory", "auto"] + flags).model.activation_checkpointing \
            == "full", flags
    kept = parse_args(base + ["--memory", "auto", "--no-fused-loss", "--mlp-tile-tokens", "512"])
    assert (kept.model.fused_loss, kept.model.mlp_tile_tokens) == (False, 512)
    # tyro takes snake-case spellings too: they were reset as if not given
    snake = parse_args(base + ["--memory", "auto", "--no_fused_loss", "--mlp_tile_tokens=512",
                               "--activation_checkpointing"])
    assert (snake.model.fused_loss, snake.model.mlp_tile_tokens,
            snake.model.activation_checkpointing) == (False, 512, "full")
    with pytest.raises(ConfigError, match="train.eval_every"):  # read from argv, as the others
        parse_args(["--eval_every", "10", "--eval_docs", "0"])
    (tmp_path / "run.json").write_text(json.dumps({"model": {"offload_activations": True}}))
    filed = parse_args(base + ["--memory", "auto", "--config", str(tmp_path / "run.json")]).model
    assert filed.offload_activations and filed.activation_checkpointing == "none"
    cfg = dataclasses.replace(parse_args(base + ["--memory", "auto"]), data=dataclasses.replace(
        preset("8b").data, seq_len=131072, tokens_per_batch=131072))
    _, note = auto_settings(cfg, torch.device("cuda"), dp=1, cp=1, host_bytes=HOST, gpu_bytes=140 * GIB,
                            loss_kernel="torch")
    assert "held" not in note and "--activation-checkpointing full" not in note, note
    same, note = auto_settings(cfg, torch.device("cpu"), dp=1, cp=1)  # says what runs
    assert same is cfg and "a cpu run, nothing planned: --activation-checkpointing none" in note


def test_memory_auto_keeps_what_the_run_needs():
    """A fresh user's try: with --loss-impl torch (the fused loss's kernel) --memory auto chose
    --no-fused-loss at 1,024 tokens of a 128K vocabulary, which validate() refuses; a held
    tiled MLP of a mixture of experts was kept, for the trainer to refuse later. The fused loss
    is now held for a --loss-impl other than auto and the choice passes validate; the tiled
    MoE is refused naming mlp_tile_tokens."""
    import torch

    from cp_rope.launch.config import validate

    cfg = preset("1b")
    cfg.model.memory, cfg.model.vocab_size = "auto", 128256
    cfg.data.seq_len = cfg.data.tokens_per_batch = 1024
    free, _ = auto_settings(cfg, torch.device("cuda"), dp=1, cp=1, host_bytes=HOST, gpu_bytes=80 * GIB,
                            loss_kernel="torch")
    assert not free.model.fused_loss  # auto's loss: the unfused one is leaner here
    cfg.parallel.loss_impl = "torch"
    out, note = auto_settings(cfg, torch.device("cuda"), dp=1, cp=1, host_bytes=HOST, gpu_bytes=80 * GIB,
                              loss_kernel="torch")
    assert out.model.fused_loss and "held" not in note, note
    validate(out, 1)
    cfg.parallel.loss_impl, cfg.model.loss_chunk_size = "auto", 512  # the torch loop's chunks
    out, _ = auto_settings(cfg, torch.device("cuda"), dp=1, cp=1, host_bytes=HOST, gpu_bytes=80 * GIB,
                           loss_kernel="torch")
    assert out.model.fused_loss
    validate(out, 1)
    cfg.model.loss_chunk_size = 0
    moe = Shapes(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, vocab=100,
                 n_experts=4, experts_per_tok=2)
    cfg.model.mlp_tile_tokens = 256
    with pytest.raises(ConfigError, match="mlp_tile_tokens=256: a mixture-of-experts"):
        auto_settings(cfg, torch.device("cuda"), dp=1, cp=1, shapes=moe, host_bytes=HOST, gpu_bytes=80 * GIB,
                      loss_kernel="torch")


def test_nothing_fits_names_host_memory_when_that_is_the_limit(capsys):
    """A fresh user's try: every setting that fit the GPU offloaded more than
    --host-memory-gib, and the error blamed the GPU ("needs 26.5 GiB" of 1000). It now names
    the host memory and the offload; the GPU-bound error names tokens per step by both
    programs' flags. plan_memory --activation-checkpointing says whether the setting fits."""
    s = Shapes.from_model_config(preset("1b").model)
    with pytest.raises(ConfigError, match=r"and 1\.0 GiB of pinned host memory per GPU: the "
                       r"settings that fit the GPU offload, the leanest .* [\d.]+ GiB per GPU "
                       r"to the host; allow more host memory"):
        choose(s, tokens=262144, gpu_bytes=1000 * GIB, host_bytes=GIB,
               fixed={"offload_activations": True})
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB per GPU; .*--tokens-per-batch, "
                                          r"plan_memory's --seq-len"):
        choose(s, tokens=1 << 22, gpu_bytes=40 * GIB)
    argv = ["--preset", "1b", "--seq-len", "262144", "--activation-checkpointing"]
    out = main(argv + ["--offload-activations", "--host-memory-gib", "1"])
    assert out["settings"]["activation_checkpointing"] == "full" and not out["fits"]
    assert "does NOT fit: " in capsys.readouterr().out
    assert not main(argv + ["--gpu-memory-gib", "10"])["fits"]
    assert main(argv + ["--offload-activations"])["fits"]
    assert "fits 131.3 GiB per GPU (88% usable)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(argv + ["--loss-impl", "liger", "--no-fused-loss"])
    assert "is for the fused loss only" in capsys.readouterr().err


@pytest.mark.parametrize("model_type,act,experts,fused", [
    ("qwen3", "silu", 0, True), ("llama", "silu", 0, True), ("qwen3", "gelu", 0, False),
    ("phi3", "silu", 0, False), ("qwen3_moe", "silu", 8, False), ("gemma2", "silu", 0, True),
    ("gemma2", "gelu_pytorch_tanh", 0, False)])
def test_from_hf_dir_says_whether_the_mlp_is_fused(tmp_path, model_type, act, experts, fused):
    """As cp_rope.hf.tiled_mlp.swiglu_mlps fuses (Gemma's activation is hidden_activation);
    a mixture of experts keeps the eager count (over, not under); plan_memory's
    --no-fused-swiglu, as finetune_hf's, gives the eager count."""
    pytest.importorskip("transformers")
    cfg = dict(model_type=model_type, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
               vocab_size=256, hidden_act=act, hidden_activation=act,
               attn_logit_softcapping=None)  # Gemma 2's default soft-cap: refused (trainers too)
    if experts:
        cfg.update(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=32)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert Shapes.from_hf_dir(str(tmp_path)).fused_swiglu is fused
    assert Shapes.from_hf_dir(str(tmp_path), fused_swiglu=False).fused_swiglu is False
    argv = ["--model", str(tmp_path), "--seq-len", "4096", "--activation-checkpointing", "none"]
    on, off = main(argv), main(argv + ["--no-fused-swiglu"])
    saved = 2 * 4096 * 2 * 128 if fused else 0  # 2 layers x T x 2 bytes x ffn
    assert off["estimate"]["saved activations"] - on["estimate"]["saved activations"] == saved


@pytest.mark.slow
def test_memory_timeline_marks_every_layer_and_phase(tmp_path):
    """scripts/memory_timeline.py --tiny (the CPU plumbing of the GPU diagnostic in
    docs/benchmarks.md, Memory round 3): one line per step with every layer's forward and
    backward marks and the step's phases in order, and the garbage-collector probe's report."""
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers")

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, os.path.join(repo, "scripts", "memory_timeline.py"),
                          "--tiny", "--tokens", "8192", "--steps", "2", "--gc-probe"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if " start:" in line]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"], out.stdout[-2000:]
    for line in lines:
        tags = [mark.split(":")[0] for mark in line.split(": ", 1)[1].split()]
        assert tags == ["start", "f0<", "f0>", "f1<", "f1>", "fwd+loss", "b1", "b0", "bwd",
                        "clip", "opt"], line
    assert "\ngc probe: " in out.stdout, out.stdout[-2000:]
    out = subprocess.run([sys.executable, os.path.join(repo, "scripts", "memory_timeline.py"),
                          "--tiny", "--tokens", "8192", "--steps", "1", "--gc-watch", "--gc-save"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "\ngc watch: " in out.stdout and "names [" in out.stdout, out.stdout[-2000:]
    for bad, why in ((["--gc-save"], "give both"), (["--gc-save", "--gc-watch", "--gc-probe"],
                                                     "one at a time")):
        out = subprocess.run([sys.executable, os.path.join(repo, "scripts", "memory_timeline.py"),
                              "--tiny", *bad], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and why in out.stderr, out.stderr[-1000:]


# ------------------------------------------------------------------ the command line's bad flags (round 3)

@pytest.mark.parametrize("flags,match", [
    (["--gpu-memory-gib", "nan"], r"--gpu-memory-gib must be a finite number > 0"),
    (["--gpu-memory-gib", "inf"], r"--gpu-memory-gib must be a finite number > 0"),
    (["--host-memory-gib", "-3"], r"--host-memory-gib must be a finite number >= 0"),
    (["--mlp-tile-tokens", "-1"], r"--mlp-tile-tokens must be >= 0"),
    (["--vocab-size", "-1"], r"--vocab-size must be >= 0"),
    (["--doc-len", "-2"], r"--doc-len must be >= 0"),
    (["--doc-len", "9000"], r"--doc-len must be <= --seq-len"),
    (["--preset", "huge"], r"preset='huge': expected one of"),
    (["--preset", None, "--model", "/nonexistent"], r"model='/nonexistent': no config\.json"),
])
def test_plan_memory_flags(capsys, flags, match):
    from cp_rope.launch.plan_memory import main as plan_memory
    argv = ["--preset", "tiny", "--seq-len", "4096", *flags]
    if None in argv:  # --model instead of --preset
        argv = ["--seq-len", "4096", *flags[2:]]
    with pytest.raises(SystemExit) as exc:
        plan_memory(argv)
    assert exc.value.code == 2
    assert __import__("re").search(match, capsys.readouterr().err)


# ------------------------------------------------------------------ --model DIR: experts, windows, families

_BASE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=32, intermediate_size=512, vocab_size=1000)


def _model_dir(tmp_path, **over):
    d = tmp_path / over.get("model_type", "m")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**_BASE, **over}))
    return str(d)


@pytest.mark.parametrize("over", [
    dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2),
    # MoE on layer 1 only: decoder_sparse_step 2 leaves layers 0, 2 dense, mlp_only_layers 3
    dict(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
         decoder_sparse_step=2, mlp_only_layers=[3]),
    dict(model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, sliding_window=128),
    dict(model_type="llama"),
])
def test_model_dir_counts_every_expert(tmp_path, over):
    """Breaker finding #16: a mixture of experts counted no experts (Mixtral's parameters 5x
    under). Weights, gradients and optimizer states count every expert and the router (the
    model transformers builds from the config, on the meta device, within 0.1 %: attention
    biases and sinks are not modelled); activations count the experts a token runs."""
    transformers = pytest.importorskip("transformers")
    import torch

    path = _model_dir(tmp_path, **over)
    s = Shapes.from_hf_dir(path)
    with torch.device("meta"):
        lm = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(path))
    want = sum(p.numel() for p in lm.parameters())
    assert abs(s.params / want - 1) < 1e-3, (s.params, want)
    st = Settings(activation_checkpointing="none", fused_loss=False)
    est = estimate(s, st, tokens=4096, dp=2)
    assert est["optimizer"] == 8 * s.params // 2
    if over["model_type"] == "llama":
        return
    dense = Shapes.from_hf_dir(_model_dir(tmp_path, model_type="llama"))
    assert s.params > dense.params
    # a token keeps its experts' activations, not all of them
    kept = estimate(s, st, tokens=4096)["saved activations"]
    everyone = estimate(dataclasses.replace(s, experts_per_tok=s.n_experts), st,
                        tokens=4096)["saved activations"]
    assert kept < everyone


def test_model_dir_windows_and_unsupported_families(tmp_path, capsys):
    """Windows read from the config (layer_types, sliding_window) and reported; the windowed
    ring's receive buffers hold halos. Finding #14: an unsupported model_type is one line
    naming the supported families (cp_rope.hf's one list), not a KeyError."""
    pytest.importorskip("transformers")
    from cp_rope.hf import SUPPORTED_FAMILIES

    oss = Shapes.from_hf_dir(_model_dir(tmp_path, model_type="gpt_oss", num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=128))
    assert oss.windows == (128, None, 128, None)
    assert oss.window_note() == "sliding window 128 on 2 of 4 layers"
    mistral = Shapes.from_hf_dir(_model_dir(tmp_path, model_type="mistral", sliding_window=64))
    assert mistral.windows == (64,) * 4
    full = dataclasses.replace(mistral, windows=())
    kw = dict(tokens=65536, cp=4, doc_len=8192)
    kv = mistral.n_kv_heads * mistral.head_dim
    got = estimate(mistral, Settings(), **kw)["communication"]
    assert got == 2 * (8 * 2 * 63) * 2 * kv * 2  # 8 documents x 2 chunks x 63 rows per step
    assert estimate(full, Settings(), **kw)["communication"] == 2 * 16384 * 2 * kv * 2
    mixed = dataclasses.replace(mistral, windows=(64, 64, 64, None))  # the full layer's buffer
    assert estimate(mixed, Settings(), **kw)["communication"] == 2 * 16384 * 2 * kv * 2
    assert step_seconds(mistral, Settings(), **kw) < step_seconds(full, Settings(), **kw)
    main(["--model", _model_dir(tmp_path, model_type="mistral", sliding_window=64),
          "--seq-len", "65536", "--doc-len", "8192", "--cp-size", "4"])
    assert "sliding window 64 on 4 of 4 layers" in capsys.readouterr().out
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64,
                                                  "n_layer": 2, "n_head": 2}))
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(gpt2), "--seq-len", "4096"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "Traceback" not in "\n".join(err)
    assert "model_type 'gpt2' is not supported" in err[-1], err
    assert f"(supported: {', '.join(SUPPORTED_FAMILIES)})" in err[-1]


@pytest.mark.parametrize("flags,match", [
    (["--cp-size", "8", "--seq-len", "1000"],
     r"--seq-len at --cp-size 8: the trainers refuse it: data\.seq_len=1000: must be a "
     r"multiple of 2 \* cp_size = 16 \(zigzag CP chunks\)"),
    (["--cp-size", "8", "--doc-len", "1000"], r"--doc-len at --cp-size 8: .*data\.seq_len=1000"),
])
def test_plan_memory_refuses_the_sequence_the_trainers_refuse(capsys, flags, match):
    """Breaker finding #15: --seq-len 1000 at --cp-size 8 was planned; the trainers refuse it
    (launch.config.check_seq_len, the same message)."""
    from cp_rope.launch.config import check_seq_len

    with pytest.raises(ConfigError) as trainer:
        check_seq_len(1000, 8)
    with pytest.raises(SystemExit) as exc:
        main(["--preset", "tiny", "--seq-len", "4096", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and __import__("re").search(match, err), err
    assert str(trainer.value) in err


@pytest.mark.parametrize("over,match", [
    (dict(model_type="llama", hidden_size=-1024), r"config\.hidden_size=-1024: must be an int >= 1"),
    (dict(model_type="llama", num_attention_heads=8, num_key_value_heads=3),
     r"config\.num_attention_heads=8: must be a multiple of num_key_value_heads=3"),
    (dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=16),
     r"config\.num_experts_per_tok=16: more than the 8 experts"),
    (dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, decoder_sparse_step=0),
     r"config\.decoder_sparse_step=0: must be an int >= 1"),
    (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
          layer_types=["chunked_attention"] * 4), r"config\.layer_types: 'chunked_attention' is not a layer type"),
])
def test_model_dir_with_shapes_no_model_has_is_refused(tmp_path, over, match):
    """Round-4b fresh pass: these planned silently ("-0.46B params ... fits")."""
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match=match):
        Shapes.from_hf_dir(_model_dir(tmp_path, **over))


def test_nothing_fits_exits_non_zero(tmp_path):
    """Issue 35 item 5 / round-4b: "nothing fits" printed with exit status 0; now 2."""
    import subprocess

    cmd = [sys.executable, "-m", "cp_rope.launch.plan_memory", "--preset", "8b", "--seq-len",
           "1048576", "--gpu-memory-gib", "0.001"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "nothing fits" in out.stdout, (out.returncode, out.stdout)
    ok = subprocess.run(cmd[:3] + ["--preset", "1b", "--seq-len", "65536"], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


# ------------------------------------------ setting flags without --activation-checkpointing (round 5)

@pytest.mark.parametrize("flags,held", [
    (["--offload-activations", "--mlp-tile-tokens", "1024", "--no-fused-loss"],
     dict(mlp_tile_tokens=1024, offload_activations=True, fused_loss=False)),
    (["--no-fused-loss"], dict(fused_loss=False)),
    (["--offload-activations"], dict(offload_activations=True)),
    (["--mlp-tile-tokens", "1024"], dict(mlp_tile_tokens=1024)),
    (["--no-offload-activations", "--mlp-tile-tokens", "0", "--fused-loss"],
     dict(offload_activations=False, mlp_tile_tokens=0, fused_loss=True)),
])
def test_plan_memory_holds_the_setting_flags_given_while_choosing(capsys, flags, held):
    """Round 5 #4: without --activation-checkpointing, --mlp-tile-tokens, --offload-activations
    and --no-fused-loss were ignored (the choice and its output byte-identical to the run
    without them; the settings line said --fused-loss after --no-fused-loss). They are held,
    as the trainers run them, and the rest is chosen among the candidates that have them."""
    argv = ["--preset", "1b", "--seq-len", "4096"]
    free = main(argv)
    plain = capsys.readouterr().out
    got = main(argv + flags)
    out = capsys.readouterr().out
    assert {k: got["settings"][k] for k in held} == held, got["settings"]
    st = Settings(**got["settings"])
    assert f"  settings: {st.flags()}  (" in out and f"  held: {' '.join(flags)}" in out, out
    want = choose(Shapes.from_model_config(preset("1b").model), tokens=4096,
                  gpu_bytes=int(141e9), fixed=held)
    assert got["settings"] == dataclasses.asdict(want[0]) and got["estimate"] == want[1]
    if any(free["settings"][k] != v for k, v in held.items()):
        assert out != plain
    if held.get("fused_loss") is False:
        assert "--no-fused-loss" in out.split("settings:")[1].splitlines()[0]


def test_plan_memory_estimate_takes_the_trainers_defaults_for_flags_not_given():
    """With --activation-checkpointing the setting is estimated: flags not given are the
    trainers' defaults (no offload, untiled MLP, fused loss), given ones as given."""
    argv = ["--preset", "tiny", "--seq-len", "4096", "--activation-checkpointing", "none"]
    assert main(argv)["settings"] == dataclasses.asdict(Settings())
    got = main(argv + ["--offload-activations", "--mlp-tile-tokens", "512", "--no-fused-loss"])
    assert got["settings"] == dataclasses.asdict(Settings(
        offload_activations=True, mlp_tile_tokens=512, fused_loss=False))


@pytest.mark.parametrize("extra", [[], ["--activation-checkpointing", "full"]])
def test_plan_memory_refuses_a_tiled_mlp_of_experts_as_the_trainers_do(tmp_path, capsys, extra):
    """Round 5 #4: the trainers refuse --mlp-tile-tokens on a mixture of experts (finetune_hf's
    hf.mlp_tile_tokens; cp_rope.hf.patch_model's mlp_modules): plan_memory refuses it too
    (exit 2, naming the flag), and the chooser (also --memory auto's) never picks a tile there."""
    pytest.importorskip("transformers")
    from cp_rope.launch.plan_memory import candidates

    path = _model_dir(tmp_path, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    with pytest.raises(SystemExit) as exc:
        main(["--model", path, "--seq-len", "4096", "--mlp-tile-tokens", "1024", *extra])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "error: --mlp-tile-tokens=1024: a mixture-of-experts" in err
    moe = Shapes.from_hf_dir(path)
    assert {st.mlp_tile_tokens for st in candidates(moe)} == {0}
    assert {st.mlp_tile_tokens for st in candidates(S)} == {0, 8192}
    got = main(["--model", path, "--seq-len", "4096", "--mlp-tile-tokens", "0", *extra])
    assert got["settings"]["mlp_tile_tokens"] == 0


def test_memory_auto_offloads_only_what_the_machine_can_pin():
    """--memory auto prices offload against this machine's pinned-memory share (HOST_SHARE of
    its RAM over the node's processes, at most 100 GiB): the 1b preset at 262,144 tokens on a
    40 GiB GPU offloads within it, or keeps off offload where the share is too small."""
    import torch

    from cp_rope.launch.plan_memory import HOST_SHARE, host_budget

    assert host_budget(8, 2048 * GIB) == 100 * GIB  # capped as plan_memory's default
    assert host_budget(8, 512 * GIB) == int(HOST_SHARE * 512 * GIB / 8)
    assert host_budget(0, 64 * GIB) == int(HOST_SHARE * 64 * GIB)
    assert host_budget(4, 0) == 100 * GIB  # RAM unknown: the default
    assert 0 < host_budget() <= 100 * GIB
    cfg = dataclasses.replace(PretrainConfig(), data=dataclasses.replace(
        preset("1b").data, seq_len=262144, tokens_per_batch=262144))
    cfg.model = preset("1b").model
    cfg.model.memory = "auto"
    cuda = torch.device("cuda")
    for gpu, host in ((40, 100 * GIB), (40, 20 * GIB), (80, 0)):
        out, note = auto_settings(cfg, cuda, dp=1, cp=1, gpu_bytes=gpu * GIB,
                                  loss_kernel="torch", host_bytes=host)
        shapes = Shapes.from_model_config(out.model)
        st = Settings(**{k: getattr(out.model, k) for k in ("activation_checkpointing",
                                                           "offload_activations",
                                                           "mlp_tile_tokens", "fused_loss")})
        assert estimate(shapes, st, tokens=262144)["host (pinned)"] <= host, (host, note)
        assert ("pinned host memory" in note) == out.model.offload_activations
    assert not out.model.offload_activations  # host 0: no offload
    with pytest.raises(ConfigError, match=r"0.0 GiB of pinned host memory per GPU.*run on nodes "
                                          r"with more memory per GPU \(--memory auto pins at "
                                          r"most 50%"):
        auto_settings(cfg, cuda, dp=1, cp=1, gpu_bytes=40 * GIB, loss_kernel="torch",
                      host_bytes=0)
