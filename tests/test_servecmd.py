"""serve_command: the flags it writes are the ones `ringd serve` parses, into the config they name."""

import argparse

from ringd.node import config
from ringd.base.servecmd import serve_command


def _parsed(cmd: list[str]) -> config.Config:
    assert cmd[1:4] == ["-m", "ringd", "serve"]
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    return config.load(parser.parse_args(cmd[4:]), environ={})


def test_each_keyword_is_its_config_key():
    cmd = serve_command(
        name="node1", cluster="c", model="/m", ring_port=5, http_port=0, peer=["127.0.0.1:1", "127.0.0.1:2"],
        ring_encryption=True, discovery=False, split=None, priority=3,
    )  # fmt: skip
    cfg = _parsed(cmd)
    assert (cfg.name, cfg.cluster, cfg.model, cfg.ring_port, cfg.http_port) == ("node1", "c", "/m", 5, 0)
    assert cfg.peers == ["127.0.0.1:1", "127.0.0.1:2"]
    assert (cfg.ring_encryption, cfg.discovery, cfg.priority, cfg.split) == (True, False, 3, None)
    assert "--split" not in cmd


def test_keywords_keep_their_order():
    assert serve_command("py", model="m", name="n") == ["py", "-m", "ringd", "serve", "--model", "m", "--name", "n"]
