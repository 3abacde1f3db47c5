"""ringd.config: file < environment < flags, and errors that name the key, the source and the reason."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from conftest import REPO
from ringd import config


def parse(argv: list[str], environ: dict | None = None) -> config.Config:
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    return config.load(parser.parse_args(argv), environ or {})


def test_the_example_config_is_valid():
    cfg = parse(["--config", str(REPO / "config" / "cluster.example.yaml")])
    assert cfg.name == "mini1" and cfg.cluster == "home" and cfg.peers == ["10.0.0.2:50051", "10.0.0.3:50051"]
    assert cfg.priority == 10 and cfg.expected_nodes == 3


def test_the_example_config_documents_every_key():
    import re

    text = (REPO / "config" / "cluster.example.yaml").read_text()
    documented = set(re.findall(r"^#? ?([a-z_]+):", text, re.M))
    assert {k.name for k in config.KEYS} <= documented, {k.name for k in config.KEYS} - documented


def test_precedence_file_env_flag(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: a\nring_port: 1000\nhttp_port: 2000\n")
    cfg = parse(["--config", str(f), "--http-port", "3000"], {"RINGD_RING_PORT": "1111", "RINGD_HTTP_PORT": "2222"})
    assert (cfg.ring_port, cfg.http_port) == (1111, 3000)


@pytest.mark.parametrize(
    "yaml_text,needle",
    [
        ("nmae: x\n", "unknown key 'nmae'"),
        ("ring_port: 70000\n", "ring_port (config file"),
        ("ring_port: fast\n", "must be a port number"),
        ("peers: [mini2.local:50051]\n", "names are not resolved"),
        ("peers: [10.0.0.2]\n", "must be IP:PORT"),
        ("name: 'no spaces'\n", "name (config file"),
        ("split: [3, 0]\npeers: ['10.0.0.2:1']\n", "split"),
        ("split: [3, 3, 3]\npeers: ['10.0.0.2:1']\n", "has 3 entries for a ring of 2"),
        ("- just\n- a list\n", "must be a mapping"),
        ("log_level: loud\n", "log_level"),
        ("a: [unclosed\n", "not valid YAML"),
        ("discovery: maybe\n", "discovery (config file"),
        ("prefer_interfaces: bridge0\nmdns_interfaces: [3]\n", "mdns_interfaces"),
    ],
)
def test_bad_files_name_the_key(tmp_path, yaml_text, needle):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(config.ConfigError) as e:
        parse(["--config", str(f)])
    assert needle in str(e.value)


def test_discovery_keys_from_file_env_and_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("discovery: false\nprefer_interfaces: [bridge0, 169.254.0.0/16]\n")
    cfg = parse(["--config", str(f)])
    assert cfg.discovery is False and cfg.prefer_interfaces == ["bridge0", "169.254.0.0/16"] and cfg.mdns_interfaces is None
    cfg = parse(["--discovery", "on", "--mdns-interfaces", "en0, bridge*"], {"RINGD_DISCOVERY": "off"})
    assert cfg.discovery is True and cfg.mdns_interfaces == ["en0", "bridge*"]
    assert parse([]).discovery is True  # on unless turned off


def test_bad_env_and_flags_name_their_source():
    with pytest.raises(config.ConfigError, match="RINGD_RING_PORT"):
        parse([], {"RINGD_RING_PORT": "many"})
    with pytest.raises(config.ConfigError, match="flag --http-port"):
        parse(["--http-port", "-5"])


def test_secret_file_checks(tmp_path):
    with pytest.raises(config.ConfigError, match="no cluster secret"):
        parse([]).read_secret()
    short = tmp_path / "s"
    short.write_text("tooshort")
    with pytest.raises(config.ConfigError, match="at least 16"):
        parse(["--secret-file", str(short)]).read_secret()
    with pytest.raises(config.ConfigError, match="cannot read"):
        parse(["--secret-file", str(tmp_path / "missing")]).read_secret()


def test_serve_stops_at_start_with_the_key_and_reason(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("ring_port: 99999\n")
    r = subprocess.run([sys.executable, "-m", "ringd", "serve", "--config", str(f)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "ring_port" in r.stderr and "port number" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ringd", "serve", "--secret-file", str(tmp_path / "nope"), "--model", "x/y"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "secret_file" in r.stderr
