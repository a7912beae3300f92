"""A tiny transformers GPT-2 language model with dropout and tied embeddings (random weights,
no download)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from remat.models import Workload

LAYERS = 2
WIDTH = 64
HEADS = 4
VOCAB = 256
SEQUENCE = 32
DROPOUT = 0.1


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # An explicit all-ones attention mask: without one, GPT-2's masking code branches on
    # tensor values, which cannot be traced.
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def gpt2_tiny(batch_size: int) -> Workload:
    """GPT-2 with ``LAYERS`` layers of width ``WIDTH``, dropout ``DROPOUT`` everywhere, and the
    language-model head tied to the token embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQUENCE,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=DROPOUT,
        embd_pdrop=DROPOUT,
        attn_pdrop=DROPOUT,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    batch = (torch.randint(0, VOCAB, (batch_size, SEQUENCE)),)
    return Workload("gpt2-tiny", model, batch, _lm_loss)
