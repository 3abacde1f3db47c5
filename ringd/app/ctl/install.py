"""``ringctl install``, ``uninstall``, ``logs``: ``ringd serve`` as a service of this machine.
``ringd/app/service.py`` builds the launchd job or systemd unit; this runs launchctl or systemctl
with it, writes its file and says what was done, or why not and what to do."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from ringd.app import service
from ringd.app.ctl.errors import CtlError

# `logs` without -f: the last lines, about a screenful.
LOG_LINES = 50
# launchctl and systemctl answer in well under a second; a minute only trips on
# a service manager that is wedged (bootout waits for the old daemon to stop).
SERVICE_COMMAND_TIMEOUT_S = 60.0


def _service_command(svc: service.Service, argv: list[str], tolerate_not_loaded: bool = False) -> bool:
    """Run a launchctl/systemctl command; False if it failed only because the service was not loaded."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=SERVICE_COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise CtlError(f"{argv[0]} is not on PATH; {'launchd' if svc.platform == 'macos' else 'systemd'} runs services here") from None
    except subprocess.TimeoutExpired:
        raise CtlError(f"`{shlex.join(argv)}` did not finish within {SERVICE_COMMAND_TIMEOUT_S:g} s") from None
    if r.returncode == 0:
        return True
    output = (r.stderr + r.stdout).strip()
    if tolerate_not_loaded and svc.not_loaded(r.returncode, output):
        return False
    hint = ""
    if svc.platform == "macos" and "bootstrap" in argv:
        hint = f"; check the plist with: plutil -lint {shlex.quote(str(svc.file))}"
        if not svc.system:
            hint += "; a LaunchAgent needs its user logged in: for a Mac nobody logs in to, use sudo ringctl install --system"
    elif svc.platform == "linux" and not svc.system and "bus" in output.lower():
        hint = "; no systemd user manager is running for you: log in, or run sudo loginctl enable-linger $USER, or use --system"
    raise CtlError(f"`{shlex.join(argv)}` failed (exit {r.returncode}): {output or 'no output'}{hint}")


def _need_root(svc: service.Service, command: str) -> None:
    if svc.system and os.geteuid() != 0:
        ringctl = Path(os.path.abspath(sys.executable)).parent / "ringctl"
        raise CtlError(f"--system changes {svc.file}: run it as root: sudo {shlex.quote(str(ringctl))} {command}")


def _service_for(system: bool, user: str | None = None) -> tuple[service.Service, service.Account]:
    platform = service.host_platform()
    who = service.account(system, user)
    return service.locate(platform, system, who), who


def install(config: str, system: bool, user: str | None, print_only: bool) -> int:
    svc, who = _service_for(system, user)
    ringd = service.ringd_executable()
    config_file = Path(os.path.abspath(Path(config).expanduser()))
    env = service.environment(ringd.parent, who.home)
    job = service.job(ringd, config_file, env, svc.log, who.name if system else None)
    service.check_config(config_file, env, job.workdir)
    data = service.render(svc, job)
    if print_only:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return 0
    _need_root(svc, f"install --system --config {shlex.quote(str(config_file))}" + (f" --user {who.name}" if user else ""))
    if svc.file.exists():  # a reinstall: the old job goes first, or bootstrap finds the label taken
        for argv in svc.stop_commands():
            _service_command(svc, argv, tolerate_not_loaded=True)
    svc.log.parent.mkdir(parents=True, exist_ok=True)
    if system:  # the service's own account writes there
        shutil.chown(svc.log.parent, who.name)
    svc.file.parent.mkdir(parents=True, exist_ok=True)
    partial = svc.file.with_name(svc.file.name + ".partial")
    partial.write_bytes(data)
    partial.chmod(0o644)  # launchd refuses a job file that group or others may write
    os.replace(partial, svc.file)
    try:
        for argv in svc.start_commands():
            _service_command(svc, argv)
    except CtlError as e:
        raise CtlError(f"{e}\n(the service file is in place at {svc.file}; fix that and run ringctl install again, or ringctl uninstall)") from None
    kind = {("macos", False): "LaunchAgent", ("macos", True): "LaunchDaemon", ("linux", False): "systemd user unit", ("linux", True): "systemd unit"}
    sudo = "sudo " if system else ""
    flag = " --system" if system else ""
    print(f"installed {service.LABEL if svc.platform == 'macos' else service.UNIT} ({kind[svc.platform, system]}): {svc.file}")
    print(f"  runs    {shlex.join(job.program)}  (in {job.workdir}{f', as {who.name}' if system else ''})")
    print(f"  log     {svc.log}  (ringctl logs{flag} -f)")
    print(f"  remove  {sudo}ringctl uninstall{flag}")
    if svc.platform == "linux" and not system:
        print(f"  it runs while {who.name} is logged in; to start it at boot: sudo loginctl enable-linger {who.name} (or install --system)")
    return 0


def uninstall(system: bool) -> int:
    svc, _ = _service_for(system)
    _need_root(svc, "uninstall --system")
    installed = svc.file.exists()
    # launchd may still run a job whose plist was deleted by hand; systemd cannot disable a unit without its file.
    if installed or svc.platform == "macos":
        for argv in svc.stop_commands():
            _service_command(svc, argv, tolerate_not_loaded=True)
    if not installed:
        print(f"not installed: there is no {svc.file}")
        return 0
    svc.file.unlink()
    for argv in svc.cleanup_commands():
        _service_command(svc, argv)
    print(f"stopped and removed {svc.file}; its log stays at {svc.log}")
    return 0


def logs(system: bool, follow: bool, lines: int) -> int:
    svc, _ = _service_for(system)
    if not svc.log.exists():
        flag = " --system" if system else ""
        raise CtlError(
            f"no log at {svc.log}: the service has not run here yet; install it with: ringctl install{flag} --config FILE"
            + ("" if system else " (a --system service logs elsewhere: ringctl logs --system)")
        )
    argv = ["tail", "-n", str(lines), *(["-F"] if follow else []), str(svc.log)]
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)  # tail follows (and survives the file being replaced) better than we would
    except OSError as e:
        raise CtlError(f"cannot run tail to show {svc.log}: {e}") from None
    return 0  # not reached
