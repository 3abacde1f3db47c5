"""Run ``ringd serve`` as a service: a launchd job on macOS, a systemd unit on Linux.

The pure half of ``ringctl install | uninstall | logs``: where the service file
and its log go, the launchd property list and the systemd unit that run
``ringd serve --config FILE``, the ``launchctl`` / ``systemctl`` argument lists
that put them in place or take them out, and the checks a config file passes
before any of that. Nothing here runs a command or writes a file; ``ctl/install.py``
does, so every part is tested as a function.

One ringd runs per machine, so the names are fixed: the launchd label
``org.ringd.serve`` and the systemd unit ``ringd.service``; ``uninstall`` and
``logs`` need no config file. Per user (a LaunchAgent, a ``systemctl --user``
unit) the service runs while its user is logged in; ``system`` (a LaunchDaemon,
a system unit) from boot, as the account that installed it, for a headless Mac
that must serve before anyone logs in.

Both write the daemon's output to one log file (not the journal on Linux), so
``ringctl logs`` is the same ``tail`` everywhere. Rotating it is left to the
system's tools (newsyslog, logrotate).

``RINGD_SERVICE_PLATFORM=macos|linux`` picks the service manager instead of the
machine's own: how tests write and check a launchd job on Linux.
"""

from __future__ import annotations

import argparse
import getpass
import os
import pwd
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ringd.node import config as config_mod

LABEL = "org.ringd.serve"  # launchd job label; also the plist's file name
UNIT = "ringd.service"  # systemd unit name
PLATFORM_ENV = "RINGD_SERVICE_PLATFORM"
PLATFORMS = ("macos", "linux")
# Seconds between restarts after a crash (launchd ThrottleInterval, systemd
# RestartSec): a node that fails at start (a port in use, a model missing) retries
# six times a minute instead of spinning, and a node that crashed is back long
# before a person would have noticed and restarted it.
RESTART_DELAY_S = 10
# launchd's default PATH is /usr/bin:/bin:/usr/sbin:/sbin. ringd asks sysctl and
# ioreg (in /usr/sbin) what the Mac is; Homebrew's folders come first as in a
# login shell, after the environment ringd is installed in.
SYSTEM_PATH = ("/opt/homebrew/bin", "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")
# Where the Hub client keeps and fetches models: passed on from the shell that
# installs, so the service finds the models a hand-started ringd found. Not
# HF_TOKEN: the service file is readable by everyone, and the Hub client reads
# its token file under HOME (or HF_HOME) anyway.
PASSED_ENVIRONMENT = ("HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "HF_HUB_OFFLINE")


class ServiceError(Exception):
    """Something the user must fix before the service can be installed; the message says what."""


def host_platform(environ: dict[str, str] = os.environ, sys_platform: str = sys.platform) -> str:
    """``macos`` or ``linux``: whose service manager to write for (``RINGD_SERVICE_PLATFORM`` overrides)."""
    forced = environ.get(PLATFORM_ENV)
    if forced:
        if forced not in PLATFORMS:
            raise ServiceError(f"{PLATFORM_ENV}={forced!r}: must be one of {', '.join(PLATFORMS)}")
        return forced
    if sys_platform == "darwin":
        return "macos"
    if sys_platform.startswith("linux"):
        return "linux"
    raise ServiceError(f"services are launchd jobs (macOS) or systemd units (Linux); this is {sys_platform}")


@dataclass(frozen=True)
class Account:
    """Who the service runs as: the user who installs it, or for ``system`` the one named or who ran sudo."""

    name: str
    uid: int
    home: Path


def account(system: bool, user: str | None = None, environ: dict[str, str] = os.environ) -> Account:
    if not system:
        if user:
            raise ServiceError("--user is for --system services; a per-user service runs as whoever installs it")
        if environ.get("SUDO_USER"):
            raise ServiceError(
                "a per-user service belongs to the user who runs ringctl, not root: run it without sudo, "
                "or add --system for a service that starts at boot"
            )
        # HOME, not the password database: a test (or a user) that moves HOME moves the service with it.
        return Account(getpass.getuser(), os.getuid(), Path(environ.get("HOME") or Path.home()))
    name = user or environ.get("SUDO_USER") or getpass.getuser()
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ServiceError(f"--user {name}: no such account on this machine") from None
    return Account(entry.pw_name, entry.pw_uid, Path(entry.pw_dir))


@dataclass(frozen=True)
class Service:
    """Where one machine's ringd service lives, and the commands that load and unload it."""

    platform: str
    system: bool
    file: Path  # the plist or the unit
    log: Path  # the daemon's stdout and stderr, both
    uid: int  # launchd's per-user domain is gui/<uid>

    @property
    def domain(self) -> str:
        return "system" if self.system else f"gui/{self.uid}"

    @property
    def target(self) -> str:
        """launchd's name for the job: domain/label."""
        return f"{self.domain}/{LABEL}"

    def _systemctl(self, *args: str) -> list[str]:
        return ["systemctl", *([] if self.system else ["--user"]), *args]

    def stop_commands(self) -> list[list[str]]:
        """Take the service out of its manager: before a reinstall, and to uninstall (file still in place)."""
        if self.platform == "macos":
            return [["launchctl", "bootout", self.target]]
        return [self._systemctl("disable", "--now", UNIT)]

    def start_commands(self) -> list[list[str]]:
        """Load and start the service once its file is written."""
        if self.platform == "macos":
            # enable first: bootstrap refuses a job that `launchctl disable` (or an
            # earlier uninstall by hand) left disabled. bootstrap starts it (RunAtLoad);
            # kickstart -k makes sure the running process is this plist's, even if an
            # old one was still on its way out.
            return [
                ["launchctl", "enable", self.target],
                ["launchctl", "bootstrap", self.domain, str(self.file)],
                ["launchctl", "kickstart", "-k", self.target],
            ]
        return [self._systemctl("daemon-reload"), self._systemctl("enable", "--now", UNIT)]

    def cleanup_commands(self) -> list[list[str]]:
        """After the file is removed: systemd forgets the unit; launchd has nothing to forget."""
        return [] if self.platform == "macos" else [self._systemctl("daemon-reload")]

    def not_loaded(self, returncode: int, output: str) -> bool:
        """Whether a failed stop command only says the service was not loaded (fine when uninstalling)."""
        if self.platform == "macos":
            # "Boot-out failed: 3: No such process"; newer macOS: "113: Could not find specified service".
            return returncode in (3, 113) or "No such process" in output or "Could not find" in output
        return returncode == 5 or "not loaded" in output or "does not exist" in output


def locate(platform: str, system: bool, who: Account, environ: dict[str, str] = os.environ) -> Service:
    if platform == "macos":
        if system:
            return Service(platform, True, Path("/Library/LaunchDaemons") / f"{LABEL}.plist", Path("/Library/Logs/ringd/ringd.log"), who.uid)
        return Service(
            platform, False, who.home / "Library/LaunchAgents" / f"{LABEL}.plist", who.home / "Library/Logs/ringd/ringd.log", who.uid
        )
    if system:
        return Service(platform, True, Path("/etc/systemd/system") / UNIT, Path("/var/log/ringd/ringd.log"), who.uid)
    # The folders systemd's user manager and the XDG spec name; their defaults under HOME.
    config_home = Path(environ.get("XDG_CONFIG_HOME") or who.home / ".config")
    state_home = Path(environ.get("XDG_STATE_HOME") or who.home / ".local/state")
    return Service(platform, False, config_home / "systemd/user" / UNIT, state_home / "ringd/ringd.log", who.uid)


def ringd_executable(python: str = sys.executable, which=shutil.which) -> Path:
    """The absolute path of the ``ringd`` console script of the environment ringctl runs from."""
    # Not resolved: a venv's python is a symlink to the base interpreter, whose folder has no ringd.
    beside = Path(os.path.abspath(python)).parent / "ringd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = which("ringd")
    if found:
        return Path(os.path.abspath(found))
    raise ServiceError(
        f"no ringd executable beside {python} or on PATH; install ringd in the environment you run ringctl from "
        "(in a checkout: uv sync, then uv run ringctl install ...)"
    )


def environment(bin_dir: Path, home: Path, environ: dict[str, str] = os.environ) -> dict[str, str]:
    """The whole environment ``ringd serve`` gets from its service manager."""
    path = list(dict.fromkeys([str(bin_dir), *SYSTEM_PATH]))
    env = {
        "PATH": ":".join(path),
        # launchd sets no HOME for a LaunchDaemon; ringd's defaults (secret, state, model cache) are under it.
        "HOME": str(home),
        # print() output (the API address at start) reaches the log file at once, not in 8 KiB blocks.
        "PYTHONUNBUFFERED": "1",
    }
    env.update({k: environ[k] for k in PASSED_ENVIRONMENT if environ.get(k)})
    return env


def _resolve(path: str, home: Path, workdir: Path) -> Path:
    """A path from the config as the service will see it: ``~`` is its HOME, relative is from its working folder."""
    if path == "~" or path.startswith("~/"):
        return home / path[2:]
    return workdir / path  # an absolute path stays as it is


def check_config(path: Path, env: dict[str, str], workdir: Path) -> config_mod.Config:
    """The config the service will run, loaded as it will load it; ServiceError says what would stop it."""
    if not path.is_file():
        raise ServiceError(f"config file {path}: no such file (see config/cluster.example.yaml for one to start from)")
    try:
        # Only the file counts: the service will not see this shell's RINGD_* variables.
        cfg = config_mod.load(argparse.Namespace(config=str(path)), environ=env)
    except config_mod.ConfigError as e:
        raise ServiceError(f"{e} (fix {path}, then run ringctl install again)") from None
    home = Path(env["HOME"])
    if cfg.model is None:
        raise ServiceError(f"config file {path}: no model; add `model:` (an mlx-lm folder, a Hugging Face repo id, a .gguf file or ollama:NAME)")
    # A repo id looks like a relative path; only what is plainly a path is checked here.
    if cfg.model.startswith(("/", "~", ".")) and not _resolve(cfg.model, home, workdir).exists():
        raise ServiceError(f"config file {path}: model {cfg.model} is not there ({_resolve(cfg.model, home, workdir)})")
    try:
        config_mod.read_secret_file(_resolve(cfg.secret_file, home, workdir))
        if cfg.api_keys_file is not None:
            config_mod.read_api_keys_file(_resolve(cfg.api_keys_file, home, workdir))
    except config_mod.ConfigError as e:
        raise ServiceError(f"{e} (checked as the service will read it: HOME={home}, in {workdir})") from None
    return cfg


@dataclass(frozen=True)
class Job:
    """What the service runs, whichever manager runs it."""

    program: list[str]  # absolute ringd, serve, --config, absolute file
    workdir: Path
    environment: dict[str, str]
    log: Path
    user: str | None  # a system service's account; None: the installing user's own


def job(ringd: Path, config_file: Path, env: dict[str, str], log: Path, user: str | None) -> Job:
    # The config's folder: a relative path in the config (model: ./models/x) means
    # the same to the service as to `ringd serve --config FILE` run from there.
    return Job([str(ringd), "serve", "--config", str(config_file)], config_file.parent, env, log, user)


def plist(j: Job) -> dict:
    """The launchd job, as plistlib writes it."""
    d = {
        "Label": LABEL,
        "ProgramArguments": j.program,
        "WorkingDirectory": str(j.workdir),
        "EnvironmentVariables": j.environment,
        "RunAtLoad": True,
        # Restart after a crash or a failed start, not after a clean stop (SIGTERM: ringd exits 0).
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY_S,
        # Unspecified, launchd throttles a job's CPU and I/O lightly; serving tokens is
        # the whole point of this machine's job.
        "ProcessType": "Interactive",
        "StandardOutPath": str(j.log),
        "StandardErrorPath": str(j.log),
    }
    if j.user is not None:
        d["UserName"] = j.user
    return d


def _escape(text: str) -> str:
    """A value for a systemd unit setting: % starts a specifier, a line break ends the setting."""
    if "\n" in text or "\r" in text:
        raise ServiceError(f"{text!r}: a line break cannot go in a systemd unit")
    return text.replace("%", "%%")


def _quote(text: str) -> str:
    """One word of ExecStart= or Environment=, in systemd's double quotes."""
    return '"' + _escape(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def unit(j: Job, system: bool) -> str:
    """The systemd unit text."""
    # ExecStart also expands $VAR; $$ is a literal $. Environment= does not expand.
    exec_start = " ".join(_quote(a).replace("$", "$$") for a in j.program)
    lines = [
        "# Written by `ringctl install`; `ringctl uninstall` stops and removes it.",
        "[Unit]",
        "Description=ringd: one LLM across several machines (ringd serve)",
    ]
    if system:  # a user manager has no network-online.target
        lines += ["Wants=network-online.target", "After=network-online.target"]
    lines += [
        "",
        "[Service]",
        "Type=exec",
        f"ExecStart={exec_start}",
        f"WorkingDirectory={_escape(str(j.workdir))}",
        "Environment=" + " ".join(_quote(f"{k}={v}") for k, v in j.environment.items()),
    ]
    if j.user is not None:
        lines.append(f"User={_escape(j.user)}")
    lines += [
        # A crash or a failed start restarts; a clean stop (SIGTERM: ringd exits 0) does not.
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        f"StandardOutput=append:{_escape(str(j.log))}",
        f"StandardError=append:{_escape(str(j.log))}",
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if system else 'default.target'}",
        "",
    ]
    return "\n".join(lines)


def render(service: Service, j: Job) -> bytes:
    """The service file's bytes."""
    if service.platform == "macos":
        import plistlib

        return plistlib.dumps(plist(j))
    return unit(j, service.system).encode()
