"""tools/sweep_models.py holds easy_context/hf/model_types.py's record to what the installed
transformers does: every supported type exact in each mode family at 2 ranks, every refused type
refused for its recorded reason or still not exact. The rules of that comparison, and that each
shrunk released config keeps no length the sweep's tokens do not cross, are checked here in one
process; the sweep itself runs in CI (about a minute on 2 cores)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from easy_context.hf import model_types
from tools import exact_step, released_configs, sweep_models
from tools.tiny_configs import tiny_config

ROOT = Path(__file__).resolve().parents[2]
GOAL = 70  # issue 41: at least 70 model types exact in every mode


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_sweep_proves_the_record(tmp_path):
    """Every type, and each supported type's variants (issue 56): a window set and unset in every
    mode family, and the rope types whose frequencies follow the length (the ones the patch
    touches; every rope type runs with `--variants` alone, outside CI): exact, refused by name,
    or not accepted by the unpatched model itself."""
    out = tmp_path / "sweep.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.sweep_models",
            "--check",
            "--json",
            str(out),
            "--variants",
            "--rope-types",
            "dynamic",
            "longrope",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1140,
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    found = json.loads(out.read_text())
    exact = sorted(t for t, (cls, _) in found.items() if cls == "exact" and "+" not in t)
    print(f"{len(exact)} exact of {len(found)}")
    assert len(exact) >= GOAL and set(exact) <= set(model_types.SUPPORTED), tail
    variants = {t: cls for t, (cls, _) in found.items() if "+" in t}
    assert "failing" not in variants.values() and len(variants) > 2.5 * GOAL, tail
    for entry in ("phimoe+window", "olmoe+window", "llama+rope=dynamic", "phi3+rope=longrope", "qwen2+window"):
        assert variants[entry] == "exact", (entry, found[entry])


def test_a_type_that_changes_class_is_a_mismatch():
    """A supported type that stops being exact, a refused one that becomes exact, a static reason
    other than the recorded one, and an unknown type, each against the record."""
    found = {
        "llama": ("failing", "not exact: logits 3.0e-02"),
        "doge": ("exact", "logits 1e-7"),
        "bart": ("refused", f"{model_types.OUTSIDE_REGISTRY}: BartForCausalLM computes attention itself"),
        "mistral": ("exact", "logits 1e-7"),
        "jamba": ("refused", f"{model_types.HYBRID}: Mamba (selective scan, Mamba-1)"),
        "brand_new": ("exact", "logits 1e-7"),
        "brand_new_refused": ("refused", f"{model_types.ENCODER_DECODER}: new"),
    }
    problems = sweep_models.mismatches(found)
    assert [p.split(":")[0] for p in problems] == ["llama", "doge", "bart", "brand_new"], problems
    assert "move it to SUPPORTED" in problems[1] and "not in the record" in problems[3]
    assert [p.split(":")[0] for p in sweep_models.mismatches(found, strict=True)][-1] == "brand_new_refused"


def test_every_recorded_reason_starts_with_a_category_and_no_type_is_in_both():
    assert not set(model_types.SUPPORTED) & set(model_types.REFUSED)
    for model_type, reason in model_types.REFUSED.items():
        assert reason.startswith(tuple(f"{c}: " for c in model_types.REFUSAL_CATEGORIES)), (model_type, reason)


def test_the_bounds_hold_a_model_to_what_fp32_gives_it():
    """Relative to the one-process fp32 run, the architecture tests' bounds; where that run is
    itself further from the fp64 truth (an ill-conditioned or zero gradient), twice its own
    error. A real error fails either way."""
    import torch

    logits, big, small = torch.ones(2, 3), torch.full((4,), 1e-3), torch.full((4,), 1e-5)
    truth = (logits, 1.0, {"big": big, "small": small})
    one_process = (logits, 1.0, {"big": big, "small": small * (1 + 1.5e-4)})  # DiffLlama's lambdas
    ours = (logits, 1.0, {"big": big, "small": small * (1 - 2.5e-4)})
    assert exact_step.errors(ours, one_process, truth)[3] <= 1.0
    assert exact_step.errors(ours, one_process, None)[3] > 1.0  # without the truth: the fixed bound
    wrong = (logits, 1.0, {"big": big * 1.01, "small": small})
    assert exact_step.errors(wrong, one_process, truth)[3] > 1.0
    zero = (logits, 1.0, {"big": big, "small": torch.zeros(4)})  # OPT's key bias: zero in exact arithmetic
    noise = (logits, 1.0, {"big": big, "small": torch.full((4,), 3e-11)})
    assert exact_step.errors(noise, (logits, 1.0, {"big": big, "small": torch.full((4,), 2e-11)}), zero)[3] <= 1


def test_the_docs_sweep_table_agrees_with_the_record():
    """docs/model_types.md shows a sweep's table; a type whose record changed without the table
    (or the other way round) is stale."""
    text = (ROOT / "docs" / "model_types.md").read_text()
    block = text.split("<!-- sweep:begin -->\n", 1)[1].split("\n<!-- sweep:end -->", 1)[0]
    rows = {line.split("`")[1]: line.split("|")[2].strip() for line in block.splitlines() if line.startswith("| `")}
    assert set(rows) == set(model_types.SUPPORTED) | set(model_types.REFUSED)
    stale = [t for t, cls in rows.items() if (cls == "exact") != (t in model_types.SUPPORTED)]
    assert not stale, f"docs/model_types.md's sweep table is stale for {stale}: paste python -m tools.sweep_models"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_released_configs_are_exact_or_refused_by_name():
    """Every released config of tests/data/released_configs/ (shrunk, features kept:
    tools/released_configs.py) is exact in each mode family at 2 ranks, or refused with the
    record's reason; none fails."""
    run = subprocess.run(
        [sys.executable, "-m", "tools.released_configs"], cwd=ROOT, capture_output=True, text=True, timeout=840
    )
    rows = [line.split("|")[1:4] for line in run.stdout.splitlines() if line.startswith("| ")][1:]
    classes = {name.strip(): cls.strip() for name, _, cls in rows}
    assert run.returncode == 0 and "failing" not in classes.values(), (run.stdout + run.stderr)[-6000:]
    assert len(classes) == len(list((ROOT / "tests" / "data" / "released_configs").glob("*.json"))) >= 60
    assert sum(cls == "exact" for cls in classes.values()) >= 64, classes


# A config field the model compares positions or sequence lengths against, by its name: windows,
# attention chunks, a rope's original context (and any new field named so); not these.
LENGTH_FIELD = re.compile(r"window|chunk|context|original_max_position")
NOT_LENGTHS = {"max_window_layers"}  # a count of layers


def _length_fields(fields: dict, prefix: str = ""):
    for name, value in fields.items():
        if isinstance(value, dict):
            yield from _length_fields(value, f"{prefix}{name}.")
        elif LENGTH_FIELD.search(str(name)) and name not in NOT_LENGTHS and not isinstance(value, bool):
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    yield f"{prefix}{name}", v


def _built(name: str) -> dict:
    """The shrunk released config as this transformers builds it; skipped where it cannot (the
    floors' transformers 5.9 lacks some types and asks Phi-3's longrope for its original context
    inside rope_parameters; the released configs' sweep runs on the pinned versions)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type, fields = released_configs.shrunk(name)
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in this transformers")
    try:
        return tiny_config(model_type, **fields).to_dict()
    except KeyError as error:
        if "Missing required keys in `rope_parameters`" not in str(error):
            raise
        # transformers 5.9 (the floors) reads longrope's original context from rope_parameters,
        # where the released Phi-3 128K configs do not put it; the pinned versions build them
        pytest.skip(f"this transformers does not build {name}'s shrunk config: {error}")


@pytest.mark.parametrize("name", released_configs.names())
def test_the_shrunk_released_config_keeps_no_length_the_sweep_does_not_cross(name):
    """Every length the shrunk config holds, as transformers builds it (MiMo's config derives
    sliding_window from sliding_window_size, Phi-3's moves original_max_position_embeddings into
    its rope parameters), is below the sweep's sequence, so the sweep's tokens cross it (a window
    masks, longrope takes its long factors); its max_position_embeddings holds the sequence. Or
    the type is refused, and the sweep runs nothing of it."""
    from easy_context.hf.architectures import check_model_type

    model_type, _ = released_configs.shrunk(name)
    try:
        check_model_type(model_type)
    except ValueError:
        return
    config = _built(name)
    lengths = dict(_length_fields(config))
    kept = {field: value for field, value in lengths.items() if value >= exact_step.SEQ}
    assert not kept, f"{name}: {kept} not below the sweep's {exact_step.SEQ} tokens (tools/released_configs.LENGTHS)"
    assert config.get("max_position_embeddings", exact_step.SEQ) >= exact_step.SEQ


def test_the_length_fields_are_found_where_released_configs_hold_them():
    """The name pattern above finds the lengths of released configs as transformers builds them:
    MiMo's window (derived from sliding_window_size) and attention chunk, Phi-3 128K's original
    context inside its rope parameters, gpt-oss's initial context."""
    expected = {
        "XiaomiMiMo--MiMo-V2-Flash": {"sliding_window", "sliding_window_size", "attention_chunk_size"},
        "microsoft--Phi-3-mini-128k-instruct": {"sliding_window", "rope_parameters.original_max_position_embeddings"},
        "openai--gpt-oss-20b": {"sliding_window", "initial_context_length"},
    }
    for name, fields in expected.items():
        found = dict(_length_fields(_built(name)))
        assert fields <= set(found), (name, found)
