"""Model-zoo programs: neuraloperator (FNO, TFNO, UNO) and transformers models built from small
configs (random weights, nothing downloaded), trained as their docs write it."""

from __future__ import annotations

import torch

from .harness import Built, Program

# --- neuraloperator ----------------------------------------------------------------------------


def _darcy_like(batch: int = 4, res: int = 16):
    a = torch.randn(4, batch, 1, res, res)
    u = torch.randn(4, batch, 1, res, res) * 0.1
    return a, u


def neuralop_fno_darcy() -> Built:
    """neuraloperator "Training an FNO on Darcy-Flow": FNO(n_modes=(8, 8)), LpLoss(d=2, p=2),
    AdamW; the Trainer's inner step written out (loss on a batch, backward, step)."""
    from neuralop import LpLoss
    from neuralop.models import FNO

    model = FNO(
        n_modes=(8, 8),
        in_channels=1,
        out_channels=1,
        hidden_channels=8,
        projection_channel_ratio=2,
        n_layers=2,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-3, weight_decay=1e-4)
    l2loss = LpLoss(d=2, p=2)
    a, u = _darcy_like()

    def train_step(x, y):
        out = model(x)
        return l2loss(out, y)

    return Built(train_step, lambda k: (a[k], u[k]), [model], optimizer)


def neuralop_tfno_h1() -> Built:
    """TFNO (Tucker-factorized spectral weights, via tensorly) trained with H1Loss, as the
    Darcy-Flow example's TFNO variant."""
    from neuralop import H1Loss
    from neuralop.models import TFNO

    model = TFNO(
        n_modes=(6, 6),
        in_channels=1,
        out_channels=1,
        hidden_channels=8,
        n_layers=2,
        factorization="tucker",
        rank=0.42,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=8e-3)
    h1loss = H1Loss(d=2)
    a, u = _darcy_like()

    def train_step(x, y):
        return h1loss(model(x), y)

    return Built(train_step, lambda k: (a[k], u[k]), [model], optimizer)


def neuralop_fno_1d_autoregressive() -> Built:
    """A 1-D FNO rolled out autoregressively for 3 steps (a simulation surrogate), MSE."""
    from neuralop.models import FNO

    model = FNO(n_modes=(8,), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    u0 = torch.randn(4, 2, 1, 32)
    target = torch.randn(4, 2, 1, 32) * 0.1

    def train_step(u, target):
        for _ in range(3):
            u = u + 0.1 * model(u)
        return torch.nn.functional.mse_loss(u, target)

    return Built(train_step, lambda k: (u0[k], target[k]), [model], optimizer)


# --- transformers ------------------------------------------------------------------------------


def _tokens(vocab: int, batch: int = 2, length: int = 12):
    return torch.randint(5, vocab, (4, batch, length))


def transformers_bert_mlm() -> Built:
    """BertForMaskedLM from a small BertConfig; labels -100 except masked positions; AdamW."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = BertForMaskedLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    ids = _tokens(64)
    mask = torch.rand(ids.shape) < 0.15
    inputs = ids.masked_fill(mask, 4)  # [MASK]
    labels = ids.masked_fill(~mask, -100)
    attention_mask = torch.ones_like(ids)

    def train_step(input_ids, attention_mask, labels):
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return outputs.loss

    return Built(
        train_step, lambda k: (inputs[k], attention_mask[k], labels[k]), [model], optimizer
    )


def transformers_gpt2_lm() -> Built:
    """GPT2LMHeadModel from a small GPT2Config, labels=input_ids (causal LM), AdamW."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    ids = _tokens(64)

    def train_step(input_ids):
        outputs = model(input_ids, labels=input_ids)
        return outputs.loss

    return Built(train_step, lambda k: (ids[k],), [model], optimizer)


def transformers_llama_lm() -> Built:
    """LlamaForCausalLM (RoPE, RMSNorm, grouped-query attention, SiLU MLP, no biases) from a
    tiny LlamaConfig, AdamW."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    ids = _tokens(64)

    def train_step(input_ids):
        return model(input_ids=input_ids, labels=input_ids).loss

    return Built(train_step, lambda k: (ids[k],), [model], optimizer)


def transformers_vit_classification() -> Built:
    """ViTForImageClassification from a tiny ViTConfig, labels given, AdamW."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    model = ViTForImageClassification(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    pixels, labels = torch.randn(4, 2, 3, 16, 16), torch.randint(0, 3, (4, 2))

    def train_step(pixel_values, labels):
        return model(pixel_values=pixel_values, labels=labels).loss

    return Built(train_step, lambda k: (pixels[k], labels[k]), [model], optimizer)


PROGRAMS = [
    Program(
        "neuralop_fno_darcy",
        "neuraloperator",
        "neuralop",
        neuralop_fno_darcy,
        "FNO 2-D (n_modes 8x8), LpLoss, AdamW",
    ),
    Program(
        "neuralop_tfno_h1",
        "neuraloperator",
        "neuralop",
        neuralop_tfno_h1,
        "TFNO (Tucker-factorized, tensorly), H1Loss, Adam",
    ),
    Program(
        "neuralop_fno_1d_rollout",
        "neuraloperator",
        "neuralop",
        neuralop_fno_1d_autoregressive,
        "FNO 1-D rolled out 3 steps, MSE, Adam",
    ),
    Program(
        "transformers_bert_mlm",
        "transformers",
        "transformers",
        transformers_bert_mlm,
        "BertForMaskedLM(BertConfig small), masked-LM loss, AdamW",
    ),
    Program(
        "transformers_gpt2_lm",
        "transformers",
        "transformers",
        transformers_gpt2_lm,
        "GPT2LMHeadModel(GPT2Config small), causal-LM loss, AdamW",
    ),
    Program(
        "transformers_llama_lm",
        "transformers",
        "transformers",
        transformers_llama_lm,
        "LlamaForCausalLM(LlamaConfig tiny): RoPE, RMSNorm, GQA, AdamW",
    ),
    Program(
        "transformers_vit_cls",
        "transformers",
        "transformers",
        transformers_vit_classification,
        "ViTForImageClassification(ViTConfig tiny), AdamW",
    ),
]
