"""ringd.models.checkpoint: what a model on disk is, without loading it."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from ringd.models.checkpoint import weight_files_for, weight_map
from ringd.models.errors import ModelFileError
from ringd.models.source import model_info


def _cut(file, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


def _garble_header(file) -> None:
    data = bytearray(file.read_bytes())
    data[10:20] = b"\x00garbage!!"
    file.write_bytes(bytes(data))


def _lie_about_header_length(file) -> None:
    data = bytearray(file.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 4)
    file.write_bytes(bytes(data))


def _wrong_tensor_size(file) -> None:
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "F32"  # from BF16: twice the bytes its range holds
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # safetensors pads with spaces
    assert len(raw) == n
    file.write_bytes(data[:8] + raw + data[8 + n :])


# What happens to a model directory, the file it names, and the words the error must hold.
BROKEN = {
    "truncated": (lambda d: _cut(d / "model.safetensors", (d / "model.safetensors").stat().st_size - 1000), "model.safetensors", "truncated"),
    "corrupt header": (lambda d: _garble_header(d / "model.safetensors"), "model.safetensors", "header is not JSON"),
    "header longer than the file": (lambda d: _lie_about_header_length(d / "model.safetensors"), "model.safetensors", "declares a header of"),
    "five bytes": (lambda d: _cut(d / "model.safetensors", 5), "model.safetensors", "too short for a header"),
    "a tensor's bytes disagree with its shape": (lambda d: _wrong_tensor_size(d / "model.safetensors"), "model.safetensors", "is said to take"),
    "invalid config.json": (lambda d: (d / "config.json").write_text('{"model_type": "llama", '), "config.json", "not valid JSON"),
    "config.json not an object": (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json", "not a JSON object"),
}


@pytest.fixture
def broken_model(tiny_model, tmp_path):
    def make(how: str):
        damage, file, words = BROKEN[how]
        copy = tmp_path / how.replace(" ", "-")
        shutil.copytree(tiny_model(arch="llama", layers=2), copy)
        damage(copy)
        return copy, copy / file, words

    return make


@pytest.mark.parametrize("how", BROKEN)
def test_a_broken_model_file_is_one_error_naming_the_file_and_the_problem(broken_model, how):
    path, file, words = broken_model(how)
    with pytest.raises(ModelFileError) as e:
        model_info(str(path))
    assert str(file) in str(e.value) and words in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_an_invalid_index_is_one_error_naming_it_where_a_stage_reads_it(tiny_model, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(tiny_model(arch="llama", layers=2), copy)
    (copy / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ModelFileError, match="model.safetensors.index.json: not valid JSON"):
        weight_files_for(copy, 0, 1)
    (copy / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    with pytest.raises(ModelFileError, match="weight_map must be an object"):
        weight_map(copy)


@pytest.mark.parametrize("how", ["corrupt header", "invalid config.json", "truncated"])
def test_ringd_serve_stops_at_start_with_one_line_naming_the_broken_file(broken_model, how):
    """The issue's cases: a 47-line traceback before; one line now, and the node exits (a truncated
    file no longer starts a node that retries a failing load every 30 s)."""
    from devkit.cluster import Cluster

    path, file, words = broken_model(how)
    c = Cluster(path, 1, path.parent)
    try:
        assert c.procs[0].wait(120) == 1
    finally:
        c.stop()
    lines = c.logs[0].read_text().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert f"ringd serve: {file}" in lines[0] and words in lines[0], lines


def test_a_checkpoint_is_whole_only_with_every_weight_file(tiny_model, tmp_path):
    """What a node serves to peers: a checkpoint whose stages fetched only their own Hub files is not whole."""
    import shutil

    from ringd.models.checkpoint import weights_complete

    src = tiny_model(arch="llama", layers=4, dtype="float32", shard_bytes=40_000)
    assert weights_complete(src)
    part = tmp_path / "part"
    shutil.copytree(src, part)
    next(part.glob("model-*.safetensors")).unlink()
    assert not weights_complete(part)
