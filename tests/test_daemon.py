"""Starting `ringd serve`: what a user sees when the start cannot work, named so they can fix it."""

from __future__ import annotations

import socket
import subprocess

from devkit import REPO

from ringd.base.servecmd import serve_command


def serve(tmp_path, model, secret_mode: int = 0o600, **flags) -> subprocess.CompletedProcess:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(secret_mode)
    cmd = serve_command(
        name="solo", cluster="t", model=model, secret_file=secret, state_dir=tmp_path / "state", discovery=False,
        host="127.0.0.1", http_host="127.0.0.1", **flags,
    )  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_port_in_use_is_named(tiny_model, tmp_path):
    model = tiny_model(arch="llama", layers=2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for key in ("http-port", "ring-port"):
            other = "ring-port" if key == "http-port" else "http-port"
            r = serve(tmp_path, model, **{key.replace("-", "_"): port, other.replace("-", "_"): 0})
            assert r.returncode == 1, r.stderr
            assert f"{key.replace('-', '_')}: port {port} on 127.0.0.1 is in use" in r.stderr and f"--{key}" in r.stderr, r.stderr


def test_a_secret_file_others_can_read_is_refused_with_the_fix(tiny_model, tmp_path):
    r = serve(tmp_path, tiny_model(arch="llama", layers=2), http_port=0, ring_port=0, secret_mode=0o644)
    assert r.returncode == 1 and "chmod 600" in r.stderr and str(tmp_path / "secret") in r.stderr, r.stderr


def test_an_unsupported_architecture_is_refused_at_start_with_the_supported_list(tiny_model, tmp_path):
    import json
    import shutil

    model = tmp_path / "olmo2-model"
    shutil.copytree(tiny_model(arch="llama", layers=2), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "olmo2"}))
    r = serve(tmp_path, model, http_port=0, ring_port=0)
    assert r.returncode == 1, r.stderr
    assert "model_type 'olmo2' (mlx_lm.models.olmo2) is not supported by the ring" in r.stderr
    assert "supported: deepseek_v2, deepseek_v3, gemma2, gemma3, gemma3_text, glm4_moe, gpt_oss, llama" in r.stderr
