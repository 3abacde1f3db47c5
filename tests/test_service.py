"""`ringctl install | uninstall | logs`: ringd serve as a launchd job (macOS) or a systemd unit (Linux).

The macOS branch runs here on Linux because ``RINGD_SERVICE_PLATFORM=macos``
(``ringd/app/service.py``) picks the service manager instead of the machine's own,
and ``HOME`` points at the test's folder, so the LaunchAgent goes to
``tmp/home/Library/LaunchAgents``. The job launchd would run is run for real: its
ProgramArguments, with its EnvironmentVariables only, in its WorkingDirectory,
must start a node that serves. launchd itself cannot exist on Linux, and no
systemd manager runs in a test container: where a test uses a stand-in
``launchctl`` / ``systemctl`` (a script that records its arguments), its
docstring says so. The systemd unit is checked by the real ``systemd-analyze``.
"""

from __future__ import annotations

import json
import os
import plistlib
import pwd
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from devkit import REPO, RING_START_TIMEOUT_S

from ringd.app import service
from devkit.ports import port

# Seconds for a ringctl command that only reads a config and writes a file (imports included).
CTL_TIMEOUT_S = 60


def ctl_env(home: Path, platform: str, **extra: str) -> dict[str, str]:
    """This process's environment with a HOME of the test's own and nothing that would steer the service."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGD_", "XDG_", "HF_", "SUDO_"))}
    return {**env, "HOME": str(home), service.PLATFORM_ENV: platform, **extra}


def ringctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringd.app.ctl", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=CTL_TIMEOUT_S)


def write_config(folder: Path, model: str, **keys) -> Path:
    """A one-node config in ``folder`` whose secret sits beside it, named by a relative path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "secret").write_text("s" * 32)
    (folder / "secret").chmod(0o600)  # serve (and install) refuse a secret others can read
    values = {"name": "solo", "cluster": "svc-test", "model": model, "secret_file": "./secret", **keys}
    path = folder / "node.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    return path


def test_the_printed_launchd_job_starts_a_node_that_serves(tiny_model, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    http_port = port()
    # A space in the folder: launchd passes arguments as an array, no shell splits them.
    # state_dir is relative, so the node's state lands in WorkingDirectory (the config's folder).
    config = write_config(
        tmp_path / "node conf", str(tiny_model(arch="llama", layers=2)), model_id="tiny",
        host="127.0.0.1", advertise="127.0.0.1", ring_port=port(), http_host="127.0.0.1", http_port=http_port,
        discovery=False, nodes=1, state_dir="state",
    )  # fmt: skip
    r = ringctl(ctl_env(home, "macos"), "install", "--config", str(config), "--print")
    assert r.returncode == 0, r.stderr
    job = plistlib.loads(r.stdout.encode())

    assert job["Label"] == service.LABEL == "org.ringd.serve"
    ringd = Path(job["ProgramArguments"][0])
    assert ringd.is_absolute() and ringd.name == "ringd" and ringd.parent == Path(sys.executable).parent
    assert job["ProgramArguments"][1:] == ["serve", "--config", str(config)]
    assert job["RunAtLoad"] is True and job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["ThrottleInterval"] == service.RESTART_DELAY_S
    assert job["WorkingDirectory"] == str(config.parent)
    log = home / "Library/Logs/ringd/ringd.log"
    assert job["StandardOutPath"] == job["StandardErrorPath"] == str(log)
    env = job["EnvironmentVariables"]
    assert env["HOME"] == str(home) and env["PYTHONUNBUFFERED"] == "1"
    path = env["PATH"].split(":")
    assert path[0] == str(ringd.parent) and {"/usr/bin", "/bin", "/usr/sbin", "/sbin", "/opt/homebrew/bin"} <= set(path)
    assert "UserName" not in job  # an agent runs as its user
    assert not (home / "Library").exists(), "--print changed something"

    # Run it as launchd would: these arguments, this environment and nothing else, in that folder.
    log.parent.mkdir(parents=True)  # what install does before it bootstraps
    with open(job["StandardOutPath"], "ab") as out:
        proc = subprocess.Popen(job["ProgramArguments"], env=env, cwd=job["WorkingDirectory"], stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + RING_START_TIMEOUT_S
        while get(http_port, "/health") != 200:
            assert proc.poll() is None, f"ringd exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no /health 200 within {RING_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5}
        status, answer = post(http_port, "/v1/chat/completions", body)
        assert status == 200 and answer["choices"][0]["message"]["content"] is not None, answer
        assert (config.parent / "state").is_dir()  # relative paths are the config folder's
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    # 0 on SIGTERM is a clean stop, which KeepAlive {SuccessfulExit: false} does not restart.
    assert code == 0, log.read_text()[-3000:]
    assert "solo" in log.read_text()  # its log lines went where StandardOutPath says


def get(port: int, path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stand_in(bin_dir: Path, name: str, body: str) -> Path:
    """A script called ``name`` first on PATH that appends its arguments (one JSON list a line) to ``name``.calls."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"record = {str(bin_dir / (name + '.calls'))!r}\n"
        "with open(record, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n" + textwrap.dedent(body)
    )
    script.chmod(0o755)
    return script


def calls(script: Path) -> list[list[str]]:
    record = script.with_name(script.name + ".calls")
    lines = record.read_text().splitlines() if record.exists() else []
    record.unlink(missing_ok=True)
    return [json.loads(line) for line in lines]


# launchd's answers, as far as install and uninstall care: bootstrap of a loaded label fails,
# bootout of one that is not loaded fails with "No such process".
LAUNCHCTL = """
loaded = record + ".loaded"
if sys.argv[1] == "bootstrap":
    if os.path.exists(loaded):
        sys.exit("Bootstrap failed: 5: Input/output error")
    open(loaded, "w").write(sys.argv[3])
elif sys.argv[1] == "bootout":
    if not os.path.exists(loaded):
        print("Boot-out failed: 3: No such process", file=sys.stderr)
        sys.exit(3)
    os.remove(loaded)
"""


def test_install_and_uninstall_run_launchctl(tmp_path):
    """A stand-in launchctl (launchd cannot exist on Linux) records the commands and plays launchd's
    two refusals: bootstrap of a loaded job, bootout of one that is not loaded."""
    home = tmp_path / "home"
    home.mkdir()
    launchctl = stand_in(tmp_path / "bin", "launchctl", LAUNCHCTL)
    env = ctl_env(home, "macos", PATH=f"{launchctl.parent}:{os.environ['PATH']}")
    config = write_config(tmp_path / "conf", "mlx-community/Qwen3-8B-4bit")  # a repo id: install does not fetch it
    plist = home / "Library/LaunchAgents/org.ringd.serve.plist"
    uid = os.getuid()
    target = f"gui/{uid}/org.ringd.serve"

    r = ringctl(env, "install", "--config", str(config))
    assert r.returncode == 0, r.stderr
    assert calls(launchctl) == [["enable", target], ["bootstrap", f"gui/{uid}", str(plist)], ["kickstart", "-k", target]]
    job = plistlib.loads(plist.read_bytes())
    assert job["ProgramArguments"][1:] == ["serve", "--config", str(config)]
    assert (home / "Library/Logs/ringd").is_dir() and str(plist) in r.stdout and "ringctl logs" in r.stdout
    assert oct(plist.stat().st_mode & 0o777) == "0o644"

    r = ringctl(env, "install", "--config", str(config))  # again: the old job is booted out first
    assert r.returncode == 0, r.stderr
    assert calls(launchctl) == [["bootout", target], ["enable", target], ["bootstrap", f"gui/{uid}", str(plist)], ["kickstart", "-k", target]]

    r = ringctl(env, "uninstall")
    assert r.returncode == 0, r.stderr
    assert calls(launchctl) == [["bootout", target]] and not plist.exists()
    r = ringctl(env, "uninstall")  # not loaded, no file: says so, and that is fine
    assert r.returncode == 0 and "not installed" in r.stdout, r.stderr
    assert calls(launchctl) == [["bootout", target]]


def test_install_refuses_a_config_the_service_could_not_run_and_changes_nothing(tmp_path):
    """A stand-in launchctl (launchd cannot exist on Linux), to show it is never called."""
    home = tmp_path / "home"
    home.mkdir()
    launchctl = stand_in(tmp_path / "bin", "launchctl", LAUNCHCTL)
    env = ctl_env(home, "macos", PATH=f"{launchctl.parent}:{os.environ['PATH']}")

    r = ringctl(env, "install", "--config", str(tmp_path / "missing.yaml"))
    assert r.returncode == 1 and "missing.yaml: no such file" in r.stderr

    config = write_config(tmp_path / "conf", "mlx-community/Qwen3-8B-4bit", ring_prot=50051)
    r = ringctl(env, "install", "--config", str(config))
    assert r.returncode == 1 and "unknown key 'ring_prot'" in r.stderr and str(config) in r.stderr

    config = write_config(tmp_path / "conf", "mlx-community/Qwen3-8B-4bit")
    (config.parent / "secret").chmod(0o644)
    r = ringctl(env, "install", "--config", str(config))
    assert r.returncode == 1 and f"chmod 600 {config.parent / 'secret'}" in r.stderr

    config = write_config(tmp_path / "conf", str(tmp_path / "no-such-model"))
    r = ringctl(env, "install", "--config", str(config))
    assert r.returncode == 1 and "no-such-model is not there" in r.stderr

    # Only the file counts: the service will not see this shell's RINGD_* variables.
    config.write_text("name: solo\nsecret_file: ./secret\n")
    r = ringctl({**env, "RINGD_MODEL": "mlx-community/Qwen3-8B-4bit"}, "install", "--config", str(config))
    assert r.returncode == 1 and "no model" in r.stderr

    assert calls(launchctl) == [] and not (home / "Library").exists()


def test_system_job_runs_as_the_installing_user_and_logs_under_library(tmp_path):
    config = write_config(tmp_path / "conf", "mlx-community/Qwen3-8B-4bit")
    r = ringctl(ctl_env(tmp_path, "macos"), "install", "--system", "--config", str(config), "--print")
    assert r.returncode == 0, r.stderr
    job = plistlib.loads(r.stdout.encode())
    me = pwd.getpwuid(os.getuid())
    assert job["UserName"] == me.pw_name and job["EnvironmentVariables"]["HOME"] == me.pw_dir
    assert job["StandardOutPath"] == "/Library/Logs/ringd/ringd.log"
    r = ringctl(ctl_env(tmp_path, "macos"), "install", "--system", "--config", str(config), "--user", "no-such-user-here", "--print")
    assert r.returncode == 1 and "no-such-user-here: no such account" in r.stderr


@pytest.mark.parametrize("system", [False, True], ids=["user", "system"])
def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path, system):
    assert shutil.which("systemd-analyze"), "systemd-analyze is not installed; `apt-get install systemd` (.ci/run installs it)"
    # A space and a % in the config's folder: both need escaping in a unit.
    config = write_config(tmp_path / "my conf 100%", "mlx-community/Qwen3-8B-4bit")
    r = ringctl(ctl_env(tmp_path / "home", "linux"), "install", "--config", str(config), "--print", *(["--system"] if system else []))
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "Restart=on-failure" in text and f"RestartSec={service.RESTART_DELAY_S}" in text
    assert ("User=" in text) == system and ("multi-user.target" in text) == system
    unit = tmp_path / "ringd.service"
    unit.write_text(text)
    # The user manager's checks want a runtime folder; a test has no login session, so it gets one of its own.
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    verify = ["systemd-analyze", *([] if system else ["--user"]), "verify", str(unit)]
    v = subprocess.run(verify, capture_output=True, text=True, timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    # verify exits 0 even when it ignores a bad line, so its complaints are read too.
    assert v.returncode == 0 and v.stderr.strip() == "", f"{v.stderr}\n{text}"


def test_install_and_uninstall_run_systemctl(tmp_path):
    """A stand-in systemctl (no systemd manager runs in a test container) records the commands."""
    home = tmp_path / "home"
    home.mkdir()
    systemctl = stand_in(tmp_path / "bin", "systemctl", "")
    env = ctl_env(home, "linux", PATH=f"{systemctl.parent}:{os.environ['PATH']}")
    config = write_config(tmp_path / "conf", "mlx-community/Qwen3-8B-4bit")
    unit = home / ".config/systemd/user/ringd.service"

    r = ringctl(env, "install", "--config", str(config))
    assert r.returncode == 0, r.stderr
    assert calls(systemctl) == [["--user", "daemon-reload"], ["--user", "enable", "--now", "ringd.service"]]
    assert "ExecStart=" in unit.read_text() and (home / ".local/state/ringd").is_dir()
    assert "loginctl enable-linger" in r.stdout

    assert ringctl(env, "install", "--config", str(config)).returncode == 0
    assert calls(systemctl)[0] == ["--user", "disable", "--now", "ringd.service"]

    r = ringctl(env, "uninstall")
    assert r.returncode == 0, r.stderr
    assert calls(systemctl) == [["--user", "disable", "--now", "ringd.service"], ["--user", "daemon-reload"]] and not unit.exists()


def test_logs_prints_the_log_and_follows_it(tmp_path):
    home = tmp_path / "home"
    env = ctl_env(home, "macos")
    r = ringctl(env, "logs")
    assert r.returncode == 1 and "ringctl install" in r.stderr  # nothing has run yet

    log = home / "Library/Logs/ringd/ringd.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(1, 101)))
    r = ringctl(env, "logs", "-n", "2")
    assert r.returncode == 0 and r.stdout == "line 99\nline 100\n", r.stderr
    assert ringctl(env, "logs").stdout.splitlines()[0] == "line 51"  # 50 by default

    follow = subprocess.Popen([sys.executable, "-m", "ringd.app.ctl", "logs", "-f"], cwd=REPO, env=env, stdout=subprocess.PIPE)
    try:
        seen = read_until(follow, b"line 100\n", b"")
        with open(log, "a") as f:
            f.write("written after ringctl logs -f started\n")
        read_until(follow, b"written after ringctl logs -f started\n", seen)
    finally:
        follow.kill()
        follow.wait()
        follow.stdout.close()


def read_until(proc: subprocess.Popen, needle: bytes, seen: bytes) -> bytes:
    """proc's output (after ``seen``) up to and including needle, read as it comes: no buffer hides a line."""
    deadline = time.monotonic() + CTL_TIMEOUT_S
    while needle not in seen:
        assert proc.poll() is None, f"ringctl logs -f exited ({proc.returncode}); output:\n{seen.decode()}"
        assert time.monotonic() < deadline, f"no {needle!r} within {CTL_TIMEOUT_S} s; output:\n{seen.decode()}"
        if select.select([proc.stdout], [], [], 0.5)[0]:
            seen += os.read(proc.stdout.fileno(), 65536)
    return seen


def test_host_platform_and_the_ringd_it_runs():
    assert service.host_platform({}, "darwin") == "macos" and service.host_platform({}, "linux") == "linux"
    assert service.host_platform({service.PLATFORM_ENV: "macos"}, "linux") == "macos"
    with pytest.raises(service.ServiceError, match="must be one of macos, linux"):
        service.host_platform({service.PLATFORM_ENV: "windows"}, "linux")
    with pytest.raises(service.ServiceError, match="win32"):
        service.host_platform({}, "win32")
    assert service.ringd_executable() == Path(sys.executable).parent / "ringd"
    assert service.ringd_executable("/nowhere/python", which=lambda name: "/opt/x/bin/ringd") == Path("/opt/x/bin/ringd")
    with pytest.raises(service.ServiceError, match="uv sync"):
        service.ringd_executable("/nowhere/python", which=lambda name: None)
    with pytest.raises(service.ServiceError, match="without sudo"):
        service.account(False, environ={"SUDO_USER": "alice", "HOME": "/root"})


def test_the_examples_in_launchd_are_what_install_writes():
    """launchd/ ships what install writes for a sample user; this keeps them from going stale."""
    for platform, home, example in (
        ("macos", Path("/Users/alice"), "org.ringd.serve.example.plist"),
        ("linux", Path("/home/alice"), "ringd.example.service"),
    ):
        ringd = home / "ringd/.venv/bin/ringd"
        svc = service.locate(platform, False, service.Account("alice", 501, home), {})
        env = service.environment(ringd.parent, home, {})
        rendered = service.render(svc, service.job(ringd, home / ".config/ringd/cluster.yaml", env, svc.log, None))
        assert (REPO / "launchd" / example).read_bytes() == rendered, f"launchd/{example} is stale; it should read:\n{rendered.decode()}"
