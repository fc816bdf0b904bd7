"""What the generation tests share (tests/distributed/test_generation.py, test_lora.py): prompts,
and easy_context.generate on this rank against one process's model.generate."""

import torch
from tiny_models import VOCAB

from easy_context import apply_seq_parallel_monkey_patch, generate, remove_seq_parallel_monkey_patch

LOGITS_TOL = 1e-4  # test_models.py's fp32 forward bound; measured: greedy 1.8e-7, gemma2 softcap 3.3e-6
NEW_TOKENS = 40
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def prompts(batch: int, length: int, seed: int, left_pad=()):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(left_pad):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def compare(model, mode, ids, mask, seed=0, patch_first=True, **kwargs):
    """(tokens equal, worst step-logits error, steps) of generate vs one process's generate;
    patch_first=False: generate patches the model's type itself."""
    kwargs = {**GREEDY, "max_new_tokens": NEW_TOKENS, **kwargs}
    torch.manual_seed(seed)
    want = model.generate(ids, attention_mask=mask, **kwargs)
    if patch_first:
        apply_seq_parallel_monkey_patch(mode, model)
    try:
        torch.manual_seed(seed)
        got = generate(mode, model, ids, attention_mask=mask, **kwargs)
    finally:
        remove_seq_parallel_monkey_patch()
    if want.logits is None:
        return torch.equal(got.sequences, want.sequences), 0.0, got.sequences
    assert len(got.logits) == len(want.logits)
    error = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
    return torch.equal(got.sequences, want.sequences), error, got.sequences
