"""What a GGUF file cannot give is a clear ValueError naming the file (and the tensor, type or
field): unsupported tensor types, truncated or malformed files, other architectures, a missing
`gguf` library; the CLI prints it as one error line."""

from __future__ import annotations

import shutil
import struct
import sys
from pathlib import Path

import pytest

from ferrum import LLM
from ferrum.config import ModelConfig
from ferrum.entrypoints.cli import main
from ferrum.gguf import reader
from tests.utils.gguf_files import write_gguf

TOKENIZER = {"dir": "ferrum/model_files/ferrum-tiny-qwen3", "ids": {"eos": 2}}


def _types(name: str, shape: tuple[int, ...]) -> str:
    if name == "blk.1.attn_q.weight":
        return "Q4_0"
    return "F32" if len(shape) == 1 else "Q8_0"


@pytest.fixture(scope="module")
def q4_0_file(tiny_checkpoint, tmp_path_factory) -> str:
    """A Qwen3 file with one Q4_0 tensor (blk.1.attn_q.weight), the others F32 / Q8_0."""
    root = tmp_path_factory.mktemp("gguf_errors")
    return write_gguf(tiny_checkpoint("qwen3"), Path(root), "qwen3", _types, TOKENIZER)[0]


def test_an_unsupported_tensor_type_is_refused_naming_tensor_and_type(q4_0_file) -> None:
    with pytest.raises(ValueError, match=r"tensor 'blk\.1\.attn_q\.weight' has type Q4_0") as e:
        LLM(q4_0_file, device="cpu", dtype="float32", skip_tokenizer_init=True)
    assert q4_0_file in str(e.value) and "Q6_K" in str(e.value)  # and what is supported


@pytest.mark.parametrize("keep", [0, 3, 10, 24, 200, 5_000, 60_000, -100])
def test_a_truncated_file_is_a_value_error_naming_it(q4_0_file, tmp_path, keep: int) -> None:
    """Cut in the magic, the counts, the metadata (tokens, merges), the tensor infos or data."""
    data = Path(q4_0_file).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError, match="GGUF file .*cut.gguf"):
        ModelConfig(str(path))


@pytest.mark.parametrize(
    "header",
    [
        b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62),  # more fields than the file could hold
        b"GGUF" + struct.pack("<IQQ", 3, 2**62, 0),  # more tensors than the file could hold
        b"GGUF" + struct.pack("<I", 99) + bytes(16),  # an unknown version
        b"not a gguf file at all" * 4,
    ],
)
def test_a_malformed_file_is_a_value_error_not_a_hang(tmp_path, header: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(header)
    with pytest.raises(ValueError, match="GGUF file .*bad.gguf"):
        ModelConfig(str(path))


def test_the_cli_prints_one_error_line(q4_0_file, tmp_path, capsys) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(Path(q4_0_file).read_bytes()[:5_000])
    assert main(["generate", str(path), "--prompt", "hi", "--device", "cpu"]) != 0
    error = capsys.readouterr().err
    assert error.startswith("ferrum: error: model: GGUF file") and "Traceback" not in error


def test_other_architectures_are_refused_naming_them(q4_0_file, tmp_path) -> None:
    data = Path(q4_0_file).read_bytes()
    # general.architecture "qwen3" -> "gemma" (metadata of equal length keeps the file valid);
    # the arch-prefixed keys are not rewritten, so only the architecture changes.
    path = tmp_path / "gemma.gguf"
    old = struct.pack("<Q", 5) + b"qwen3"
    assert old in data
    path.write_bytes(data.replace(old, struct.pack("<Q", 5) + b"gemma", 1))
    with pytest.raises(ValueError, match="general.architecture 'gemma' is not supported"):
        ModelConfig(str(path))


def test_a_missing_library_says_how_to_install_it(q4_0_file, tmp_path, monkeypatch) -> None:
    path = tmp_path / "model.gguf"
    shutil.copy(q4_0_file, path)
    monkeypatch.setitem(sys.modules, "gguf", None)
    reader._checked_reader_class.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"pip install ferrum\[gguf\]"):
            ModelConfig(str(path))
    finally:
        reader._checked_reader_class.cache_clear()


def test_a_missing_file_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="GGUF file .*absent.gguf does not exist"):
        ModelConfig(str(tmp_path / "absent.gguf"))
