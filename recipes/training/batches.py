"""The run's data: rows of --seq-length + 1 tokens, the rows of each micro-batch (a pure function
of its index, so a resumed run reads what the uninterrupted one would), and this rank's shard."""

from __future__ import annotations

import functools

import torch

import easy_context as ec
from easy_context.core.work_order import balanced_epoch_order
from recipes.data import (
    BYTE_EOS_ID,
    StreamedRows,
    document_positions,
    open_rows,
    stdlib_token_stream,
    windows,
    with_retrieval_rows,
)
from recipes.demo_data import NeedleAnswerRows
from recipes.training.config import DEFAULT_RETRIEVAL_FRACTION, DataConfig
from recipes.training.run import Run, fail


def build_data(run: Run, tokenizer, vocab_size: int) -> ShardedBatches:
    config, data, accelerator = run.config, run.config.data, run.accelerator
    micro_batches = config.optimisation.max_train_steps * config.optimisation.gradient_accumulate_every
    # The main process first: it downloads and tokenizes into datasets' cache, the others then
    # read the cache. They wait in a collective, so a first tokenization longer than
    # --dist-timeout stops them; the phase name says so.
    run.stage.at("loading the data (the main process tokenizes --dataset first; the others wait up to --dist-timeout)")
    with accelerator.main_process_first():
        rows = load_rows(
            config.data,
            config.model.model,
            micro_batches * data.batch_size * run.dp_size,
            tokenizer,
            run.dp_rank,
            run.dp_size,
        )
    if not isinstance(rows, StreamedRows) and len(rows) < data.batch_size * run.dp_size:
        fail(
            f"{len(rows)} rows of {data.seq_length + 1} tokens are fewer than one step needs "
            f"({data.batch_size * run.dp_size})"
        )
    # The order this run reads in, as checkpoints record it (RESUME_KEYS): by work only where
    # that applies (document masking, several DP groups, rows that know their documents).
    if not (data.document_masking and run.dp_size > 1 and hasattr(rows, "row_products")):
        data.data_order = "random"
    return ShardedBatches(run, rows, tokenizer.eos_token_id, vocab_size)


def load_rows(data: DataConfig, model: str | None, rows_needed: int, tokenizer, dp_rank: int, dp_size: int):
    """Rows of seq_length + 1 tokens (inputs and their next-token targets): for the embedded
    corpus, a tensor (byte tokenizer) or NeedleAnswerRows, whose rows come with labels (any other
    tokenizer); for --dataset, rows read lazily from its Arrow storage (or its stream)."""
    length = data.seq_length + 1
    if data.dataset is None and len(tokenizer) == BYTE_EOS_ID + 1 and tokenizer.eos_token_id == BYTE_EOS_ID:
        stream = stdlib_token_stream(max_tokens=rows_needed * length)
        rows = windows(stream, length, data.max_rows)
        if len(rows) == 0:
            fail(f"the embedded corpus is shorter than one sequence of {length} tokens")
        fraction = DEFAULT_RETRIEVAL_FRACTION if data.retrieval_fraction is None else data.retrieval_fraction
        return with_retrieval_rows(rows, fraction, data.seed)
    if data.dataset is None:
        if data.retrieval_fraction is not None:
            fail(
                f"--retrieval-fraction {data.retrieval_fraction}: the embedded corpus of a model with its own "
                "tokenizer is all needle documents; the fraction applies to the byte-level corpus (--from-scratch)"
            )
        if tokenizer.eos_token_id is None:
            fail(f"--model {model}: the embedded needle corpus separates documents by EOS; the tokenizer has none")
        count = rows_needed if data.max_rows is None else min(rows_needed, data.max_rows)
        return NeedleAnswerRows(tokenizer, length, count, data.seed)
    try:
        return open_rows(
            data.dataset,
            length,
            tokenizer,
            text_column=data.text_column,
            max_rows=data.max_rows,
            streaming=data.streaming,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
    except (ValueError, OSError) as error:
        fail(f"--dataset {data.dataset}: {error}")


@functools.lru_cache(maxsize=2)  # one permutation per epoch, not one per micro-batch (10M rows: 80 MB)
def epoch_order(rows: int, seed: int) -> torch.Tensor:
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=2)
def balanced_order(rows, seed: int, dp_size: int, batch_size: int) -> torch.Tensor:
    """The epoch's order with equal attention work per DP group in each step (core/work_order.py),
    from the rows' document lengths (rows: PackedRows, hashed by identity)."""
    return balanced_epoch_order(epoch_order(len(rows), seed), rows.row_products(), dp_size, batch_size, seed)


def micro_batch(rows, index: int, batch_size: int, dp_rank: int, dp_size: int, seed: int, balanced=False):
    """Micro-batch `index` of data-parallel group `dp_rank`: a pure function of its arguments,
    so a resumed run reads exactly what the uninterrupted run would have read. The epoch's
    order is dealt to the DP groups batch by batch (easy_context.core.data_groups: batch i to
    group i % dp_size, the tail dropped). `balanced`: the epoch's order gives the DP groups of a
    step rows of equal attention work (rows that know their documents: PackedRows)."""
    from easy_context.core.data_groups import batches_per_group, group_rows

    if isinstance(rows, StreamedRows):  # in stream order; each DP group streams its own part
        return rows.read(index * batch_size, batch_size)
    epoch, within = divmod(index, batches_per_group(len(rows) // batch_size, dp_size))
    if balanced:
        order = balanced_order(rows, seed + epoch, dp_size, batch_size)
    else:
        order = epoch_order(len(rows), seed + epoch)
    return rows[group_rows(order, within, dp_rank, dp_size, batch_size)]


class ShardedBatches:
    """The run's micro-batches, each cut into this rank's part of the sequence."""

    def __init__(self, run: Run, rows, eos_id: int | None, vocab_size: int):
        self.run, self.rows, self.eos_id, self.vocab_size = run, rows, eos_id, vocab_size

    def shard(self, index: int, step: int):
        """Micro-batch `index` (of step `step`) on this rank: (input_ids, position_ids,
        target_ids, the model's extra attention arguments)."""
        run, data = self.run, self.run.config.data
        balanced = data.data_order == "balanced"
        batch = micro_batch(self.rows, index, data.batch_size, run.dp_rank, run.dp_size, data.seed, balanced)
        batch, labels = batch if isinstance(batch, tuple) else (batch, batch)  # labels: -100 where not trained
        if batch.min() < 0 or batch.max() >= self.vocab_size:  # else an IndexError (CPU) or a device assert (CUDA)
            bad = batch.min().item() if batch.min() < 0 else batch.max().item()
            fail(
                f"step {step}: the data holds token id {bad}, "
                f"outside the model's vocabulary (0..{self.vocab_size - 1}); "
                "was --dataset tokenized with another tokenizer?"
            )
        positions = document_positions(batch[:, :-1], self.eos_id) if data.document_masking else None
        local = ec.prepare_seq_parallel_inputs(
            run.config.parallelism.parallel_mode,
            batch[:, :-1],
            positions,
            labels[:, 1:],
            run.rank,
            run.world,
            run.accelerator.device,
        )
        extra = {"seq_parallel_index": local["local_token_index"]} if run.document_split else {}
        return local["local_input_ids"], local["local_position_ids"], local["local_target_ids"], extra
