"""Token-weighted cross entropy over a sharded sequence, without full-vocabulary logits.

At long contexts the logits dominate memory (128K tokens x 128K vocab in fp32 is 64 GB).
The loss here runs the output layer over chunks of tokens under activation checkpointing:
at any time only one chunk's logits exist, in the forward and again in the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from easy_context.hf.architectures import logits_head

__all__ = ["CausalLMLoss", "chunked_cross_entropy_sum", "global_token_mean"]


def _chunk_loss(output_layer, hidden, targets, ignore_index):
    logits = output_layer(hidden).float()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy_sum(hidden, output_layer, targets, chunk_size: int = 4096, ignore_index: int = -100):
    """Sum over tokens of CE(output_layer(hidden), targets); hidden (B, S, H), targets (B, S).

    Memory for logits: chunk_size x vocab (one chunk at a time), whatever S is. The output
    layer is called as a module, so ZeRO-3 gathers its weight each time.
    """
    hidden, targets = hidden.flatten(0, 1), targets.flatten()
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, output_layer, h, t, ignore_index, use_reentrant=False)
        else:
            total = total + _chunk_loss(output_layer, h, t, ignore_index)
    return total


def global_token_mean(loss_sum: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, group=None):
    """Scale a local loss sum for backward, given gradients are later AVERAGED over the ranks
    of `group` (as DDP and DeepSpeed do), and return (loss_for_backward, global_mean).

    The global mean is sum(loss over every token of every rank) / number of valid targets on
    every rank: each rank may hold a different number of ignored (-100) targets.
    """
    stats = torch.stack([loss_sum.detach().float(), (targets != ignore_index).sum().float()])
    ranks = 1
    if group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(stats, group=group)
        ranks = dist.get_world_size(group)
    count = stats[1].clamp(min=1)
    return loss_sum * ranks / count, stats[0] / count


class CausalLMLoss(torch.nn.Module):
    """A causal LM plus its loss: returns this rank's loss sum, computed in chunks so the
    full-vocabulary logits of the local sequence never exist at once."""

    def __init__(self, model, loss_chunk_size: int):
        super().__init__()
        self.model, self.loss_chunk_size = model, loss_chunk_size

    @property
    def config(self):  # accelerate reads hidden_size from here to size DeepSpeed's buckets
        return self.model.config

    def forward(self, input_ids, position_ids, target_ids, **attention_kwargs):
        hidden = self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention_kwargs
        ).last_hidden_state
        return chunked_cross_entropy_sum(hidden, logits_head(self.model), target_ids, self.loss_chunk_size)
