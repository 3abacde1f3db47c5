"""What this machine can hold and how fast it computes, for placing layers.

Every node reads its own ``DeviceProfile`` at start and sends ``to_wire()`` to
the leader, which splits the model's layers by memory and speed. Reading never
fails on a tool that is missing or slow: each probe of the OS falls back to a
safe "unknown" and logs why at debug level; only the memory size is required,
and ``capabilities.memory_gb`` in the config stands in where it cannot be read.

The parsers are pure functions of a command's output so they can be tested on
any OS; the functions that run commands are thin wrappers around them.

Check what ringd sees on a machine with ``python -m ringd.base.device``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GIB = 2**30

# sysctl and ioreg answer in milliseconds; 5 s only trips on a wedged system,
# and a node that cannot start because a diagnostic tool hangs would be worse
# than a profile with an unknown field.
COMMAND_TIMEOUT_S = 5.0
# system_profiler enumerates every display and bus before answering and takes
# one to a few seconds on a healthy Mac; it is only the fallback for ioreg.
SYSTEM_PROFILER_TIMEOUT_S = 10.0

# Without Metal's own recommendation, leave a quarter of RAM to the OS and to
# the other programs on the machine (about what Metal recommends on Apple
# Silicon anyway).
USABLE_RAM_FRACTION = 0.75

# Profiles arrive from the network and end up in logs and status output; a
# chip or system name longer than this is garbage, not a machine.
MAX_WIRE_STR = 256

# The probe multiplies square matrices. On a GPU a 1024 matmul is ~2 GFLOP,
# big enough to keep an M-series GPU busy rather than measure launch latency.
# The CPU backend runs the same at a few GFLOP/s, so there a smaller matrix
# keeps the probe well under a second on a small machine.
PROBE_N_GPU = 1024
PROBE_N_CPU = 512
# The first matmuls pay for kernel compilation and allocation, not compute.
PROBE_WARMUP_ITERS = 2
# Time at least this many matmuls and for at least this long so that timer
# resolution and scheduling noise stay small, but stop at the ceilings so a
# fast GPU does not spin for long and a slow CPU does not stall the start.
PROBE_MIN_ITERS = 3
PROBE_MIN_SECONDS = 0.15
PROBE_MAX_ITERS = 1000
# Bump when the probe's method changes so cached numbers from an older method
# are not compared with new ones.
PROBE_VERSION = 1

SPEED_CACHE_FILE = "device-speed.json"

CAPABILITY_KEYS = ("memory_gb", "gpu_cores")


@dataclass(frozen=True)
class DeviceProfile:
    system: str  # "macOS 15.1 (arm64)" / "Linux 6.8 (x86_64)"
    chip: str  # "Apple M2 Pro" / the CPU model name, or "unknown"
    cpu_cores: int
    gpu_cores: int | None  # None where unknown (Linux, or the tools failed)
    memory_total: int  # bytes of RAM
    memory_usable: int  # bytes this node may use for weights + KV cache
    speed: float | None = None  # matmul GFLOP/s from probe_speed

    def budget(self, memory_budget_gb: float | None) -> int:
        """memory_usable capped by the configured budget (bytes)."""
        if memory_budget_gb is None:
            return self.memory_usable
        if not _is_number(memory_budget_gb) or not memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb must be a number > 0, got {memory_budget_gb!r}")
        return min(self.memory_usable, int(memory_budget_gb * GIB))

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: Any) -> DeviceProfile:
        """Validate a profile a peer sent. Unknown keys are ignored so that a newer
        peer can add fields without breaking an older leader."""
        if not isinstance(d, dict):
            raise ValueError(f"device profile: expected an object, got {type(d).__name__}")
        missing = [k for k in ("system", "chip", "cpu_cores", "gpu_cores", "memory_total", "memory_usable") if k not in d]
        if missing:
            raise ValueError(f"device profile: missing {', '.join(missing)}")
        for key in ("system", "chip"):
            v = d[key]
            if not isinstance(v, str) or not v or len(v) > MAX_WIRE_STR:
                raise ValueError(f"device profile: {key} must be a non-empty string of at most {MAX_WIRE_STR} characters, got {_show(v)}")
        if not _is_int(d["cpu_cores"]) or d["cpu_cores"] < 1:
            raise ValueError(f"device profile: cpu_cores must be an integer >= 1, got {_show(d['cpu_cores'])}")
        if d["gpu_cores"] is not None and (not _is_int(d["gpu_cores"]) or d["gpu_cores"] < 0):
            raise ValueError(f"device profile: gpu_cores must be null or an integer >= 0, got {_show(d['gpu_cores'])}")
        if not _is_int(d["memory_total"]) or d["memory_total"] < 1:
            raise ValueError(f"device profile: memory_total must be an integer number of bytes >= 1, got {_show(d['memory_total'])}")
        if not _is_int(d["memory_usable"]) or not 0 <= d["memory_usable"] <= d["memory_total"]:
            raise ValueError(
                f"device profile: memory_usable must be an integer number of bytes between 0 and memory_total "
                f"({d['memory_total']}), got {_show(d['memory_usable'])}"
            )
        speed = d.get("speed")
        if speed is not None and (not _is_number(speed) or not math.isfinite(speed) or speed <= 0):
            raise ValueError(f"device profile: speed must be null or a finite number > 0, got {_show(speed)}")
        return cls(
            system=d["system"],
            chip=d["chip"],
            cpu_cores=d["cpu_cores"],
            gpu_cores=d["gpu_cores"],
            memory_total=d["memory_total"],
            memory_usable=d["memory_usable"],
            speed=None if speed is None else float(speed),
        )


def _is_int(v: Any) -> bool:
    # bool is an int subclass, and JSON true must not pass as a core count.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- parsers


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as {field: bytes}; fields without a kB unit (HugePages_*)
    are counts and kept as they are."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\s*([^:\s]+):\s*(\d+)\s*(kB)?\s*$", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def parse_cpuinfo_model(text: str) -> str | None:
    """The first "model name" of /proc/cpuinfo (x86, and most arm64 kernels since
    5.x do not have one: None)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "model name" and value.strip():
            return " ".join(value.split())
    return None


def parse_sysctl(text: str) -> dict[str, str]:
    """Output of ``sysctl key1 key2 ...`` ("key: value" lines) as {key: value}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_ioreg_gpu_cores(text: str) -> int | None:
    """``"gpu-core-count" = 19`` from ``ioreg -rd1 -c AGXAccelerator``."""
    m = re.search(r'"gpu-core-count"\s*=\s*(\d+)', text)
    return int(m.group(1)) if m else None


def parse_system_profiler_gpu_cores(text: str) -> int | None:
    """The "sppci_cores" of the first GPU in ``system_profiler SPDisplaysDataType
    -json`` (a string there, e.g. "19")."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    gpus = data.get("SPDisplaysDataType") if isinstance(data, dict) else None
    if not isinstance(gpus, list):
        return None
    for gpu in gpus:
        cores = gpu.get("sppci_cores") if isinstance(gpu, dict) else None
        if isinstance(cores, int) and not isinstance(cores, bool):
            return cores
        if isinstance(cores, str) and cores.strip().isdigit():
            return int(cores.strip())
    return None


def format_system(system: str, release: str, machine: str, mac_release: str = "") -> str:
    """"macOS 15.1 (arm64)", "Linux 6.8 (x86_64)": the OS with a short version."""
    if system == "Darwin":
        return f"macOS {mac_release or release} ({machine})"
    if system == "Linux":
        # Distribution kernels carry long suffixes ("6.8.0-45-generic"); the
        # major.minor is what tells machines apart.
        m = re.match(r"(\d+\.\d+)", release)
        return f"Linux {m.group(1) if m else release} ({machine})"
    return f"{system or 'unknown'} {release} ({machine})".replace(" ()", "")


# ---------------------------------------------------------------- readers


def _run(args: list[str], timeout: float = COMMAND_TIMEOUT_S) -> str | None:
    """A command's stdout, or None (logged) if it is missing, fails or hangs.

    sysctl exits non-zero when one of several keys is unknown (e.g. the
    perflevel keys on Intel Macs) but still prints the rest, so stdout is
    returned whenever there is any."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("device: %s failed: %s", args[0], e)
        return None
    if proc.returncode != 0:
        log.debug("device: %s exited with %d: %s", " ".join(args), proc.returncode, proc.stderr.strip()[:200])
    return proc.stdout or None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        log.debug("device: cannot read %s: %s", path, e)
        return None


def _metal_info() -> dict | None:
    """mx.device_info() of the Metal GPU, or None where there is no Metal (Linux,
    or an MLX built without it)."""
    try:
        import mlx.core as mx

        if not mx.metal.is_available():
            return None
        # mx.device_info() replaced mx.metal.device_info() (deprecated in 0.29).
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return dict(info)
    except Exception as e:  # an MLX without Metal may lack the module or raise in it
        log.debug("device: no Metal device info: %s", e)
        return None


def _sysconf_memory() -> int | None:
    try:
        n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return n if n > 0 else None


def _system() -> str:
    return format_system(platform.system(), platform.release(), platform.machine(), platform.mac_ver()[0])


def _read_macos() -> dict:
    keys = ["hw.memsize", "machdep.cpu.brand_string", "hw.ncpu", "hw.perflevel0.physicalcpu", "hw.perflevel1.physicalcpu"]
    sysctl = parse_sysctl(_run(["sysctl", *keys]) or "")

    def sysctl_int(key: str) -> int | None:
        v = sysctl.get(key, "")
        return int(v) if v.isdigit() else None

    metal = _metal_info() or {}
    memory_total = sysctl_int("hw.memsize") or _sysconf_memory()
    perf = [sysctl_int("hw.perflevel0.physicalcpu"), sysctl_int("hw.perflevel1.physicalcpu")]
    cpu_cores = sysctl_int("hw.ncpu") or (sum(perf) if all(perf) else None) or os.cpu_count() or 1

    gpu_cores = parse_ioreg_gpu_cores(_run(["ioreg", "-rd1", "-c", "AGXAccelerator"]) or "")
    if gpu_cores is None:
        out = _run(["system_profiler", "SPDisplaysDataType", "-json"], timeout=SYSTEM_PROFILER_TIMEOUT_S)
        gpu_cores = parse_system_profiler_gpu_cores(out or "")

    usable = metal.get("max_recommended_working_set_size")
    if not _is_int(usable) or usable <= 0:
        usable = int(memory_total * USABLE_RAM_FRACTION) if memory_total else None
    chip = sysctl.get("machdep.cpu.brand_string") or metal.get("device_name") or platform.processor() or "unknown"
    return {"chip": chip, "cpu_cores": cpu_cores, "gpu_cores": gpu_cores, "memory_total": memory_total, "memory_usable": usable}


def _read_linux() -> dict:
    meminfo = parse_meminfo(_read_text("/proc/meminfo") or "")
    memory_total = meminfo.get("MemTotal") or _sysconf_memory()
    usable = meminfo.get("MemAvailable")
    if usable is None and memory_total:
        # Kernels before 3.14 have no MemAvailable.
        usable = int(memory_total * USABLE_RAM_FRACTION)
    chip = parse_cpuinfo_model(_read_text("/proc/cpuinfo") or "") or platform.processor() or "unknown"
    try:
        # In a container or under taskset only these CPUs run our threads.
        cpu_cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpu_cores = os.cpu_count() or 1
    return {"chip": chip, "cpu_cores": cpu_cores, "gpu_cores": None, "memory_total": memory_total, "memory_usable": usable}


def _read_other() -> dict:
    memory_total = _sysconf_memory()
    return {
        "chip": platform.processor() or "unknown",
        "cpu_cores": os.cpu_count() or 1,
        "gpu_cores": None,
        "memory_total": memory_total,
        "memory_usable": int(memory_total * USABLE_RAM_FRACTION) if memory_total else None,
    }


def _chip() -> str:
    """The chip name alone, without the commands for the rest of the profile."""
    if sys.platform == "darwin":
        out = parse_sysctl(_run(["sysctl", "machdep.cpu.brand_string"]) or "")
        return out.get("machdep.cpu.brand_string") or "unknown"
    if sys.platform.startswith("linux"):
        return parse_cpuinfo_model(_read_text("/proc/cpuinfo") or "") or platform.processor() or "unknown"
    return platform.processor() or "unknown"


def check_capabilities(capabilities: Any) -> dict:
    """The config key ``capabilities``, validated; ValueError names the bad key."""
    if capabilities is None:
        return {}
    if not isinstance(capabilities, dict):
        raise ValueError(f"capabilities: expected a mapping such as {{memory_gb: 16}}, got {_show(capabilities)}")
    for key in capabilities:
        if key not in CAPABILITY_KEYS:
            raise ValueError(f"capabilities.{key}: unknown key; known keys are {', '.join(CAPABILITY_KEYS)}")
    out: dict = {}
    if "memory_gb" in capabilities:
        v = capabilities["memory_gb"]
        if not _is_number(v) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"capabilities.memory_gb: must be a number of GiB > 0, got {_show(v)}")
        out["memory_gb"] = float(v)
    if "gpu_cores" in capabilities:
        v = capabilities["gpu_cores"]
        if not _is_int(v) or v < 0:
            raise ValueError(f"capabilities.gpu_cores: must be an integer >= 0, got {_show(v)}")
        out["gpu_cores"] = v
    return out


def read_profile(capabilities: dict | None = None) -> DeviceProfile:
    """This machine's profile. ``capabilities`` (the config key) may override:
    memory_gb (GiB > 0; replaces memory_total and memory_usable) and gpu_cores
    (int >= 0). Unknown keys or bad values raise ValueError naming the key."""
    caps = check_capabilities(capabilities)
    if sys.platform == "darwin":
        found = _read_macos()
    elif sys.platform.startswith("linux"):
        found = _read_linux()
    else:
        found = _read_other()
    if "memory_gb" in caps:
        found["memory_total"] = found["memory_usable"] = int(caps["memory_gb"] * GIB)
    if "gpu_cores" in caps:
        found["gpu_cores"] = caps["gpu_cores"]
    if not found["memory_total"]:
        raise RuntimeError(
            "cannot read this machine's memory size; set it in the config, e.g. capabilities: {memory_gb: 16}"
        )
    total = found["memory_total"]
    usable = found["memory_usable"] if found["memory_usable"] is not None else int(total * USABLE_RAM_FRACTION)
    return DeviceProfile(
        system=_system(),
        chip=found["chip"][:MAX_WIRE_STR],
        cpu_cores=max(1, found["cpu_cores"]),
        gpu_cores=found["gpu_cores"],
        memory_total=total,
        # MemAvailable or Metal's working set never exceed RAM in practice; the
        # clamp keeps from_wire's invariant true whatever an OS reports.
        memory_usable=max(0, min(usable, total)),
    )


# ---------------------------------------------------------------- speed probe


def _probe_dtype(mx, dtype: str | None) -> str:
    if dtype is not None:
        return dtype
    # The CPU backend has no fast float16 matmul (it is slower than float32
    # there), while the GPU runs models in float16; probe what each does best.
    return "float32" if mx.default_device() == mx.cpu else "float16"


def _speed_cache_key(mx, dtype: str) -> str:
    return "|".join([_chip(), _system(), f"mlx {mx.__version__}", str(mx.default_device()), dtype, f"probe v{PROBE_VERSION}"])


def _read_speed_cache(path: Path, key: str) -> float | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.info("device: ignoring unreadable speed cache %s (%s); probing again", path, e)
        return None
    entry = data.get(key) if isinstance(data, dict) else None
    if _is_number(entry) and math.isfinite(entry) and entry > 0:
        return float(entry)
    if entry is not None:
        log.info("device: ignoring bad entry in speed cache %s; probing again", path)
    return None


def _write_speed_cache(path: Path, key: str, speed: float) -> None:
    data: dict = {}
    try:
        old = json.loads(path.read_text())
        if isinstance(old, dict):
            # Several MLX versions or devices may share one cache folder.
            data = {k: v for k, v in old.items() if _is_number(v)}
    except (OSError, ValueError):
        pass
    data[key] = speed
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a crash mid-write cannot leave a torn file that
        # a concurrent start would read.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        # Only a cache: the next start probes again.
        log.warning("device: cannot write speed cache %s: %s", path, e)


def _measure(dtype: str) -> float:
    import mlx.core as mx

    try:
        mx_dtype = getattr(mx, dtype)
        if not isinstance(mx_dtype, mx.Dtype) or not mx.issubdtype(mx_dtype, mx.floating):
            raise AttributeError
    except AttributeError:
        raise ValueError(f"dtype: {dtype!r} is not an MLX floating-point type such as float16, bfloat16 or float32") from None
    n = PROBE_N_CPU if mx.default_device() == mx.cpu else PROBE_N_GPU
    key_a, key_b = mx.random.split(mx.random.key(0))
    a = mx.random.normal((n, n), key=key_a).astype(mx_dtype)
    b = mx.random.normal((n, n), key=key_b).astype(mx_dtype)
    mx.eval(a, b)
    for _ in range(PROBE_WARMUP_ITERS):
        mx.eval(a @ b)
    iters = 0
    start = time.perf_counter()
    elapsed = 0.0
    while iters < PROBE_MAX_ITERS and (iters < PROBE_MIN_ITERS or elapsed < PROBE_MIN_SECONDS):
        mx.eval(a @ b)
        iters += 1
        elapsed = time.perf_counter() - start
    return 2 * n**3 * iters / elapsed / 1e9


def probe_speed(cache_dir: str | os.PathLike | None, dtype: str | None = None) -> float:
    """Relative compute speed in GFLOP/s from a short MLX matmul probe.

    Run it on the daemon's compute thread: it occupies the default device for
    a fraction of a second and must not race model work. ``dtype`` None picks
    float16 on a GPU and float32 on the CPU backend.

    The result is cached in ``cache_dir``/device-speed.json, keyed by chip,
    system, MLX version, default device and dtype, so a restart does not probe
    again; None disables the cache. A corrupt cache file is ignored and
    rewritten."""
    import mlx.core as mx

    dtype = _probe_dtype(mx, dtype)
    if cache_dir is None:
        return _measure(dtype)
    path = Path(cache_dir).expanduser() / SPEED_CACHE_FILE
    key = _speed_cache_key(mx, dtype)
    with _cache_lock(path):
        # Under the lock: daemons started together on one machine (`ringd local`,
        # a test cluster) measure once and all advertise the same speed, instead
        # of each its own noisy figure from probing side by side.
        cached = _read_speed_cache(path, key)
        if cached is not None:
            return cached
        speed = _measure(dtype)
        log.debug("device: measured %.1f GFLOP/s (%s on %s)", speed, dtype, mx.default_device())
        _write_speed_cache(path, key, speed)
    return speed


@contextlib.contextmanager
def _cache_lock(path: Path):
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a")
    except (ImportError, OSError) as e:  # no lock: at worst two probes race
        log.debug("device: no lock for %s: %s", path, e)
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- CLI


def default_cache_dir() -> Path:
    # The same folder `ringd demo` uses (ringd.app.cli.cache_dir), repeated here so
    # this small tool does not import the daemon's network stack.
    return Path(os.environ.get("RINGD_CACHE", Path.home() / ".cache" / "ringd"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringd.base.device", description="Print the device profile ringd sees on this machine, as JSON.")
    parser.add_argument("--no-cache", action="store_true", help=f"measure the speed again instead of reading {default_cache_dir() / SPEED_CACHE_FILE}")
    parser.add_argument("--memory-gb", type=float, help="pretend the machine has this many GiB (as capabilities.memory_gb)")
    parser.add_argument("--gpu-cores", type=int, help="override the GPU core count (as capabilities.gpu_cores)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log why a field is unknown")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    caps = {k: v for k, v in (("memory_gb", args.memory_gb), ("gpu_cores", args.gpu_cores)) if v is not None}
    try:
        profile = read_profile(caps)
        profile = replace(profile, speed=probe_speed(None if args.no_cache else default_cache_dir()))
    except (ValueError, RuntimeError) as e:
        print(f"ringd.base.device: {e}", file=sys.stderr)
        return 2
    print(json.dumps(profile.to_wire(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
