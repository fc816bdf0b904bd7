"""The eval scripts' and tools/generate.py's settings (recipes/evaluation_config.py): each
docs' flag table is the one generated from the fields (`python -m recipes.evaluation_config`),
--help lists every field once under its section, the defaults pass every check, and the
underscore spellings the scripts took before still work, with a warning. One process, no
script run: each script's parse_args is called directly."""

import dataclasses
import re
import sys
from pathlib import Path

import pytest

import eval_needle
import eval_ppl
import eval_ruler
from recipes import configuration
from recipes import evaluation_config as eval_config
from tools import generate

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {"eval_needle.py": eval_needle, "eval_ppl.py": eval_ppl, "eval_ruler.py": eval_ruler}
SCRIPTS["tools/generate.py"] = generate
REQUIRED = {"tools/generate.py": ["--prompt", "x"]}  # what a script cannot run without


def test_every_script_has_a_configuration_and_a_table():
    assert set(eval_config.CONFIGS) == set(SCRIPTS)


@pytest.mark.parametrize("script", list(eval_config.CONFIGS))
def test_the_docs_flag_table_is_generated_from_the_fields(script):
    config_class, page = eval_config.CONFIGS[script]
    begin, end = eval_config.markers(script)
    text = (ROOT / page).read_text()
    assert text.count(begin) == 1 and text.count(end) == 1, (page, begin)
    block = text.split(begin + "\n", 1)[1].split("\n" + end, 1)[0]
    expected = configuration.flag_table(configuration.sections_of(config_class))
    assert block == expected, "run: python -m recipes.evaluation_config --write"


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_defaults_pass_and_help_lists_every_field_once_by_section(script, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script])
    config_class = eval_config.CONFIGS[script][0]
    assert isinstance(SCRIPTS[script].parse_args(REQUIRED.get(script, [])), config_class)
    with pytest.raises(SystemExit):
        SCRIPTS[script].parse_args(["--help"])
    text = capsys.readouterr().out
    for name, section in configuration.sections_of(config_class).items():
        block = text.split(f"\n{section.title}:\n", 1)[1].split("\n\n", 1)[0]
        for field in dataclasses.fields(section):
            flag = configuration.flag_of(field.name)
            assert len(re.findall(rf"^  (-\w .*, )?{flag}[ ,\n]", block + "\n", flags=re.M)) == 1, (script, name, flag)


def test_the_shared_sections_are_declared_once():
    model, parallelism = eval_config.EvalModelConfig, eval_config.EvalParallelismConfig
    for script in ("eval_needle.py", "eval_ruler.py", "tools/generate.py"):
        sections = configuration.sections_of(eval_config.CONFIGS[script][0])
        assert sections["model"] is model and sections["parallelism"] is parallelism, script
    ppl = configuration.sections_of(eval_config.PerplexityConfig)
    assert issubclass(ppl["model"], model) and ppl["parallelism"] is parallelism
    # the parallelism fields are train.py's own (default, doc, check, old spelling)
    train = {f.name: f for f in dataclasses.fields(configuration.ParallelismConfig)}
    for field in dataclasses.fields(eval_config.EvalParallelismConfig):
        if field.name != "sp_size":
            assert field.metadata == train[field.name].metadata and field.default == train[field.name].default


OLD_SPELLINGS = [  # (script, the old command line, where the value lands, the value)
    ("eval_needle.py", ["--max_context_length", "512"], ("sweep", "max_context_length"), 512),
    ("eval_needle.py", ["--hide_progress"], ("output", "hide_progress"), True),  # a switch
    ("eval_needle.py", ["--output_dir", "out"], ("output", "output_dir"), "out"),
    ("eval_ppl.py", ["--rope_theta", "5e5"], ("model", "rope_theta"), 5e5),
    ("eval_ruler.py", ["--parallel_mode", "ulysses_attn"], ("parallelism", "parallel_mode"), "ulysses_attn"),
    ("tools/generate.py", ["--prompt_file", "-"], ("prompt", "prompt_file"), "-"),
    ("tools/generate.py", ["--prompt", "x", "--do_sample", "--top_p", "0.9"], ("decoding", "top_p"), 0.9),
]


@pytest.mark.parametrize("script, argv, where, value", OLD_SPELLINGS, ids=[" ".join(c[1]) for c in OLD_SPELLINGS])
def test_an_old_spelling_works_and_warns(script, argv, where, value, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script])
    section, name = where
    config = SCRIPTS[script].parse_args(argv)
    assert getattr(getattr(config, section), name) == value
    err = capsys.readouterr().err
    for old in (a for a in argv if a.startswith("--") and "_" in a):
        new = old.replace("_", "-")
        assert f"warning: {old} is now {new}" in err and configuration.ALIASES_REMOVED in err, (old, err)
    dashed = [a.replace("_", "-") if a.startswith("--") else a for a in argv]
    assert getattr(getattr(SCRIPTS[script].parse_args(dashed), section), name) == value
    assert "warning" not in capsys.readouterr().err


def test_what_parse_args_fills_in():
    assert eval_needle.parse_args(["--generate"]).answers.max_new_tokens == 2 * 7 + 4
    assert eval_needle.parse_args([]).answers.max_new_tokens is None
    ppl = eval_ppl.parse_args(["-m", "a", "b", "--model", "c", "--max-tokens", "512"])
    assert ppl.model.model == ["a", "b", "c"] and ppl.data.dataset_min_tokens == 512
    assert eval_ppl.parse_args([]).model.model == [None]  # the default model
    tasks = eval_ruler.parse_args(["--tasks", "vt,cwe", "--lengths", "2048,512,512"]).tasks
    assert tasks.task_list == ["vt", "cwe"] and tasks.length_list == [512, 2048]
