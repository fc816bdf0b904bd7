"""Sequence-parallel evaluation, shared by the eval scripts and tools/generate.py.

One sequence is scored by one forward pass (no grad) spread over its SP group: every rank
holds its share of the tokens, the output layer runs over chunks of the local tokens (full
vocabulary logits never exist for the whole sequence), and only the per-token results
(negative log-likelihood, argmax prediction) are gathered, so they are exactly what one
process would compute on the whole sequence. Independent sequences are spread over the
data-parallel groups (world = dp x sp).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from easy_context.hf.api import gather_seq_parallel_outputs, generate, prepare_seq_parallel_inputs
from easy_context.hf.architectures import logits_head
from easy_context.hf.heads import placement_of
from easy_context.modes import get_mode
from recipes.models.downloads import ModelNotFetched, NoSuchModelFolder, model_source

__all__ = [
    "DEFAULT_EVAL_MODEL",
    "resolve_model",
    "TokenScores",
    "SeqParallelScorer",
    "eval_dtype",
    "load_scorer",
    "load_scorer_for_flags",
]

# Where the README's training command saves its model.
DEFAULT_EVAL_MODEL = "outputs/tiny-llama"
IGNORE = -100


def resolve_model(name: str | None) -> str:
    """A hub name, local folder or downloadable model's name (its folder; ModelNotFetched, an
    OSError, before its fetch; NoSuchModelFolder for a path to nothing); None means the model
    train.py writes by default."""
    if name is not None:
        try:
            return model_source(name)
        except (ModelNotFetched, NoSuchModelFolder) as error:
            raise type(error)(f"--model {error}") from None
    if not (Path(DEFAULT_EVAL_MODEL) / "config.json").exists():
        raise FileNotFoundError(
            f"no model at {DEFAULT_EVAL_MODEL}: train one first with "
            "`torchrun --standalone --nproc_per_node 2 train.py`, or pass --model (a hub name or a local folder)"
        )
    return DEFAULT_EVAL_MODEL


def eval_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass
class TokenScores:
    """Per position of one sequence: the target (next token, or -100), the negative
    log-likelihood of the target and the model's argmax prediction (0 and -100 where the
    target is ignored)."""

    targets: torch.Tensor
    nll: torch.Tensor
    predictions: torch.Tensor

    @property
    def scored(self) -> torch.Tensor:
        return self.targets != IGNORE


class SeqParallelScorer:
    """Scores whole sequences with a (patched) causal LM spread over the SP group.

    `model` is the HF model or the DeepSpeed engine wrapping it; call
    apply_seq_parallel_monkey_patch for its model type first (not needed for data_parallel).
    lockstep: every rank runs the same module calls, as ZeRO-3 needs (each submodule's
    forward gathers its parameters with a collective over all ranks): the output layer runs
    the same number of chunks everywhere and every data-parallel group the same number of
    items. Without it only the SP group's collectives bind ranks together.
    """

    def __init__(
        self,
        model,
        mode: str,
        rank: int,
        world_size: int,
        device,
        *,
        sp_size=None,
        ring_degree=None,
        chunk_size: int = 4096,
        lockstep: bool = False,
    ):
        self.model = getattr(model, "module", model)  # under DeepSpeed, hooks gather ZeRO-3 shards per submodule
        self.lockstep = lockstep and world_size > 1
        self.mode_name, self.mode = mode, get_mode(mode)
        self.rank, self.world_size, self.device, self.chunk_size = rank, world_size, device, chunk_size
        self.options = {"sp_size": sp_size, "ring_degree": ring_degree}
        self.topology = self.mode.topology(world_size, sp_size, ring_degree, placement_of(self.model, world_size))
        self.layout = self.mode.layout(self.topology)

    # ------------------------------------------------------------------ one sequence
    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor | None = None) -> TokenScores:
        """input_ids (S,); target_ids (S,) aligned with input_ids (default: the next token,
        none for the last). Lengths the layout cannot split are padded at the end (causal
        attention: later tokens change nothing before them) and the padding is dropped."""
        input_ids = input_ids.reshape(-1).long()
        length = input_ids.numel()
        if target_ids is None:
            target_ids = torch.cat([input_ids[1:], input_ids.new_full((1,), IGNORE)])
        target_ids = target_ids.reshape(-1).long()
        pad = self.layout.padding(length)
        ids = F.pad(input_ids, (0, pad), value=0)[None]
        targets = F.pad(target_ids, (0, pad), value=IGNORE)[None]
        local = prepare_seq_parallel_inputs(
            self.mode_name, ids, None, targets, self.rank, self.world_size, self.device, **self.options
        )
        decoder, head = self.model.get_decoder(), logits_head(self.model)
        hidden = decoder(
            input_ids=local["local_input_ids"], position_ids=local["local_position_ids"], use_cache=False
        ).last_hidden_state[0]
        # The output layer runs only where a target is scored (for a needle prompt: the
        # answer), in chunks; elsewhere nll is 0 and the prediction -100.
        local_targets = local["local_target_ids"][0]
        where = (local_targets != IGNORE).nonzero().squeeze(1)
        nll = torch.zeros(local_targets.shape, dtype=torch.float32, device=hidden.device)
        predictions = torch.full_like(local_targets, IGNORE)
        chunks = torch.tensor([-(-where.numel() // self.chunk_size)], device=hidden.device)
        if self.lockstep:
            dist.all_reduce(chunks, op=dist.ReduceOp.MAX)
        for start in range(0, int(chunks) * self.chunk_size, self.chunk_size):
            rows = where[start : start + self.chunk_size]  # may be empty on some ranks (lockstep)
            logits = head(hidden[rows]).float()
            predictions[rows] = logits.argmax(-1)
            nll[rows] = F.cross_entropy(logits, local_targets[rows], reduction="none")
        gathered = [
            gather_seq_parallel_outputs(self.mode_name, x[None], dim=1, **self.options)[0, :length].cpu()
            for x in (nll, predictions)
        ]
        return TokenScores(target_ids.cpu(), gathered[0], gathered[1])

    # ------------------------------------------------------------------ generation
    def answer(self, tokenizer, prompt_ids, max_new_tokens: int) -> str:
        """The greedy continuation of one prompt (token ids), decoded without special tokens;
        its KV cache sharded over the SP group (easy_context.generate)."""
        prompt = torch.as_tensor(prompt_ids, device=self.device).reshape(1, -1)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        output = generate(
            self.mode_name,
            self.model,
            prompt,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            synced_gpus=self.lockstep,
            **self.options,
        )
        return tokenizer.decode(output[0, prompt.shape[1] :].tolist(), skip_special_tokens=True)

    # ------------------------------------------------------- many independent items
    def my_items(self, items: list) -> list[tuple[int | None, object]]:
        """(index, item) pairs this rank's data-parallel group evaluates (every rank of an SP
        group gets the same ones). In lockstep every group gets equally many: the short ones
        repeat an item with index None, and collect() drops its result."""
        dp_rank, dp_size = self.topology.dp_rank(self.rank), self.topology.dp_size
        mine = [(i, item) for i, item in enumerate(items) if i % dp_size == dp_rank]
        if self.lockstep and items:
            mine += [(None, items[0])] * (-(-len(items) // dp_size) - len(mine))
        return mine

    def collect(self, results: list[tuple[int | None, object]]) -> list:
        """Every rank's (index, result) pairs, in index order, on every rank."""
        results = [pair for pair in results if pair[0] is not None]
        if self.topology.sp_rank(self.rank) != 0:
            results = []  # the SP group's rank 0 speaks for the group
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, results)
            results = [pair for part in everyone for pair in part]
        return [result for _, result in sorted(results, key=lambda pair: pair[0])]


def load_scorer(
    accelerator,
    source: str,
    mode: str,
    *,
    max_length: int,
    sp_size=None,
    ring_degree=None,
    rope_theta=None,
    dtype: str = "auto",
    chunk_size: int = 4096,
):
    """(scorer, tokenizer) for a model ready to evaluate under `mode`: loaded, checked for what
    sequence parallelism cannot run at `max_length` (ValueError/OSError), patched, in eval
    mode, and either a full copy on this rank's device or, under DeepSpeed (the inference
    config), a ZeRO-3 engine with sharded, offloaded weights and lockstep scoring."""
    from easy_context.hf import api
    from easy_context.hf.accelerate_parallelism import check_accelerate_parallelism
    from recipes.models import check_config, load_pretrained

    rank, world = accelerator.process_index, accelerator.num_processes
    if get_mode(mode).sequence_parallel:
        check_accelerate_parallelism(accelerator, mode)
    model, tokenizer = load_pretrained(source, rope_theta, eval_dtype(dtype, accelerator.device))
    topology = get_mode(mode).topology(world, sp_size, ring_degree, placement_of(model, world))
    check_config(model.config, topology, max_length, mode)
    api.apply_seq_parallel_monkey_patch(mode, model, sp_size=sp_size, ring_degree=ring_degree)
    model.eval()
    deepspeed = accelerator.state.deepspeed_plugin is not None
    model = accelerator.prepare(model) if deepspeed else model.to(accelerator.device)
    scorer = SeqParallelScorer(
        model,
        mode,
        rank,
        world,
        accelerator.device,
        sp_size=sp_size,
        ring_degree=ring_degree,
        chunk_size=chunk_size,
        lockstep=deepspeed,
    )
    return scorer, tokenizer


def load_scorer_for_flags(accelerator, source: str, model, parallelism, max_length: int, **options):
    """load_scorer with the settings the eval scripts share (recipes/evaluation_config.py): the
    model section's --rope-theta and --dtype, the parallelism section's --parallel-mode, --sp-size
    and --ring-degree."""
    return load_scorer(
        accelerator,
        source,
        parallelism.parallel_mode,
        max_length=max_length,
        sp_size=parallelism.sp_size,
        ring_degree=parallelism.ring_degree,
        rope_theta=model.rope_theta,
        dtype=model.dtype,
        **options,
    )
