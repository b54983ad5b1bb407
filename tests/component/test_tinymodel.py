"""The locally built tiny Llama directory: standard files, deterministic, idempotent, with a CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kairos.launcher.tinymodel import CHAT_TEMPLATE, MODEL_FILES, STAMP_FILE, _stamp_matches, build_tiny_model, main


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One directory per session shared by every test module; the stamp makes later builds free.
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_writes_every_file_and_a_stamp(model_dir: Path) -> None:
    for name in (*MODEL_FILES, STAMP_FILE):
        assert (model_dir / name).is_file(), name
    assert _stamp_matches(model_dir, 4096, 0)


def test_config_is_a_standard_llama_config_matching_the_tokenizer(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = _json(model_dir / "config.json")
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "bos_token_id": tokenizer.token_to_id("<s>"),
        "eos_token_id": tokenizer.token_to_id("</s>"),
    }
    assert {k: config[k] for k in expected} == expected
    assert config["vocab_size"] == 4096
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    generation = _json(model_dir / "generation_config.json")
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


def test_tokenizer_config_declares_specials_and_the_chat_template(model_dir: Path) -> None:
    config = _json(model_dir / "tokenizer_config.json")
    assert config["bos_token"] == "<s>"
    assert config["eos_token"] == "</s>"
    assert config["unk_token"] == "<unk>"
    assert config["model_max_length"] == 32768
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["add_bos_token"] is True
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["chat_template"].startswith("{{ bos_token }}")
    assert {v["content"] for v in config["added_tokens_decoder"].values()} == {"<unk>", "<s>", "</s>"}


def test_tokenizer_is_byte_level_bpe_that_prepends_bos(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "The server decodes 1024 tokens, then the cache fills. Ünïcödé ✓"
    with_bos = tokenizer.encode(text, add_special_tokens=True).ids
    without = tokenizer.encode(text, add_special_tokens=False).ids
    assert with_bos == [1, *without]
    assert tokenizer.decode(without) == text  # byte-level: any text round-trips, no <unk>
    assert 0 not in without
    assert len(tokenizer.encode(" the", add_special_tokens=False).ids) == 1  # merges learned English


def test_build_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_second_build_is_skipped_but_a_changed_file_or_seed_rebuilds(model_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(model_dir, tmp_path / "m")
    built = tmp_path / "m"
    mtimes = {name: os.stat(built / name).st_mtime_ns for name in MODEL_FILES}
    assert build_tiny_model(tmp_path / "m") == built
    assert {name: os.stat(built / name).st_mtime_ns for name in MODEL_FILES} == mtimes

    assert not _stamp_matches(built, 4096, 1)  # another seed is another build
    assert not _stamp_matches(built, 2048, 0)
    (built / "config.json").write_text("{}")
    assert not _stamp_matches(built, 4096, 0)
    build_tiny_model(tmp_path / "m")
    assert (built / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()


def test_rejects_a_vocabulary_smaller_than_the_byte_alphabet(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 259"):
        build_tiny_model(tmp_path / "m", vocab_size=100)


def test_cli_prints_the_path(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(model_dir)]) == 0
    assert capsys.readouterr().out == f"{model_dir}\n"


def test_module_entry_point(model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kairos.launcher.tinymodel", str(model_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=60,
    )
    assert out.stdout == f"{model_dir}\n"
