"""transformers GPT-2 language models with dropout and tied embeddings (random weights, no
download): a tiny one for tests and demos, and GPT-2 small and medium at their published
sizes for the benchmarks (trace those on the meta device: ``with torch.device("meta")``)."""

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

#: GPT-2's byte-pair vocabulary and context length (Radford et al. 2019; transformers' defaults).
GPT2_VOCAB = 50257
GPT2_POSITIONS = 1024
#: Tokens per sequence of the benchmark workloads (half of GPT-2's context).
GPT2_SEQUENCE = 512
#: (layers, width, heads) of the published sizes.
GPT2_SMALL = (12, 768, 12)
GPT2_MEDIUM = (24, 1024, 16)


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # An explicit all-ones attention mask: without one, GPT-2's masking code branches on
    # tensor values, which cannot be traced.
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def gpt2_lm(batch_size: int, *, name: str, layers: int, width: int, heads: int, vocab: int, sequence: int,
            positions: int | None = None, dropout: float = DROPOUT) -> Workload:
    """A GPT-2 language model of the given size on random token ids of shape
    ``(batch_size, sequence)``, in train mode, dropout ``dropout`` everywhere, the language-model
    head tied to the token embedding. Tensors go to the default device (``torch.device("meta")``
    as a context manager builds it without allocating)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions or sequence,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    batch = (torch.randint(0, vocab, (batch_size, sequence)),)
    return Workload(name, model, batch, _lm_loss)


def gpt2_tiny(batch_size: int) -> Workload:
    """GPT-2 with ``LAYERS`` layers of width ``WIDTH``, dropout ``DROPOUT`` everywhere, and the
    language-model head tied to the token embedding."""
    return gpt2_lm(batch_size, name="gpt2-tiny", layers=LAYERS, width=WIDTH, heads=HEADS, vocab=VOCAB,
                   sequence=SEQUENCE)


def gpt2_small(batch_size: int) -> Workload:
    """GPT-2 small (124M parameters: 12 layers, width 768, 12 heads), sequences of
    ``GPT2_SEQUENCE`` tokens."""
    layers, width, heads = GPT2_SMALL
    return gpt2_lm(batch_size, name="gpt2-small", layers=layers, width=width, heads=heads, vocab=GPT2_VOCAB,
                   sequence=GPT2_SEQUENCE, positions=GPT2_POSITIONS)


def gpt2_medium(batch_size: int) -> Workload:
    """GPT-2 medium (355M parameters: 24 layers, width 1024, 16 heads), sequences of
    ``GPT2_SEQUENCE`` tokens."""
    layers, width, heads = GPT2_MEDIUM
    return gpt2_lm(batch_size, name="gpt2-medium", layers=layers, width=width, heads=heads, vocab=GPT2_VOCAB,
                   sequence=GPT2_SEQUENCE, positions=GPT2_POSITIONS)
