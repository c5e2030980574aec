"""The native model (cp_rope.launch.model.Transformer) refusing bad input, naming it.

(Round 3 of the bad-input catalogue; the model's parity under CP is tests/test_pretrain_parity.py,
its fused loss and tiled MLP tests/test_loss_model.py.)
"""

from __future__ import annotations

import pytest
import torch


def test_native_model_input_id_outside_vocab():
    from cp_rope.launch.config import ModelConfig
    from cp_rope.launch.model import Transformer
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                    ffn_hidden_dim=64, vocab_size=50, max_seq_len=64))
    ids = torch.randint(0, 50, (8,))
    ids[5] = 50
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"input_ids holds token id 50.*\[0, 50\)"):
        model(ids, model.attention_plan(cu, 8))
