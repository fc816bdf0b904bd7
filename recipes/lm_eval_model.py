"""lm-evaluation-harness, sequence-parallel: the model `easy_context` (eval_harness.py runs
lm-eval's own command line with it registered).

    torchrun --standalone --nproc_per_node 2 eval_harness.py --model easy_context \
        --model_args pretrained=outputs/tiny-llama,mode=zigzag_ring_attn --tasks ...

`SeqParallelLM` is lm-eval's `hf` model (HFLM: tokenization, request splitting, truncation to
max_length, stop sequences, chat templates, caching) with the computation replaced:

  loglikelihood (and loglikelihood_rolling, which calls it per window): each request is one
      sequence-parallel forward over the SP group (recipes/evaluation.py's scorer); the
      output layer runs only on the continuation's positions, so full-vocabulary logits never
      exist for the context. Requests are scored one at a time: the point is contexts that do
      not fit one device, where batching several would not help.
  generate_until: easy_context.generate (the prompt's KV cache sharded over the SP group),
      with lm-eval's stopping criteria and generation arguments.

Ranks: lm-eval splits requests by `rank` / `world_size`; here those are the data-parallel
group's (every rank of an SP group takes the same requests), and lm-eval's gathers collect one
copy per group. lm-eval writes results on the process whose rank is 0 and LOCAL_RANK is 0.

lm-eval is an optional dependency (the `eval-harness` extra), imported only when the class is
asked for: `register()` (eval_harness.py), or `from recipes.lm_eval_model import
SeqParallelLM`. The computation is a mixin without lm-eval; register() puts it in front of HFLM.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import easy_context as ec
from recipes.evaluation import IGNORE, load_scorer
from recipes.launch import make_accelerator

__all__ = ["SeqParallelLM", "register"]  # noqa: F822 (SeqParallelLM: built on first use, by __getattr__)


@functools.cache
def register() -> type:
    """lm-eval's hf model with the computation below, registered as `--model easy_context`."""
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM

    lm_class = type("SeqParallelLM", (SeqParallelComputation, HFLM), {"__module__": __name__})
    return register_model("easy_context")(lm_class)


def __getattr__(name: str):
    if name == "SeqParallelLM":  # lm-eval is imported here, on first use
        return register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SeqParallelComputation:
    """What SeqParallelLM changes in lm-eval's hf model (HFLM, after it in the class order).

    model_args: pretrained (hub name, folder or downloadable model's name), mode (default zigzag_ring_attn), sp_size,
    ring_degree, dtype (auto: bf16 on CUDA, fp32 on CPU), max_length (the longest sequence
    scored; default the model's), chunk_size (output-layer rows per chunk), rope_theta; the rest
    as lm-eval's hf model takes them (batch_size applies to generation only)."""

    def __init__(
        self,
        pretrained: str,
        mode: str = "zigzag_ring_attn",
        sp_size: int | None = None,
        ring_degree: int | None = None,
        dtype: str = "auto",
        max_length: int | None = None,
        chunk_size: int = 4096,
        rope_theta: float | None = None,
        **kwargs,
    ):
        if not isinstance(pretrained, str):
            raise ValueError("easy_context: pretrained must be a hub name or a local folder (the model is loaded here)")
        from recipes.models import load_config, model_source

        pretrained = model_source(pretrained)  # a downloadable model's name: its folder under models/
        accelerator = make_accelerator()

        limit = max_length or getattr(load_config(pretrained).get_text_config(), "max_position_embeddings", None)
        self.scorer, tokenizer = load_scorer(
            accelerator,
            pretrained,
            mode,
            max_length=limit or 2048,
            sp_size=sp_size,
            ring_degree=ring_degree,
            rope_theta=rope_theta,
            dtype=dtype,
            chunk_size=chunk_size,
        )
        super().__init__(pretrained=self.scorer.model, tokenizer=tokenizer, max_length=max_length, **kwargs)
        topology, rank = self.scorer.topology, accelerator.process_index
        self._rank, self._world_size, self._device = topology.dp_rank(rank), topology.dp_size, accelerator.device
        # The rank that speaks for each data-parallel group (its SP rank 0), in group order.
        world = accelerator.num_processes
        self._speakers = sorted((r for r in range(world) if topology.sp_rank(r) == 0), key=topology.dp_rank)
        self._distributed = world > 1

    # ----------------------------------------------------------- one copy per DP group
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._distributed:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        mine = [parts[r] for r in self._speakers]
        return torch.stack(mine) if tensor.dim() == 0 else torch.cat(mine)

    def gather_object(self, obj, dst: int = 0):
        if not self._distributed:
            return [obj]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, obj)
        return [everyone[r] for r in self._speakers]

    def barrier(self) -> None:
        if self._distributed:
            dist.barrier()

    # ---------------------------------------------------------------- computation
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per
        request, in order; the sequence as lm-eval's hf model cuts it (the last max_length + 1
        tokens, the last one only a target)."""
        results = []
        for cache_key, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1) :]
            ids = torch.tensor(whole[:-1])
            targets = torch.full_like(ids, IGNORE)
            targets[-len(continuation) :] = torch.tensor(whole[-len(continuation) :])
            scores = self.scorer.score(ids, targets)
            scored = scores.scored
            greedy = bool((scores.predictions[scored] == targets[scored]).all())
            answer = (-float(scores.nll[scored].double().sum()), greedy)
            results.append(answer)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return results

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        from lm_eval.models.utils_hf import stop_sequences_criteria

        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        if generation_kwargs["temperature"] == 0.0 and generation_kwargs.get("do_sample") is None:
            generation_kwargs["do_sample"] = False
        if generation_kwargs.get("do_sample") is False:
            generation_kwargs.pop("temperature")
        attention_mask = generation_kwargs.pop("attention_mask", None)
        return ec.generate(
            self.scorer.mode_name,
            self.model,
            context,
            attention_mask,
            max_length=max_length,
            stopping_criteria=stop_sequences_criteria(self.tokenizer, stop, context.shape[1], context.shape[0]),
            pad_token_id=self.tokenizer.pad_token_id,
            synced_gpus=self.scorer.lockstep,
            **self.scorer.options,
            **generation_kwargs,
        )
