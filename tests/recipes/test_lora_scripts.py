"""train.py --lora-r on CPU (torchrun, gloo): every mode trains the adapters exactly like one
data_parallel process (per-step losses and the saved adapter weights), the output folder holds
the adapter only, and the eval scripts take that folder as --model (an adapter folder: the base
its adapter_config.json names, with the adapter).

fp32 tolerances: losses 1e-5 (test_train.py's), adapter weights 1e-5; eval perplexity of the
adapter against the merged model 1e-5 relative (test_eval.py's parallel-vs-single bound)."""

import csv
import json

import pytest
from script_runs import ok, read_csv, run_script, train
from tiny_models import tiny_model

from recipes.data import BYTE_EOS_ID, byte_tokenizer

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

LORA = ["--lora-r", "4", "--max-train-steps", "3", "--learning-rate", "1e-2"]
MODES = {
    "zigzag": ["--parallel-mode", "zigzag_ring_attn", "--activation-checkpointing"],  # LoRA's usual companion
    "dist_flash": ["--parallel-mode", "dist_flash_attn"],
    "ulysses": ["--parallel-mode", "ulysses_attn"],
    "usp": ["--parallel-mode", "usp_attn", "--ring-degree", "2"],
}


def _adapter(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


@pytest.mark.timeout(900)
def test_lora_trains_like_one_process_in_every_mode_and_the_evals_load_the_adapter(tmp_path):
    base = tmp_path / "base"
    tiny_model("llama", vocab_size=BYTE_EOS_ID + 1, initializer_range=0.1).save_pretrained(base)
    byte_tokenizer().save_pretrained(base)
    want, reference = train(tmp_path, "dp", 1, "--model", str(base), "--parallel-mode", "data_parallel", *LORA)
    assert not (reference / "model.safetensors").exists() and (reference / "adapter_config.json").is_file()
    assert json.loads((reference / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    want_weights = _adapter(reference)
    adapted = {k.rpartition(".lora_")[0].rpartition(".")[2] for k in want_weights}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}  # the default: the attention projections
    for name, flags in MODES.items():
        got, out = train(tmp_path, name, 2, "--model", str(base), *flags, *LORA)
        got_weights = _adapter(out)
        assert set(got_weights) == set(want_weights)
        weights = max((got_weights[k] - w).abs().max().item() for k, w in want_weights.items())
        loss = max(abs(a - b) for a, b in zip(got, want))
        print(f"LORA train.py {name}: loss {loss:.1e} adapter weights {weights:.1e}")
        assert len(got) == len(want) == 3 and loss <= 1e-5 and weights <= 1e-5, (name, got, want, weights)

    # The evals: the adapter folder as --model, next to its base and the merged model.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = tmp_path / "merged"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), reference).merge_and_unload().save_pretrained(
        merged
    )
    byte_tokenizer().save_pretrained(merged)
    table = tmp_path / "ppl.csv"
    flags = ["--min-tokens", "99", "--max-tokens", "198", "--samples", "1", "--hide-progress"]
    models = ["--model", str(base), str(reference), str(merged)]
    ok(run_script("eval_ppl.py", *models, *flags, "--output-file", str(table), processes=2))
    rows = {row[0]: [float(x) for x in row[1:]] for row in read_csv(table, csv.reader)[1:]}
    for adapted, whole, original in zip(rows[str(reference)], rows[str(merged)], rows[str(base)]):
        assert abs(adapted - whole) <= 1e-5 * whole and abs(adapted - original) > 1e-3 * original, rows

    needle = tmp_path / "needle"
    needle_flags = ["--task", "passkey", "--min-context-length", "200", "--max-context-length", "200"]
    needle_flags += ["--depth-interval", "1", "--num-samples", "1", "--hide-progress"]
    ok(run_script("eval_needle.py", "--model", str(reference), *needle_flags, "--output-dir", str(needle)))
    assert [r["depth"] for r in read_csv(needle / f"passkey_{reference.name}.csv")] == ["0.0", "1.0"]
