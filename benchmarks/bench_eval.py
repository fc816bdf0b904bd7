"""lm-eval requests at long context: lm-eval's own `hf` model in one process against the
`easy_context` model (recipes/lm_eval_model.py) on P ranks.

    python -m benchmarks.bench_eval --seq-lengths 8192,32768 --world-sizes 1,2,4 [--csv out.csv]

One loglikelihood request per row: a random context of S - 32 tokens and a 32-token
continuation, on the benchmarks' tiny Llama (bench_train.py: vocab 32000, 4 layers, hidden 256),
random weights, fp32, saved once with the byte tokenizer. Each row runs in fresh processes on
the same 2 cores (one process with 2 threads, or P processes with 2 / P each; gloo).
  hf            lm-eval's HFLM: one forward over the whole sequence, then log-softmax of
                every position's full-vocabulary logits (S x 32000 floats, twice)
  easy_context  zigzag_ring_attn over P ranks: each rank holds S / P tokens; the output
                layer runs on the continuation's 32 positions only
Columns: seconds for the request (after a warm-up request of the same length), the peak RSS
growth of each rank during it (VmHWM, reset before; MiB), and the log-likelihood (the same in
every row, to fp32 noise). The memory that decides where a device runs out grows with S:
hf's by 2 x 32000 x 4 bytes per token for the logits alone, ours by the activations of S / P
tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from benchmarks.common import (
    MiB,
    int_list,
    reset_peak_rss,
    spawn_ranks,
    status_bytes,
    table_header,
    table_row,
    write_csv,
    write_result,
)

CONTINUATION = 32


def _save_model(folder: str) -> None:
    from benchmarks.bench_train import tiny_llama
    from recipes.data import byte_tokenizer

    tiny_llama(32000, checkpointing=False, tile=0).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def _request(length: int):
    import torch

    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    return [(("", ""), ids[:-CONTINUATION], ids[-CONTINUATION:])]


def _worker(rank, world, spec, workdir):
    import torch

    torch.set_num_threads(max(1, 2 // world))
    if spec["backend"] == "hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=spec["model"], device="cpu", max_length=spec["length"] + 1, batch_size=1)
    else:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]),
        )  # fmt: skip
        from recipes.lm_eval_model import SeqParallelLM

        lm = SeqParallelLM(pretrained=spec["model"], mode="zigzag_ring_attn", max_length=spec["length"] + 1)
    request = _request(spec["length"])
    lm._loglikelihood_tokens(_request(2048))  # warm-up: kernels, allocator, the first collective
    reset_peak_rss()
    before = status_bytes("VmRSS:")
    started = time.perf_counter()
    ((logprob, _),) = lm._loglikelihood_tokens(request)
    seconds = time.perf_counter() - started
    write_result(workdir, rank, [seconds, (status_bytes("VmHWM:") - before) / MiB, logprob])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lengths", type=int_list, default=[8192, 32768])
    p.add_argument("--world-sizes", type=int_list, default=[1, 2, 4])
    p.add_argument("--csv", default=None)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        _save_model(folder)
        for length in args.seq_lengths:
            configs = [("hf", 1)] + [("easy_context", world) for world in args.world_sizes]
            for index, (backend, world) in enumerate(configs):
                spec = {"backend": backend, "model": folder, "length": length, "port": 29700 + index}
                result = spawn_ranks(_worker, spec, world)
                row = {"backend": backend, "P": world, "S": length}
                if result is None:
                    row.update(seconds="failed", peak_mib="", logprob="")
                else:
                    row.update(
                        seconds=f"{max(r[0] for r in result):.2f}",
                        peak_mib=" / ".join(f"{r[1]:.0f}" for r in result),
                        logprob=f"{result[0][2]:.4f}",
                    )
                rows.append(row)
                print(row, flush=True)
    columns = ["backend", "P", "S", "seconds", "peak_mib", "logprob"]
    print(f"\nOne loglikelihood request ({CONTINUATION}-token continuation), tiny Llama, vocab 32000, fp32, CPU")
    print(table_header(["backend", "P", "S", "s/request", "peak MiB/rank", "log-likelihood"]))
    for row in rows:
        print(table_row([str(row[c]) for c in columns]))
    if args.csv:
        write_csv(args.csv, rows, columns)


if __name__ == "__main__":
    main()
