"""Holdout workloads: model families remat was not developed on, at sizes a CPU steps in a
second or two, with random weights (no download). ``bench/holdout.py`` plans and runs them.

They are not built-in names; reach them by factory spec, e.g.
``get_workload("remat.models.holdout:llama", 4)``, or through ``HOLDOUT``.

>>> w = get_workload("remat.models.holdout:gru", 2)
>>> w.loss_fn(w.model, *w.batch).ndim
0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remat.models import Factory, Workload, get_workload  # noqa: F401  (get_workload: the doctest)

#: Tokens per sequence of the language models, and their vocabulary.
SEQUENCE = 128
VOCAB = 1024
#: Image side of the vision models.
IMAGE_SIDE = 64
CLASSES = 10
#: Dropout of every model that has one (transformers' defaults are 0.1 too).
DROPOUT = 0.1


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _ids(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQUENCE))


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # an explicit all-ones mask: transformers' masking code branches on tensor values without one
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss


def llama(batch_size: int) -> Workload:
    """A 2-layer Llama (width 128, 4 heads, 2 key-value heads, SwiGLU 344) as a causal language
    model; Llama has no dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE)
    return Workload("llama", LlamaForCausalLM(config).train(), (_ids(batch_size),), _lm_loss)


def bert(batch_size: int) -> Workload:
    """A 2-layer BERT (width 128, 4 heads) trained as a masked language model on every token,
    dropout ``DROPOUT``."""
    from transformers import BertConfig, BertForMaskedLM

    _quiet()
    config = BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=SEQUENCE, hidden_dropout_prob=DROPOUT,
                        attention_probs_dropout_prob=DROPOUT)

    def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss

    return Workload("bert", BertForMaskedLM(config).train(), (_ids(batch_size),), loss)


def t5(batch_size: int) -> Workload:
    """A T5 with 2 encoder and 2 decoder layers (width 128, 4 heads), sequence to sequence on
    random token ids, dropout ``DROPOUT``."""
    from transformers import T5Config, T5ForConditionalGeneration

    _quiet()
    config = T5Config(vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=512, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=DROPOUT, decoder_start_token_id=0, pad_token_id=0)

    def loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, use_cache=False).loss

    target = torch.randint(1, VOCAB, (batch_size, SEQUENCE // 2))
    return Workload("t5", T5ForConditionalGeneration(config).train(), (_ids(batch_size), target), loss)


def _image_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, IMAGE_SIDE, IMAGE_SIDE), torch.randint(0, CLASSES, (batch_size,))


def _image_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(pixel_values=images).logits, labels)


def vit(batch_size: int) -> Workload:
    """A 4-layer ViT (width 128, 4 heads, 8x8 patches) classifying ``IMAGE_SIDE`` pixel
    images, dropout ``DROPOUT``."""
    from transformers import ViTConfig, ViTForImageClassification

    _quiet()
    config = ViTConfig(image_size=IMAGE_SIDE, patch_size=8, hidden_size=128, num_hidden_layers=4,
                       num_attention_heads=4, intermediate_size=512, num_labels=CLASSES,
                       hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT)
    return Workload("vit", ViTForImageClassification(config).train(), _image_batch(batch_size), _image_loss)


def convnext(batch_size: int) -> Workload:
    """A ConvNext with stages of depth 2, 2, 4, 2 and widths 16 to 128 on ``IMAGE_SIDE`` pixel
    images (depthwise 7x7 convolutions, channels-last layer norms)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    _quiet()
    config = ConvNextConfig(num_channels=3, hidden_sizes=[16, 32, 64, 128], depths=[2, 2, 4, 2], num_labels=CLASSES)
    return Workload("convnext", ConvNextForImageClassification(config).train(), _image_batch(batch_size), _image_loss)


class GruLanguageModel(nn.Module):
    """Embedding, a 2-layer GRU, dropout, a linear head over the vocabulary. The dropout sits
    outside the GRU: dropout between a GRU's own layers is not traceable faithfully (remat
    refuses it)."""

    def __init__(self, width: int = 128, vocab: int = VOCAB // 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, num_layers=2, batch_first=True)
        self.drop = nn.Dropout(DROPOUT)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.rnn(self.embed(ids))[0]))


def gru(batch_size: int) -> Workload:
    """``GruLanguageModel`` predicting the next token of random sequences of ``SEQUENCE // 16``
    steps (the GRU traces to one cell per step and layer: about 130 ops a step)."""

    model = GruLanguageModel().train()
    vocab = model.head.out_features

    def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))

    ids = torch.randint(0, vocab, (batch_size, SEQUENCE // 16))
    return Workload("gru", model, (ids,), loss)


#: Holdout name -> (factory, batch size the benchmark runs it at).
HOLDOUT: dict[str, tuple[Factory, int]] = {
    "llama": (llama, 4),
    "bert": (bert, 4),
    "t5": (t5, 4),
    "vit": (vit, 16),
    "convnext": (convnext, 24),
    "gru": (gru, 64),
}
