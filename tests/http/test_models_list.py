"""The model list: ``GET /v1/models``, ``GET /api/tags``, ``GET /cluster/models`` and ``ringctl models``
show every model the node could serve, the loaded one first and marked, with size, quant,
architecture and whether the cluster's memory holds it.

The real HTTP app (``http/api.py``) runs in this process on loopback, over a stand-in for
the daemon that holds what the app asks of it (a real catalogue of a models_dir of tiny
GGUFs and an mlx-lm directory, and the daemon's own ``fit_rule`` over members whose
budgets the test sets): no ring is needed to list models, so none is started.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from devkit.ggufmake import write_gguf

from ringd.app import ctl
from ringd.cluster.placement import ModelCost
from ringd.cluster.memberinfo import MemberInfo
from ringd.app.daemon import Node as RingNode
from ringd.http.api import Api
from ringd.base.metrics import Metrics
from ringd.models.catalogue import Catalogue, match
from ringd.models.source import model_info

KV_RESERVE_TOKENS = 16


class Config:
    kv_reserve_tokens, kv_bits, kv_group_size = KV_RESERVE_TOKENS, None, 64


class Members:
    """The cluster as the node's fit_rule reads it: node1 is api_only (it holds no layers)."""

    def __init__(self, infos: dict[str, MemberInfo]):
        self.infos = infos

    def member_infos(self) -> dict[str, MemberInfo]:
        return self.infos


class Node:
    """What the HTTP app asks of its node, for the model routes; fit_rule is the daemon's own."""

    fit_rule = RingNode.fit_rule
    name, started, tokenizer, secret, api_keys = "node0", 1_700_000_000, None, b"", frozenset()
    chat_template_kwargs, failover_wait_s, files, client_ssl, engine, leading, leader = {}, 1.0, None, None, None, True, "node0"
    drained: set = set()

    def __init__(self, info, catalogue: Catalogue, budget: int):
        self.info, self.model_id, self.catalogue, self.budget = info, "tiny", catalogue, budget
        self.metrics = Metrics(self.name)
        self.cfg = Config()
        self.cluster = Members({"node0": MemberInfo(budget=budget), "node1": MemberInfo(budget=10 * budget, api_only=True)})

    def members(self) -> set[str]:
        return {"node0", "node1"}

    def readiness(self) -> tuple[bool, str]:
        return True, ""

    def instances(self) -> list[dict]:
        return []  # the model list's own facts: no instance loaded on demand


def test_every_model_is_listed_with_its_facts_and_fit(tiny_model, tmp_path, monkeypatch, capsys):
    model = tiny_model(arch="llama", layers=2)
    models = tmp_path / "models"
    models.mkdir()
    q8 = write_gguf(model, models / "Tiny-Q8_0.gguf", qtype="q8_0")
    f32 = write_gguf(model, models / "Tiny-F32.gguf", qtype="f32")
    write_gguf(model, models / "odd.gguf", arch="nosucharch")
    (models / "tiny-mlx").symlink_to(model, target_is_directory=True)
    loaded, whole = model_info(str(q8)), model_info(str(f32))
    # node0's budget holds the Q8_0 file but not the F32 one; node1 holds no layers (api_only).
    need = [ModelCost.of(i, KV_RESERVE_TOKENS).stage_need(0, 2) for i in (loaded, whole)]
    assert need[0] < need[1]
    node = Node(loaded, Catalogue(models, hf_cache=tmp_path / "no-hf", ollama_store=tmp_path / "no-ollama"), (need[0] + need[1]) // 2)
    monkeypatch.setenv("HOME", str(tmp_path))  # no cluster secret: ringctl asks unsigned
    monkeypatch.delenv("RINGD_SECRET_FILE", raising=False)

    async def run():
        api = Api(node)
        port = await api.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                answers = {}
                for path in ("/v1/models", "/api/tags", "/cluster/models"):
                    async with http.get(base + path) as r:
                        assert r.status == 200, await r.text()
                        answers[path] = await r.json()
            code = await asyncio.to_thread(ctl.main, ["--node", f"127.0.0.1:{port}", "--known-nodes", str(tmp_path / "known"), "models"])
            return answers, code
        finally:
            await api.stop()

    answers, code = asyncio.run(run())

    openai = answers["/v1/models"]["data"]
    # The loaded model by the name it is served as; the others as the catalogue names them (models_dir's relative to it).
    # (What cannot be served after what can: odd.gguf, an architecture ringd does not know, last.)
    assert [m["id"] for m in openai] == ["tiny", "Tiny-F32.gguf", "tiny-mlx", "odd.gguf"]
    first = openai[0]
    assert first["loaded"] is True and first["created"] == node.started and first["object"] == "model"
    assert (first["format"], first["quant"], first["architecture"], first["layers"], first["size"]) == ("gguf", "Q8_0", "llama", 2, q8.stat().st_size)
    assert first["fits"] is True and first["fit"] == ""
    big, mlx, odd = openai[1:]
    assert big["loaded"] is False and big["quant"] == "F32" and big["fits"] is False and "short by" in big["fit"]
    assert odd["fits"] is None and "nosucharch" in odd["error"]
    assert (mlx["format"], mlx["architecture"], mlx["source"]) == ("mlx", "llama", "models_dir")
    assert all("path" not in m for m in openai)  # paths only on the keyed or signed /cluster/models

    tags = answers["/api/tags"]["models"]
    assert tags[0]["name"] == "tiny:latest" and tags[0]["digest"] == loaded.fingerprint and tags[0]["loaded"] is True
    # Named as Ollama's clients spell names (tagged), each finding its model again.
    assert [t["name"] for t in tags[1:]] == [f"{m['id']}:latest" for m in openai[1:]]
    entries = node.catalogue.current().entries
    assert [match(entries, t["name"]).name for t in tags[1:]] == [m["id"] for m in openai[1:]]
    assert tags[1]["details"]["quantization_level"] == "F32" and tags[1]["details"]["family"] == "llama" and tags[1]["fits"] is False

    rows = answers["/cluster/models"]["models"]
    assert rows[0]["started_as"] == "Tiny-Q8_0.gguf" and rows[0]["path"] == str(q8) and not answers["/cluster/models"]["truncated"]
    assert [r["path"] for r in rows[1:]] == [str(f32), str(models / "tiny-mlx"), str(models / "odd.gguf")]  # whole paths here

    out = capsys.readouterr().out
    assert code == 0, out
    table = out.splitlines()
    (row,) = [line for line in table if "│ tiny " in line]
    assert "●" in row and "Q8_0" in row and "yes" in row
    (row,) = [line for line in table if "Tiny-F32.gguf" in line and "│" in line]
    assert " no " in row
    assert any(line.startswith("odd.gguf: ") and "nosucharch" in line for line in table)
    assert any(line.startswith("Tiny-F32.gguf: ") and "short by" in line for line in table)
    assert json.dumps(rows)  # the raw list (ringctl models --json) is JSON as it came


def test_loaded_models_are_listed_first_even_past_a_listing_cut_short_and_unservable_files_last(tiny_model, tmp_path):
    """A listing that stopped at its bound (MAX_MODELS) may not hold a model the leader loaded from
    it: that model is listed still, marked loaded, after the configured one; the models that can
    be served come before the files that cannot (each with its error)."""
    from pathlib import Path

    from ringd.http.models_list import _rows
    from ringd.models.catalogue import MODELS_DIR, Entry, Facts, Listing

    base, other, loaded = (model_info(str(tiny_model(arch=a, layers=2))) for a in ("llama", "qwen3", "qwen2"))
    bad = [Entry(f"a-{i}.gguf", MODELS_DIR, Path(f"/m/a-{i}.gguf"), 64, 0.0, Facts("gguf", "", "", 0, None, "not a readable GGUF file")) for i in range(3)]
    good = Entry("other", MODELS_DIR, other.path, 1, 0.0, Facts("mlx", "", "qwen3", 2, other))
    listing = Listing([*bad, good], truncated=True)
    rows = _rows(listing, base, "base", lambda info: None, {"on-demand": loaded})
    assert [r["name"] for r in rows] == ["base", "on-demand", "other", "a-0.gguf", "a-1.gguf", "a-2.gguf"]
    assert [r["loaded"] for r in rows] == [True, True, False, False, False, False]
    assert rows[1]["layers"] == 2 and rows[1]["architecture"] == "qwen2" and not rows[1]["error"]


def test_api_tags_spells_every_name_as_ollama_does_unless_two_would_share_one():
    from ringd.http.models_list import ollama_models

    row = {"architecture": "llama", "format": "gguf", "quant": "Q4_K_M", "modified": 0.0, "size": 1, "loaded": False,
           "source": "", "layers": 2, "fits": True, "fit": "", "error": ""}  # fmt: skip
    names = ["base", "ollama:smolk:135m-q4km", "tiny-a", "someone/Tiny-GGUF:Q4_0", "ollama:tiny-a:latest"]
    spelled = [m["name"] for m in ollama_models([row | {"name": n} for n in names])]
    # tiny-a and Ollama's tiny-a:latest would share a name: each keeps its own, which finds it exactly.
    assert spelled == ["base:latest", "smolk:135m-q4km", "tiny-a", "someone/Tiny-GGUF:Q4_0", "ollama:tiny-a:latest"]
