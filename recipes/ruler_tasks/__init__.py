"""lm-eval task files of the offline RULER-style suite (recipes/ruler.py): the group `ec_ruler`
and one task `ec_ruler_<name>` per task. eval_harness.py adds this folder to lm-eval's
--include_path; with lm-eval's own command, pass `--include_path` TASKS_DIR. utils.py is lm-eval's
side: the samples as a dataset, the score per length."""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
