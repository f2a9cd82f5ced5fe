"""What a zoo workload trains on: random inputs of the right shape, targets, and the loss.

Two tasks cover the zoo:

- image classification: images ``N x 3 x H x W`` (standard normal), integer labels ``N``,
  cross-entropy over the class logits ``N x C``;
- token prediction: token ids ``N x T``, one target id per position ``N x T``, cross-entropy
  over the vocabulary logits ``N x T x V`` (language models, translation, audio samples).

Inputs are random: the zoo exists to be traced, planned and rewritten, not to learn anything.
Every factory here creates its tensors with the ambient default device (``with
torch.device(...)``), so ``autoplace.zoo.build(..., device="meta")`` allocates nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["classification_loss", "image_batch", "token_batch", "token_loss"]


def image_batch(batch_size: int, image_size: int, num_classes: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``((images,), labels)``: images ``batch_size x 3 x image_size x image_size``, labels in
    ``[0, num_classes)``."""
    images = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, num_classes, (batch_size,))
    return (images,), labels


def token_batch(batch_size: int, seq_len: int, vocab_size: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``((tokens,), targets)``: both ``batch_size x seq_len`` ids in ``[0, vocab_size)``."""
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len))
    targets = torch.randint(0, vocab_size, (batch_size, seq_len))
    return (tokens,), targets


def classification_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy; ``output`` is ``N x C`` (or ``N x C x T`` with ``target`` ``N x T``)."""
    return F.cross_entropy(output, target)


def token_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy of ``N x T x V`` logits against ``N x T`` target ids."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
