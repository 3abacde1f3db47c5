"""Device profiles: the OS parsers, read_profile, the wire format and the speed probe."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from ringd.base import device
from ringd.base.device import (
    GIB,
    SPEED_CACHE_FILE,
    DeviceProfile,
    format_system,
    parse_cpuinfo_model,
    parse_ioreg_gpu_cores,
    parse_meminfo,
    parse_sysctl,
    parse_system_profiler_gpu_cores,
    probe_speed,
    read_profile,
)

# ------------------------------------------------------------ captured samples

MEMINFO = """\
MemTotal:       16303548 kB
MemFree:         1204496 kB
MemAvailable:    9876544 kB
Buffers:          402012 kB
Cached:          8012344 kB
SwapTotal:       2097148 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""

CPUINFO_X86 = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 154
model name\t: 12th Gen Intel(R) Core(TM) i7-1260P
stepping\t: 3

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: 12th Gen Intel(R) Core(TM) i7-1260P
"""

CPUINFO_ARM64 = """\
processor\t: 0
BogoMIPS\t: 48.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd0c
"""

SYSCTL_APPLE = """\
hw.memsize: 34359738368
machdep.cpu.brand_string: Apple M2 Pro
hw.ncpu: 12
hw.perflevel0.physicalcpu: 8
hw.perflevel1.physicalcpu: 4
"""

IOREG_AGX = """\
+-o AGXAcceleratorG14X  <class AGXAcceleratorG14X, id 0x100000264, registered, matched, active, busy 0 (0 ms), retain 53>
    {
      "IOClass" = "AGXAcceleratorG14X"
      "gpu-core-count" = 19
      "IOProviderClass" = "IOPlatformDevice"
      "model" = "Apple M2 Pro"
      "AGXParameterBufferMaxSize" = 1073741824
      "PerformanceStatistics" = {"In use system memory"=1342177280,"Device Utilization %"=4}
    }
"""

SYSTEM_PROFILER_DISPLAYS = json.dumps(
    {
        "SPDisplaysDataType": [
            {
                "_name": "Apple M2 Pro",
                "spdisplays_mtlgpufamilysupport": "spdisplays_metal3",
                "spdisplays_vendor": "sppci_vendor_Apple",
                "sppci_bus": "spdisplays_builtin",
                "sppci_cores": "19",
                "sppci_device_type": "spdisplays_gpu",
                "sppci_model": "Apple M2 Pro",
            }
        ]
    },
    indent=2,
)


def test_linux_parsers():
    info = parse_meminfo(MEMINFO)
    assert info["MemTotal"] == 16303548 * 1024
    assert info["MemAvailable"] == 9876544 * 1024
    assert info["HugePages_Total"] == 0  # a count, not kB
    assert parse_meminfo("") == {}
    assert parse_meminfo("garbage\nMemTotal: lots kB\n") == {}

    assert parse_cpuinfo_model(CPUINFO_X86) == "12th Gen Intel(R) Core(TM) i7-1260P"
    assert parse_cpuinfo_model(CPUINFO_ARM64) is None
    assert parse_cpuinfo_model("") is None


def test_macos_parsers():
    """These outputs are samples captured by hand from an M2 Pro Mac: sysctl,
    ioreg and system_profiler do not exist on the Linux machines tests run on."""
    sysctl = parse_sysctl(SYSCTL_APPLE)
    assert sysctl["hw.memsize"] == "34359738368"
    assert sysctl["machdep.cpu.brand_string"] == "Apple M2 Pro"
    assert sysctl["hw.perflevel1.physicalcpu"] == "4"
    # An Intel Mac lacks the perflevel keys; sysctl reports them on stderr only.
    assert parse_sysctl("hw.memsize: 17179869184\nhw.ncpu: 8\n") == {"hw.memsize": "17179869184", "hw.ncpu": "8"}

    assert parse_ioreg_gpu_cores(IOREG_AGX) == 19
    assert parse_ioreg_gpu_cores("") is None
    assert parse_ioreg_gpu_cores('"model" = "Apple M1"') is None

    assert parse_system_profiler_gpu_cores(SYSTEM_PROFILER_DISPLAYS) == 19
    assert parse_system_profiler_gpu_cores('{"SPDisplaysDataType": [{"_name": "Intel UHD Graphics 630"}]}') is None
    assert parse_system_profiler_gpu_cores("not json") is None
    assert parse_system_profiler_gpu_cores("[]") is None


def test_format_system():
    assert format_system("Darwin", "24.1.0", "arm64", "15.1") == "macOS 15.1 (arm64)"
    assert format_system("Linux", "6.8.0-45-generic", "x86_64") == "Linux 6.8 (x86_64)"


def test_failed_commands_give_none():
    assert device._run(["/nonexistent/ringd-no-such-tool"]) is None
    assert device._run([sys.executable, "-c", "import sys; sys.exit(3)"]) is None
    # A hung tool costs its timeout, not the node's start.
    assert device._run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.2) is None


def test_macos_reader_on_samples(monkeypatch):
    """The macOS reader fed the samples above in place of the real tools."""
    outputs = {"sysctl": SYSCTL_APPLE, "ioreg": IOREG_AGX, "system_profiler": SYSTEM_PROFILER_DISPLAYS}
    monkeypatch.setattr(device, "_run", lambda args, timeout=None: outputs.get(args[0]))
    monkeypatch.setattr(device, "_metal_info", lambda: {"device_name": "Apple M2 Pro", "max_recommended_working_set_size": 22 * GIB})
    assert device._read_macos() == {
        "chip": "Apple M2 Pro",
        "cpu_cores": 12,
        "gpu_cores": 19,
        "memory_total": 32 * GIB,
        "memory_usable": 22 * GIB,
    }
    # ioreg silent: system_profiler answers. No Metal: three quarters of RAM.
    outputs["ioreg"] = None
    monkeypatch.setattr(device, "_metal_info", lambda: None)
    found = device._read_macos()
    assert found["gpu_cores"] == 19 and found["memory_usable"] == 24 * GIB
    # Every tool failing still gives a profile, with unknowns.
    outputs.clear()
    found = device._read_macos()
    assert found["gpu_cores"] is None and found["cpu_cores"] >= 1
    assert found["chip"]


# ------------------------------------------------------------ read_profile


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks the Linux readers")
def test_read_profile_on_linux():
    p = read_profile()
    assert p.system.startswith("Linux ")
    assert p.chip
    assert p.memory_total > 0
    assert 0 < p.memory_usable <= p.memory_total
    assert p.cpu_cores >= 1
    assert p.gpu_cores is None
    assert p.speed is None


def test_capabilities_override():
    p = read_profile({"memory_gb": 1.5, "gpu_cores": 38})
    assert p.memory_total == p.memory_usable == int(1.5 * GIB)
    assert p.gpu_cores == 38
    assert read_profile({}).memory_total == read_profile(None).memory_total


@pytest.mark.parametrize(
    "caps, key",
    [
        ({"memory_gb": 0}, "memory_gb"),
        ({"memory_gb": -2}, "memory_gb"),
        ({"memory_gb": "16"}, "memory_gb"),
        ({"memory_gb": True}, "memory_gb"),
        ({"memory_gb": float("nan")}, "memory_gb"),
        ({"gpu_cores": -1}, "gpu_cores"),
        ({"gpu_cores": 1.5}, "gpu_cores"),
        ({"gpu_cores": False}, "gpu_cores"),
        ({"gpu_core": 10}, "gpu_core"),
        ({"memory_gb": 8, "speed": 100}, "speed"),
    ],
)
def test_bad_capabilities_name_the_key(caps, key):
    with pytest.raises(ValueError, match=rf"capabilities\.{key}\b"):
        read_profile(caps)


def test_capabilities_must_be_a_mapping():
    with pytest.raises(ValueError, match="capabilities"):
        read_profile(["memory_gb", 8])  # type: ignore[arg-type]


def test_memory_unreadable_asks_for_memory_gb(monkeypatch):
    empty = {"chip": "unknown", "cpu_cores": 1, "gpu_cores": None, "memory_total": None, "memory_usable": None}
    for reader in ("_read_macos", "_read_linux", "_read_other"):
        monkeypatch.setattr(device, reader, lambda: dict(empty))
    with pytest.raises(RuntimeError, match="memory_gb"):
        read_profile()
    assert read_profile({"memory_gb": 4}).memory_total == 4 * GIB


# ------------------------------------------------------------ budget and wire

PROFILE = DeviceProfile(
    system="macOS 15.1 (arm64)",
    chip="Apple M2 Pro",
    cpu_cores=12,
    gpu_cores=19,
    memory_total=32 * GIB,
    memory_usable=24 * GIB,
    speed=4321.5,
)


def test_budget_caps():
    assert PROFILE.budget(None) == 24 * GIB
    assert PROFILE.budget(8) == 8 * GIB
    assert PROFILE.budget(0.5) == GIB // 2
    assert PROFILE.budget(100) == 24 * GIB  # the budget never exceeds what the machine can hold
    with pytest.raises(ValueError, match="memory_budget_gb"):
        PROFILE.budget(0)


def test_wire_round_trip():
    wire = json.loads(json.dumps(PROFILE.to_wire()))
    assert DeviceProfile.from_wire(wire) == PROFILE
    linux = DeviceProfile("Linux 6.8 (x86_64)", "unknown", 2, None, GIB, GIB // 2)
    assert DeviceProfile.from_wire(json.loads(json.dumps(linux.to_wire()))) == linux
    # A newer peer may send fields this version does not know.
    assert DeviceProfile.from_wire({**wire, "npu_cores": 16}) == PROFILE
    # JSON may carry an integral speed as an int.
    assert DeviceProfile.from_wire({**wire, "speed": 100}).speed == 100.0


@pytest.mark.parametrize(
    "change, field",
    [
        ({"system": 3}, "system"),
        ({"chip": ""}, "chip"),
        ({"chip": "x" * 10_000}, "chip"),
        ({"cpu_cores": 0}, "cpu_cores"),
        ({"cpu_cores": "12"}, "cpu_cores"),
        ({"cpu_cores": True}, "cpu_cores"),
        ({"gpu_cores": -1}, "gpu_cores"),
        ({"gpu_cores": 19.0}, "gpu_cores"),
        ({"memory_total": 0}, "memory_total"),
        ({"memory_total": 1.5e10}, "memory_total"),
        ({"memory_usable": 33 * GIB}, "memory_usable"),
        ({"memory_usable": -1}, "memory_usable"),
        ({"speed": 0}, "speed"),
        ({"speed": float("inf")}, "speed"),
        ({"speed": "fast"}, "speed"),
    ],
)
def test_from_wire_rejects_bad_fields(change, field):
    with pytest.raises(ValueError, match=field):
        DeviceProfile.from_wire({**PROFILE.to_wire(), **change})


def test_from_wire_rejects_bad_shapes():
    with pytest.raises(ValueError, match="object"):
        DeviceProfile.from_wire([1, 2])
    wire = PROFILE.to_wire()
    del wire["memory_total"]
    with pytest.raises(ValueError, match="missing memory_total"):
        DeviceProfile.from_wire(wire)


# ------------------------------------------------------------ speed probe


def test_probe_speed_caches(tmp_path):
    speed = probe_speed(tmp_path)
    assert speed > 0 and math.isfinite(speed)
    cache = tmp_path / SPEED_CACHE_FILE
    assert cache.exists()
    (key, value), = json.loads(cache.read_text()).items()
    assert value == speed
    assert "mlx" in key and "cpu" in key.lower()

    mtime = cache.stat().st_mtime_ns
    # A restart reads the number instead of measuring again.
    assert probe_speed(tmp_path) == speed
    assert cache.stat().st_mtime_ns == mtime


def test_probe_speed_rewrites_corrupt_cache(tmp_path):
    cache = tmp_path / SPEED_CACHE_FILE
    cache.write_text("{not json")
    speed = probe_speed(tmp_path)
    assert speed > 0
    assert list(json.loads(cache.read_text()).values()) == [speed]
    # A bad entry under the right key is measured again too.
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: "fast"}))
    assert probe_speed(tmp_path) > 0
    assert isinstance(json.loads(cache.read_text())[key], float)


def test_probe_speed_without_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert probe_speed(None) > 0
    assert os.listdir(tmp_path) == []


def test_probe_speed_bad_dtype():
    with pytest.raises(ValueError, match="int32"):
        probe_speed(None, dtype="int32")
    with pytest.raises(ValueError, match="nope"):
        probe_speed(None, dtype="nope")


def test_cli_prints_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RINGD_CACHE", str(tmp_path))
    assert device.main(["--memory-gb", "2"]) == 0
    out = DeviceProfile.from_wire(json.loads(capsys.readouterr().out))
    assert out.memory_total == 2 * GIB and out.speed and out.speed > 0
    assert (tmp_path / SPEED_CACHE_FILE).exists()
    assert device.main(["--gpu-cores", "-3"]) == 2
    assert "capabilities.gpu_cores" in capsys.readouterr().err
