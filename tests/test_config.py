"""ringd.node.config: file < environment < flags, and errors that name the key, the source and the reason."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devkit import REPO
from ringd.node import config
from ringd.base.servecmd import serve_command


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
        ("tensor_parallel: 0\n", "must be auto or an integer from 1 to 16"),
        ("tensor_parallel: twice\n", "must be auto or an integer from 1 to 16"),
        ("tensor_parallel: auto\nsplit: [3, 3]\npeers: ['10.0.0.2:1']\n", "tensor_parallel: auto chooses them; set one of the two"),
        ("tensor_parallel: 2\nsplit: [2, 2, 2]\npeers: ['10.0.0.2:1', '10.0.0.3:1', '10.0.0.4:1']\n", "has 3 entries for a ring of 2 stages"),
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


def test_tensor_parallel_from_file_env_and_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("tensor_parallel: 2\n")
    assert parse(["--config", str(f)]).tensor_parallel == 2
    assert parse([], {"RINGD_TENSOR_PARALLEL": "auto"}).tensor_parallel == "auto"
    assert parse(["--tensor-parallel", "4"]).tensor_parallel == 4
    assert parse([]).tensor_parallel == 1


def test_bad_env_and_flags_name_their_source():
    with pytest.raises(config.ConfigError, match="RINGD_RING_PORT"):
        parse([], {"RINGD_RING_PORT": "many"})
    with pytest.raises(config.ConfigError, match="flag --http-port"):
        parse(["--http-port", "-5"])


def test_secret_file_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the default ~/.config/ringd/secret, here absent
    with pytest.raises(config.ConfigError) as e:
        parse([]).read_secret()
    default = tmp_path / ".config" / "ringd" / "secret"
    assert f"cannot read {default}" in str(e.value) and f"chmod 600 {default}" in str(e.value)
    short = tmp_path / "s"
    short.write_text("tooshort")
    short.chmod(0o600)
    with pytest.raises(config.ConfigError, match="at least 16"):
        parse(["--secret-file", str(short)]).read_secret()
    with pytest.raises(config.ConfigError, match="cannot read"):
        parse(["--secret-file", str(tmp_path / "missing")]).read_secret()
    with pytest.raises(config.ConfigError, match="not a regular file"):
        parse(["--secret-file", str(tmp_path)]).read_secret()


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o660, 0o666])
def test_a_secret_others_can_read_or_write_is_refused_with_the_fix(tmp_path, mode):
    secret = tmp_path / "my secret"
    secret.write_text("s" * 32)
    secret.chmod(mode)
    with pytest.raises(config.ConfigError) as e:
        parse(["--secret-file", str(secret)]).read_secret()
    assert "secret_file" in str(e.value) and f"chmod 600 '{secret}'" in str(e.value)  # quoted: the name has a space
    assert "s" * 32 not in str(e.value)


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_secret_only_its_owner_can_read_is_read(tmp_path, mode):
    secret = tmp_path / "secret"
    secret.write_text(" " + "s" * 32 + "\n")
    secret.chmod(mode)
    assert parse(["--secret-file", str(secret)]).read_secret() == b"s" * 32
    assert config.read_secret_file(secret) == b"s" * 32  # what ringctl calls


def test_new_keys_and_their_defaults(tmp_path):
    cfg = parse([])
    assert cfg.secret_file == config.DEFAULT_SECRET_FILE == "~/.config/ringd/secret"
    assert cfg.ring_encryption is False and cfg.api_keys_file is None
    assert cfg.read_api_keys() == frozenset()  # no file: the API is open
    cfg = parse(["--api-keys-file", str(tmp_path / "k")], {"RINGD_RING_ENCRYPTION": "on"})
    assert cfg.ring_encryption is True and cfg.api_keys_file == str(tmp_path / "k")
    f = tmp_path / "c.yaml"
    f.write_text("ring_encryption: true\napi_keys_file: /etc/ringd/keys\n")
    cfg = parse(["--config", str(f), "--ring-encryption", "false"])
    assert cfg.ring_encryption is False and cfg.api_keys_file == "/etc/ringd/keys"
    f.write_text("ring_encryption: maybe\n")
    with pytest.raises(config.ConfigError, match="ring_encryption"):
        parse(["--config", str(f)])


def test_keys_is_the_only_source_of_defaults():
    import dataclasses

    fields = dataclasses.fields(config.Config)
    assert [f.name for f in fields] == [k.name for k in config.KEYS]
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)
    a, b = parse([]), parse([])
    assert a.prefer_interfaces is not b.prefer_interfaces  # no Config shares a default list


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: a\nring_port: 1000\nhttp_port: 2000\n\nring_port: 1001\n")
    with pytest.raises(config.ConfigError) as e:
        parse(["--config", str(f)])
    assert str(e.value) == f"config file {f}, line 5: key 'ring_port' is given twice (first on line 2); keep one"
    f.write_text("capabilities:\n  memory_gb: 16\n  gpu_cores: 10\n  memory_gb: 8\n")
    with pytest.raises(config.ConfigError, match=r"line 4: key 'memory_gb' is given twice \(first on line 2\)"):
        parse(["--config", str(f)])
    # A merge is an override on purpose, not a duplicate.
    f.write_text("capabilities: {<<: {memory_gb: 8}, memory_gb: 16}\n")
    assert parse(["--config", str(f)]).capabilities["memory_gb"] == 16


def keys_file(tmp_path, text: str):
    f = tmp_path / "api-keys"
    f.write_bytes(text.encode())
    return parse(["--api-keys-file", str(f)]), f


def test_api_keys_file_skips_blanks_and_comments(tmp_path):
    cfg, _ = keys_file(tmp_path, "# ops team\n\n  sk-0123456789abcdef  \r\n#sk-commented-out-key-xx\nsk-fedcba9876543210\nsk-0123456789abcdef\n")
    assert cfg.read_api_keys() == {"sk-0123456789abcdef", "sk-fedcba9876543210"}


@pytest.mark.parametrize(
    "text,line,needle",
    [
        ("# keys\nsk-0123456789abcdef\nsk-short\n", 3, "at least 16 characters"),
        ("\n\nsk-0123 456789abcdef\n", 3, "without spaces"),
        ("sk-0123456789abcdef\nsk-0123456789abcdé\n", 2, "printable ASCII"),
        ("sk-0123456789\tabcdef\n", 1, "printable ASCII"),
    ],
)
def test_a_bad_api_key_is_named_by_its_line_never_shown(tmp_path, text, line, needle):
    cfg, f = keys_file(tmp_path, text)
    with pytest.raises(config.ConfigError) as e:
        cfg.read_api_keys()
    message = str(e.value)
    assert message.startswith(f"api_keys_file: {f}, line {line}: ") and needle in message
    assert text.splitlines()[line - 1].strip() not in message


def test_an_api_keys_file_without_keys_or_unreadable_is_refused(tmp_path):
    cfg, f = keys_file(tmp_path, "# nothing yet\n\n")
    with pytest.raises(config.ConfigError, match=f"api_keys_file: {f} holds no keys"):
        cfg.read_api_keys()
    with pytest.raises(config.ConfigError, match="api_keys_file: cannot read"):
        parse(["--api-keys-file", str(tmp_path / "missing")]).read_api_keys()
    cfg, f = keys_file(tmp_path, "")
    f.write_bytes(b"sk-0123456789abcdef\n\xff\xfe-key-in-latin-1-xx\n")
    with pytest.raises(config.ConfigError, match="line 2: not UTF-8"):
        cfg.read_api_keys()


_KEY_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x7E)  # printable ASCII, no space


@given(
    keys=st.lists(st.text(_KEY_CHARS, min_size=config.MIN_API_KEY_CHARS, max_size=64).filter(lambda k: not k.startswith("#")), min_size=1, max_size=8),
    noise=st.lists(st.sampled_from(["", "   ", "# a comment", "#", "\t# indented comment"]), max_size=8),
    data=st.data(),
)
@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_api_keys_file_reads_exactly_its_keys(tmp_path, keys, noise, data):
    lines = data.draw(st.permutations(keys + noise))
    cfg, _ = keys_file(tmp_path, "\n".join(lines))
    assert cfg.read_api_keys() == frozenset(keys)


@given(
    good=st.text(_KEY_CHARS, min_size=config.MIN_API_KEY_CHARS, max_size=32).filter(lambda k: not k.startswith("#")),
    bad=st.one_of(
        # Short ones of 8 or more: a shorter one could be a word of the message by chance.
        st.text(_KEY_CHARS, min_size=8, max_size=config.MIN_API_KEY_CHARS - 1),
        st.tuples(st.text(_KEY_CHARS, min_size=8, max_size=20), st.text(_KEY_CHARS, min_size=8, max_size=20)).map(" ".join),
    ).filter(lambda k: not k.startswith("#")),
    before=st.integers(0, 3),
)
@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_bad_api_key_appears_in_its_error(tmp_path, good, bad, before):
    cfg, f = keys_file(tmp_path, "\n".join([good] * before + [bad, good]))
    with pytest.raises(config.ConfigError) as e:
        cfg.read_api_keys()
    message = str(e.value).removeprefix(f"api_keys_file: {f}, line {before + 1}: ")
    assert message != str(e.value), str(e.value)
    assert bad not in message and good not in message


def test_serve_stops_at_start_with_the_key_and_reason(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("ring_port: 99999\n")
    r = subprocess.run(serve_command(config=f), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "ring_port" in r.stderr and "port number" in r.stderr
    r = subprocess.run(serve_command(secret_file=tmp_path / "nope", model="x/y"), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "secret_file" in r.stderr


def test_chat_template_kwargs_come_from_the_file_a_flag_or_the_environment(tmp_path):
    f = tmp_path / "ringd.yaml"
    f.write_text("chat_template_kwargs: {enable_thinking: false}\n")
    assert parse(["--config", str(f)]).chat_template_kwargs == {"enable_thinking": False}
    assert parse(["--chat-template-kwargs", '{"enable_thinking": true}']).chat_template_kwargs == {"enable_thinking": True}
    assert parse([], {"RINGD_CHAT_TEMPLATE_KWARGS": '{"reasoning_effort": "low"}'}).chat_template_kwargs == {"reasoning_effort": "low"}
    assert parse([]).chat_template_kwargs == {}
    with pytest.raises(config.ConfigError, match="chat_template_kwargs"):
        parse(["--chat-template-kwargs", "enable_thinking=false"])
