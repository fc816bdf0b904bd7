"""lm-evaluation-harness with a sequence-parallel model: lm-eval's own command line, with the
model `easy_context` registered (recipes/lm_eval_model.py) and the offline RULER-style tasks
(`ec_ruler`, `ec_ruler_<task>`: recipes/ruler.py) on its task path.

    # CPU, 2 processes, one SP group: the offline suite on the model train.py saves
    torchrun --standalone --nproc_per_node 2 eval_harness.py --model easy_context \
        --model_args pretrained=outputs/tiny-llama,mode=zigzag_ring_attn \
        --tasks ec_ruler --metadata '{"max_seq_lengths": [1024, 2048], "num_samples": 10}' \
        --output_path outputs/eval/harness

    # the same tasks on lm-eval's own single-process model, for comparison
    python eval_harness.py --model hf --model_args pretrained=outputs/tiny-llama --tasks ec_ruler ...

Every lm-eval flag works as in `lm_eval run` (`--log_samples`, `--limit`, `--batch_size`, any
task lm-eval knows, RULER's own `ruler` group where its data can be downloaded). model_args of
`easy_context`: pretrained, mode, sp_size, ring_degree, dtype, max_length, chunk_size,
rope_theta. Needs the `eval-harness` extra: pip install -e ".[eval-harness]".
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        sys.exit('eval_harness.py: lm-eval is not installed; pip install -e ".[eval-harness]"')
    from lm_eval.__main__ import cli_evaluate

    from recipes import lm_eval_model
    from recipes.ruler_tasks import TASKS_DIR

    lm_eval_model.register()  # --model easy_context

    if not any(arg == "--include_path" or arg.startswith("--include_path=") for arg in argv):
        argv = [*argv, "--include_path", str(TASKS_DIR)]
    sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main(sys.argv[1:])
