"""The dashboard (ringd/http/web/) in a real browser: Debian's headless Chromium, driven by Playwright.

The page is served by a FOLLOWER of a real three-node ring of `ringd serve`
daemons and talks only to that node. It must draw the three nodes in ring order,
crown the leader and show every layer range; while a stream runs its tokens/s
figure must change; the chat box must answer; the Models panel must list the
configured model on that same ring. A screenshot is kept as an
artifact. A second test covers a node with API keys (the page asks for the key,
then draws the ring and chats with it) and a node that goes away and comes back
(the page says so, keeps polling, and recovers); on that node's models folder the
page loads a second model through its Models panel, sees it loading and then serving
on its own ring, and unloads it. A third test serves the page a status document of
states a test ring cannot show on demand.

Playwright drives the system's Chromium (``executable_path``); it never downloads
a browser of its own (``playwright install`` is not used).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from devkit.cluster import serving_leader
from playwright.sync_api import expect, sync_playwright

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
# Where the screenshot is copied so CI can keep it (the tmp dir is pruned later).
ARTIFACTS = Path("/tmp/ringd-test-artifacts")
# Generous waits for the page: a ring's first plan, a CPU-only MLX stream of many tokens.
PAGE_WAIT_MS = 60_000
STREAM_WAIT_MS = 180_000
# Long enough that the stream runs through several refreshes of its tokens/s figure.
LONG_ANSWER_TOKENS = 1200

# Every distinct positive number the tokens/s figure shows while an answer streams,
# recorded in the page as the figure changes (polling from here could miss some).
RECORD_TOKENS_PER_S = """() => {
    const figure = document.getElementById("tokens-per-s");
    window.tokensPerSecondSeen = new Set();
    new MutationObserver(() => {
        const value = Number.parseFloat(figure.textContent);
        const streaming = document.querySelector("#chat-output .msg.assistant.streaming") !== null;
        if (streaming && Number.isFinite(value) && value > 0) window.tokensPerSecondSeen.add(value);
    }).observe(figure, {childList: true, characterData: true, subtree: true});
}"""


@pytest.fixture
def browser(tmp_path):
    """A fresh headless Chromium (its own profile under tmp_path), closed after the test."""
    assert Path(CHROMIUM).exists(), f"Chromium is not installed ({CHROMIUM}); `apt-get install chromium` (.ci/run installs it)"
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 900}, service_workers="block",
        )  # fmt: skip
        try:
            yield context
        finally:
            context.close()


def open_page(context, url: str):
    """The page at url; uncaught script errors collect in page.script_errors, the
    browser's console errors (such as each failed request) in page.console_errors."""
    page = context.new_page()
    page.script_errors, page.console_errors = [], []
    page.on("pageerror", lambda e: page.script_errors.append(str(e)))
    page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
    page.set_default_timeout(PAGE_WAIT_MS)
    page.goto(url)
    return page


def keep_screenshot(page, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    kept = ARTIFACTS / name
    shutil.copyfile(shot, kept)
    print(f"\ndashboard screenshot: {kept} (and {shot})")
    return kept

# Each model row's state as it changes ("name:state", each change once), recorded in the page:
# a tiny model loads in a moment, quicker than polling from here could see it loading.
RECORD_MODEL_STATES = """() => {
    window.modelStatesSeen = [];
    const note = () => {
        for (const row of document.querySelectorAll("#models .instance[data-model]:not([data-pinned='true'])")) {
            const seen = `${row.dataset.model}:${row.dataset.state}`;
            if (window.modelStatesSeen.at(-1) !== seen && !window.modelStatesSeen.includes(seen)) window.modelStatesSeen.push(seen);
        }
    };
    new MutationObserver(note).observe(document.getElementById("models"), {childList: true, attributes: true, subtree: true});
}"""


def test_dashboard_on_a_follower_draws_the_ring_and_chats(tiny_model, cluster_factory, browser, tmp_path):

    c = cluster_factory(tiny_model(arch="llama", layers=6), 3)
    c.wait(lambda: serving_leader(c, range(3)) == "node0", what="node0 to lead")
    stages = c.wait(lambda: len(((c.status(1) or {}).get("plan") or {}).get("stages", [])) == 3 and c.status(1)["plan"]["stages"], what="a plan of three stages")

    page = open_page(browser, c.url(1) + "/dashboard")
    expect(page.locator("#served-by")).to_have_text("node1")
    expect(page.locator("#cluster-leader")).to_have_text("node0")
    # The ring: three nodes on it, in plan order, each with its layer range; the leader crowned.
    for name, _addr, start, end in stages:
        for where in ("#ring", "#nodes"):
            node = page.locator(f'{where} [data-node="{name}"][data-in-ring="true"]')
            expect(node.locator(".layers")).to_have_text(f"[{start}, {end})")
            expect(node).to_have_attribute("data-health", "ready")
    expect(page.locator("#ring .ring-node")).to_have_count(3)
    expect(page.locator("#nodes .node-card")).to_have_count(3)
    assert page.locator("#nodes .node-card").evaluate_all("cards => cards.map(c => c.dataset.node)") == [s[0] for s in stages]
    for where in ("#ring", "#nodes"):
        expect(page.locator(f'{where} [data-role="leader"]')).to_have_count(1)
        expect(page.locator(f'{where} [data-role="leader"]')).to_have_attribute("data-node", "node0")
    expect(page.locator("#ring .crown")).to_have_count(1)
    # Every link between consecutive stages is up, the closing one back to the leader too.
    ring = [s[0] for s in stages]
    for a, b in zip(ring, ring[1:] + ring[:1]):
        expect(page.locator(f'#ring .link[data-from="{a}"][data-to="{b}"]')).to_have_attribute("data-up", "true")
    expect(page.locator('#nodes [data-node="node2"] .bar-weights')).to_have_count(1)
    # The Models panel: the configured model, serving on that same ring, pinned (no Unload button).
    configured = page.locator('#models .instance[data-instance=""]')
    expect(configured).to_have_attribute("data-state", "ready")
    expect(configured.locator(".model-name")).to_have_text("tiny")
    expect(configured.locator(".hop")).to_have_text([f"{name} [{start}, {end})" for name, _addr, start, end in stages])
    expect(configured.locator(".keep-alive")).to_have_text("forever")
    expect(configured.locator("button.unload")).to_have_count(0)

    # A long answer through the chat box: the tokens/s figure changes while it streams.
    # Greedy, so the answer runs to max_tokens: sampled, the tiny model may end it at once.
    page.evaluate(RECORD_TOKENS_PER_S)
    requests = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and requests.append(r))
    page.fill("#chat-max-tokens", str(LONG_ANSWER_TOKENS))
    page.fill("#chat-temperature", "0")
    page.fill("#chat-input", "Tell me about rings.")
    page.click("#chat-send")
    answer = page.locator("#chat-output .msg.assistant").last
    expect(answer.locator(".text")).to_have_text(re.compile(r"\S"))
    page.wait_for_function("() => window.tokensPerSecondSeen.size >= 2", timeout=STREAM_WAIT_MS)
    keep_screenshot(page, tmp_path, "dashboard.png")  # mid-stream: the live figures and a growing answer
    expect(answer).to_have_attribute("data-done", "true", timeout=STREAM_WAIT_MS)
    expect(answer.locator(".error")).to_have_count(0)
    first_answer = answer.locator(".text").text_content()
    assert first_answer.strip()

    # The chat box goes to the node that served the page and keeps the conversation.
    page.fill("#chat-max-tokens", "5")
    page.fill("#chat-input", "And squares?")
    page.click("#chat-send")
    second = page.locator("#chat-output .msg.assistant").nth(1)
    expect(second).to_have_attribute("data-done", "true", timeout=STREAM_WAIT_MS)
    expect(second.locator(".error")).to_have_count(0)
    assert [r.url for r in requests] == [c.url(1) + "/v1/chat/completions"] * 2
    first, then = (json.loads(r.post_data) for r in requests)
    assert first["model"] == "tiny" and first["stream"] is True and first["max_tokens"] == LONG_ANSWER_TOKENS and first["temperature"] == 0
    assert then["messages"] == [
        {"role": "user", "content": "Tell me about rings."},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "And squares?"},
    ]
    expect(page.locator("#banner")).to_be_hidden()
    assert page.script_errors == [] and page.console_errors == []


def test_dashboard_asks_for_the_api_key_and_rides_out_a_restart(tiny_model, cluster_factory, browser, tmp_path):

    key = "dashboard-key-0123456789abcdef"
    (tmp_path / "keys").write_text(key + "\n")
    models = tmp_path / "models"  # a user's models folder: one more model, under the name a request gives it
    models.mkdir()
    (models / "tiny-b").symlink_to(tiny_model(arch="qwen3", layers=4))
    c = cluster_factory(tiny_model(arch="llama", layers=6), 1, extra=["--api-keys-file", str(tmp_path / "keys"), "--models-dir", str(models)])
    c.wait(lambda: serving_leader(c, [0]) == "node0", what="node0 to serve")

    page = open_page(browser, c.url(0) + "/")
    expect(page.locator("#banner")).to_have_attribute("data-kind", "auth")
    expect(page.locator("#banner")).to_contain_text("API key")
    expect(page.locator("#cluster-ready")).to_have_attribute("data-state", "auth")

    page.fill("#api-key", key)
    page.click("#api-key-save")
    expect(page.locator('#ring [data-node="node0"]')).to_have_attribute("data-role", "leader")
    expect(page.locator('#nodes [data-node="node0"] .layers')).to_have_text("[0, 6)")
    expect(page.locator("#banner")).to_be_hidden()
    assert page.evaluate("() => localStorage.getItem('ringd.apiKey')") == key

    requests = []
    page.on("request", lambda r: requests.append(r))
    page.fill("#chat-max-tokens", "8")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-input", "hi")
    page.press("#chat-input", "Enter")
    answer = page.locator("#chat-output .msg.assistant").last
    expect(answer).to_have_attribute("data-done", "true", timeout=STREAM_WAIT_MS)
    expect(answer.locator(".error")).to_have_count(0)
    expect(answer.locator(".text")).to_have_text(re.compile(r"\S"))

    # Models, loaded and unloaded from the page (through the key): a name no list holds is
    # refused with the node's message; tiny-b shows as loading, then serving on its own ring.
    expect(page.locator('#models .instance[data-instance=""] .model-name')).to_have_text("tiny")
    page.focus("#load-model")  # the list's names offered in the box
    expect(page.locator('#model-names option[value="tiny-b"]')).to_have_count(1)
    page.fill("#load-model", "no-such-model")
    page.click("#load-submit")
    expect(page.locator("#load-status")).to_have_attribute("data-kind", "error")
    expect(page.locator("#load-status")).to_contain_text("no-such-model: 404")
    page.evaluate(RECORD_MODEL_STATES)
    page.fill("#load-model", "tiny-b")
    page.fill("#load-keep-alive", "10m")
    page.click("#load-submit")
    row = page.locator('#models .instance[data-instance="tiny-b"]')
    expect(row).to_have_attribute("data-state", "ready", timeout=STREAM_WAIT_MS)
    expect(row.locator(".hop")).to_have_text(["node0 [0, 4)"])
    expect(row.locator(".keep-alive")).to_have_text("10m0s")
    expect(row.locator(".expires")).to_contain_text("if idle")
    expect(page.locator("#load-status")).to_have_text("tiny-b serves")
    expect(page.locator("#models .instance")).to_have_count(2)
    keep_screenshot(page, tmp_path, "dashboard-models.png")
    row.locator("button.unload").click()
    expect(row).to_have_count(0)
    expect(page.locator("#load-status")).to_have_text("tiny-b unloaded")
    expect(page.locator("#models .instance")).to_have_count(1)
    assert page.evaluate("() => window.modelStatesSeen") == ["tiny-b:loading", "tiny-b:ready", "tiny-b:unloading"]
    loads = [r for r in requests if r.url.endswith("/api/generate")]
    assert [json.loads(r.post_data) for r in loads] == [
        {"model": "no-such-model", "prompt": "", "stream": False},
        {"model": "tiny-b", "prompt": "", "keep_alive": "10m", "stream": False},
        {"model": "tiny-b", "keep_alive": 0, "stream": False},
    ]
    assert all(r.headers.get("authorization") == f"Bearer {key}" for r in loads)

    # The node goes away: the page says so and keeps asking; it comes back: the page recovers.
    c.signal(0, signal.SIGTERM)
    expect(page.locator("#banner")).to_have_attribute("data-kind", "lost")
    expect(page.locator("#cluster-ready")).to_have_attribute("data-state", "lost")
    c.start(0)
    expect(page.locator("#banner")).to_be_hidden(timeout=STREAM_WAIT_MS)
    expect(page.locator('#nodes [data-node="node0"]')).to_have_attribute("data-health", "ready", timeout=STREAM_WAIT_MS)
    expect(page.locator("#cluster-ready")).to_have_attribute("data-state", "ready")
    # (The console has errors here: the browser logs each 401 and each refused connection.)
    assert page.script_errors == []


def node_status(name: str, role: str, stage: int | None, layers: list[int] | None, links: dict, **extra) -> dict:
    """A node's entry of /cluster/status, with the keys status.py gives it."""
    return {
        "node": name, "role": role, "leader": "m1", "election_term": [7, "m1"], "pin": None, "ready": True, "reason": "",
        "term": 7, "addr": f"10.0.0.{name[-1]}:50051", "http": f"10.0.0.{name[-1]}:8100", "model": "qwen3-32b",
        "budget": 48 * 2**30, "speed": 9.5, "device": {"chip": "Apple M2 Max", "gpu_cores": 38}, "ring_encryption": True,
        "stage": stage, "layers": layers, "sessions": 1, "kv_bytes": 2 * 2**30, "parameter_bytes": 20 * 2**30,
        "kv_capacity": 28 * 2**30, "queued_requests": 0, "active_requests": 0, "peers": sorted(links), "links": links,
        "drained": [], "progress": None, **extra,
    }  # fmt: skip


def instance(name: str, model: str, stages: list, ready: bool = True, reason: str = "", pinned: bool = False, keep_alive: str = "5m0s", **extra) -> dict:
    """A row of the leader's "instances", with the keys node/pool.py gives it."""
    return {
        "instance": name, "model": model, "source": name.split("#")[0], "pinned": pinned, "ready": ready, "reason": reason,
        "loaded_at": time.time() - 60, "expires_at": None if pinned else time.time() + 300, "keep_alive": keep_alive,
        "active": 0, "queued": 0, "served": 0, "term": 3, "stages": stages, "layers": stages[-1][2], "weights": 5 * 2**30, **extra,
    }  # fmt: skip


def test_dashboard_draws_progress_encryption_silent_and_drained_nodes(browser, tmp_path):
    """What a ring here cannot show on demand (a Hub download needs the network; a node that stops
    answering mid-poll is a moment): a status document of that shape, served to the real page
    through the browser's request routing, with the page's own files from ringd/http/web/."""

    from ringd.http.api import WEB_DIR

    locked = {"number": 2, "encrypted": True}
    doc = {
        "node": "m2", "leader": "m1", "ready": False, "reason": "m3 is downloading its layers",
        "plan": {"term": 7, "leader": "m1", "model": "ab12", "num_layers": 64,
                 "stages": [["m1", "10.0.0.1:50051", 0, 30], ["m2", "10.0.0.2:50051", 30, 52], ["m3", "10.0.0.3:50051", 52, 64]]},
        "nodes": [
            node_status("m1", "leader", 0, [0, 30], {"m2": locked, "m3": locked, "m4": locked}, drained=["m4"],
                        stats={"tokens_per_s": 17.25, "ttft_s": 0.42, "active_requests": 2, "queued_requests": 1, "requests_total": 40, "tokens_out_total": 9000,
                               "micro_batches": 3, "draft_acceptance": 0.7512},
                        instances=[instance("", "qwen3-32b", [["m1", 0, 30], ["m2", 30, 52], ["m3", 52, 64]], pinned=True, keep_alive="forever", active=2, queued=1, served=40),
                                   instance("gemma3", "gemma3", [["m4", 0, 26]], ready=False, reason="m4 is loading its layers"),
                                   instance("gemma3#2", "gemma3", [["m2", 0, 26]], served=7)]),
            node_status("m2", "follower", 1, [30, 52], {"m1": locked, "m4": locked}),  # its link to m3 is down
            node_status("m3", "follower", 2, None, {"m1": locked}, ready=False, reason="downloading",
                        progress={"phase": "download", "file": "model-00004-of-00006.safetensors", "files_done": 3, "files_total": 6,
                                  "bytes": 3 * 2**30, "total_bytes": 12 * 2**30, "rate_bytes_s": 80 * 2**20, "layers": [52, 64]}),
            {"node": "m4", "ready": False, "error": "no answer: timed out"},
        ],
    }  # fmt: skip

    def serve(route):
        path = route.request.url.split("ringd.invalid", 1)[1]
        if path == "/cluster/status":
            return route.fulfill(json=doc)
        if path == "/v1/models":
            return route.fulfill(json={"object": "list", "data": [{"id": "qwen3-32b", "loaded": True}, {"id": "llama3.1-70b", "loaded": False, "fits": False, "fit": "short 9.0 GiB"}]})
        if path == "/api/generate":  # what the leader answers a model that cannot fit
            return route.fulfill(status=503, json={"error": "llama3.1-70b does not fit: the nodes are short 9.0 GiB"})
        name = {"/dashboard": "index.html"}.get(path) or path.removeprefix("/static/")
        types = {"html": "text/html", "js": "text/javascript", "css": "text/css"}
        route.fulfill(body=(WEB_DIR / name).read_bytes(), content_type=types[name.rsplit(".", 1)[1]])

    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(PAGE_WAIT_MS)
    page.route("http://ringd.invalid/**", serve)
    page.goto("http://ringd.invalid/dashboard")

    expect(page.locator("#ring .ring-node")).to_have_count(4)
    expect(page.locator('#ring [data-node="m1"]')).to_have_attribute("data-role", "leader")
    expect(page.locator('#ring [data-node="m4"]')).to_have_attribute("data-in-ring", "false")
    expect(page.locator('#nodes [data-node="m4"] .health')).to_have_text("no answer: timed out")
    expect(page.locator('#nodes [data-node="m4"]')).to_have_attribute("data-health", "error")
    # Links: m1 -> m2 up and sealed, m2 -> m3 down, m3 -> m1 up and sealed.
    expect(page.locator('#ring .link[data-from="m1"][data-to="m2"]')).to_have_attribute("data-encrypted", "true")
    expect(page.locator('#ring .link[data-from="m1"][data-to="m2"] .lock')).to_have_count(1)
    expect(page.locator('#ring .link[data-from="m2"][data-to="m3"]')).to_have_attribute("data-up", "false")
    expect(page.locator('#ring .link[data-from="m3"][data-to="m1"]')).to_have_attribute("data-up", "true")
    # m3's download: a bar a quarter full, its file and rate; the ring says how far.
    progress = page.locator('#nodes [data-node="m3"] .progress')
    expect(progress).to_contain_text("downloading layers [52, 64)")
    expect(progress).to_contain_text("model-00004-of-00006.safetensors (3 of 6 files)")
    expect(progress).to_contain_text("3.00 GiB of 12.0 GiB (25%)")
    expect(progress).to_contain_text("80.0 MiB/s")
    assert progress.locator(".bar-progress").evaluate("e => e.style.width") == "25%"
    expect(page.locator('#ring [data-node="m3"] .note')).to_have_text("downloading 25%")
    expect(page.locator('#nodes [data-node="m2"] .mem-legend')).to_contain_text("weights 20.0 GiB")
    expect(page.locator('#nodes [data-node="m2"] .mem-legend')).to_contain_text("KV 2.00 GiB of 28.0 GiB")
    # The leader's figures.
    expect(page.locator("#tokens-per-s")).to_have_text("17.3")
    expect(page.locator("#ttft")).to_have_text("420 ms")
    figures = {"active-requests": "2", "queued-requests": "1", "requests-total": "40", "tokens-out-total": "9,000", "micro-batches": "3", "draft-acceptance": "75%"}
    for figure, value in figures.items():
        expect(page.locator(f"#{figure}")).to_have_text(value)
    expect(page.locator("#cluster-ready")).to_have_attribute("data-state", "waiting")
    # The leader's instances: the configured model (pinned: no Unload), one loading, a replica serving.
    expect(page.locator("#models .instance")).to_have_count(3)
    expect(page.locator('#models [data-instance=""] .requests')).to_have_text("2 / 1 / 40")
    expect(page.locator('#models [data-instance=""] button.unload')).to_have_count(0)
    loading = page.locator('#models [data-instance="gemma3"]')
    expect(loading).to_have_attribute("data-state", "loading")
    expect(loading.locator(".reason")).to_have_text("m4 is loading its layers")
    expect(loading.locator(".hop")).to_have_text(["m4 [0, 26)"])
    expect(page.locator('#models [data-instance="gemma3#2"] .replica')).to_have_text("#2")
    expect(page.locator('#models [data-instance="gemma3#2"] .expires')).to_contain_text(re.compile(r"if idle \(in (4 min \d+|5 min 0) s\)"))
    expect(page.locator("#models button.unload")).to_have_count(2)
    expect(page.locator("#models-caption")).to_have_text("3 loaded, 2 serving")
    expect(page.locator('#model-names option[value="llama3.1-70b"]')).to_have_attribute("label", "does not fit: short 9.0 GiB")
    page.fill("#load-model", "llama3.1-70b")
    page.click("#load-submit")
    expect(page.locator("#load-status")).to_have_text("llama3.1-70b: 503: llama3.1-70b does not fit: the nodes are short 9.0 GiB")
    expect(page.locator('#models .instance[data-pending="true"]')).to_have_count(0)
    keep_screenshot(page, tmp_path, "dashboard-states.png")
    assert errors == []


def test_a_tensor_parallel_group_is_one_stage_of_cards_named_together(tiny_model, browser):
    """A ring of two groups of two: each group drawn as its first member on the ring, every member
    a card of its stage's layers, and the caption naming each group."""
    from devkit.rings import Ring

    ring = Ring(tiny_model(arch="llama", layers=4), 4, tensor_parallel=2)
    try:
        page = open_page(browser, ring.url + "/dashboard")
        expect(page.locator("#ring-caption")).to_have_text("node0+node1 → node2+node3 → node0+node1")
        expect(page.locator("#ring .ring-node")).to_have_count(2)
        for name, layers in (("node0", "[0, 2)"), ("node1", "[0, 2)"), ("node2", "[2, 4)"), ("node3", "[2, 4)")):
            card = page.locator(f'#nodes [data-node="{name}"][data-in-ring="true"]')
            expect(card.locator(".layers")).to_have_text(layers)
        assert page.script_errors == [], page.script_errors
    finally:
        ring.stop()
