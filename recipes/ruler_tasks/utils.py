"""lm-eval's side of the ec_ruler tasks: the samples of recipes/ruler.py as a
dataset, and its score per length.

Options come from lm-eval's --metadata (JSON) and --model_args: max_seq_lengths (default
ruler.DEFAULT_LENGTHS), num_samples per length (default 20), seed (0), depth (the needle tasks'
asked needles at this fraction of the haystack; default random), and the tokenizer the lengths
are counted in: tokenizer, else pretrained. The prompt text is the sample's tokens
decoded; lm-eval tokenizes it again, which may merge tokens across the pieces' joins, so its
length there is the sample's to within a few tokens (eval_ruler.py feeds the tokens themselves).
"""

from __future__ import annotations

import functools

from recipes import ruler

# The lengths the task files declare a metric for (lm-eval needs them before the data exists).
METRIC_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
ABSENT = -1.0  # a length this run did not evaluate


def dataset(task: str, **options) -> dict:
    import datasets
    from transformers import AutoTokenizer

    source = options.get("tokenizer") or options.get("pretrained")
    if not isinstance(source, str):
        raise ValueError(f"ec_ruler_{task}: name the tokenizer, --model_args pretrained=... or --metadata tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(source)
    lengths = [int(n) for n in options.get("max_seq_lengths", ruler.DEFAULT_LENGTHS)]
    unknown = [n for n in lengths if n not in METRIC_LENGTHS]
    if unknown:
        raise ValueError(f"ec_ruler_{task}: max_seq_lengths {unknown} have no metric; use some of {METRIC_LENGTHS}")
    specials = len(tokenizer("")["input_ids"])
    depth = options.get("depth") if ruler.TASKS[task].family == "niah" else None
    rows = []
    for length in lengths:
        for index in range(int(options.get("num_samples", 20))):
            sample = ruler.make_sample(task, tokenizer, length, int(options.get("seed", 0)), index, depth)
            text = tokenizer.decode(sample.input_ids[specials:])
            rows.append({"input": text, "outputs": sample.outputs, "length": length, "index": index})
    return {"test": datasets.Dataset.from_list(rows)}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    scores = {str(n): ABSENT for n in METRIC_LENGTHS}
    scores[str(doc["length"])] = ruler.score(results[0], doc["outputs"])
    return scores


def mean_at_length(scores: list[float]) -> float:
    present = [s for s in scores if s != ABSENT]
    return sum(present) / len(present) if present else ABSENT


for _name in ruler.TASKS:  # one dataset function per task, as `custom_dataset: !function utils.<task>`
    globals()[_name] = functools.partial(dataset, _name)
