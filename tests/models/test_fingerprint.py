"""ringd.models.fingerprint: what identifies a model, its config and its weights, wherever its files are."""

from __future__ import annotations

import json
import shutil

from ringd.models.fingerprint import weights_digest
from ringd.models.source import model_info


def test_the_fingerprint_covers_the_weights_not_only_the_config(tiny_model, tmp_path):
    a = model_info(str(tiny_model(arch="llama", layers=2, seed=0)))
    b = model_info(str(tiny_model(arch="llama", layers=2, seed=1)))  # a "fine-tune": same config, other weights
    assert json.loads((a.path / "config.json").read_text()) == json.loads((b.path / "config.json").read_text())
    assert a.fingerprint != b.fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(a.path, copy)
    assert model_info(str(copy)).fingerprint == a.fingerprint  # the same weights anywhere


def test_a_hub_snapshot_is_named_by_its_commit(tiny_model, tmp_path):
    snapshot = tmp_path / "hub" / "models--owner--name" / "snapshots" / ("c" * 40)
    shutil.copytree(tiny_model(arch="llama", layers=2), snapshot)
    # Even a node that fetched only its own layers' files knows the commit.
    for f in snapshot.glob("model*.safetensors"):
        f.unlink()
    assert weights_digest(snapshot) == f"hub:models--owner--name@{'c' * 40}"
