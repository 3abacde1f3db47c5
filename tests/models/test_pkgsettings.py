"""ringd.models.remote.pkgsettings: the package indexes this machine's uv and pip settings name, in uv's and pip's order.

Every test gives the settings (environment and config files) explicitly, so the
machine's own stay out of it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ringd.models.remote.pkgsettings import PYPI, index_urls, pip_config_files, uv_config_files



def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_with_no_settings_the_index_is_pypi():
    assert index_urls({}, uv_configs=[], pip_configs=[]) == [PYPI]


def test_pip_extra_indexes_as_on_this_machine_come_before_pypi(tmp_path):
    conf = write(tmp_path / "pip.conf", "[global]\nfind-links = /opt/wheels\nextra-index-url = file:///opt/pypi/simple file:///opt/pypi-more/simple\n")
    assert index_urls({}, uv_configs=[], pip_configs=[conf]) == ["file:///opt/pypi/simple", "file:///opt/pypi-more/simple", PYPI]


def test_uv_environment_variables_in_uv_order():
    env = {
        "UV_DEFAULT_INDEX": "corp=https://default.example/simple",
        "UV_INDEX": "first=https://a.example/simple https://b.example/simple",
        "UV_INDEX_URL": "https://index-url.example/simple",  # a default too: UV_DEFAULT_INDEX wins
        "UV_EXTRA_INDEX_URL": "https://extra.example/simple",
    }
    assert index_urls(env, uv_configs=[], pip_configs=[]) == [
        "https://a.example/simple", "https://b.example/simple", "https://extra.example/simple", "https://default.example/simple",
    ]  # fmt: skip
    del env["UV_DEFAULT_INDEX"]
    assert index_urls(env, uv_configs=[], pip_configs=[])[-1] == "https://index-url.example/simple"


def test_uv_toml_files_the_users_before_the_systems_and_the_environment_before_both(tmp_path):
    user = write(tmp_path / "user" / "uv.toml", """
index-url = "https://user-default.example/simple"
extra-index-url = ["https://user-extra.example/simple"]
[[index]]
name = "mirror"
url = "https://user-mirror.example/simple"
[[index]]
name = "pinned-only"
url = "https://explicit.example/simple"
explicit = true
""")  # fmt: skip
    system = write(tmp_path / "system" / "uv.toml", """
index-url = "https://system-default.example/simple"
[[index]]
name = "mirror"
url = "https://system-mirror.example/simple"
[[index]]
url = "https://system-extra.example/simple"
""")  # fmt: skip
    env = {"UV_INDEX": "https://env.example/simple"}
    assert index_urls(env, uv_configs=[user, system], pip_configs=[]) == [
        "https://env.example/simple",
        "https://user-mirror.example/simple",  # the system's index of the same name is not used
        "https://system-extra.example/simple",
        "https://user-extra.example/simple",
        "https://user-default.example/simple",  # the user's index-url over the system's; no PyPI
    ]
    # An [[index]] marked default is the default, whichever file names it.
    write(system, '[[index]]\nurl = "https://system-default-index.example/simple"\ndefault = true\n')
    assert index_urls(env, uv_configs=[user, system], pip_configs=[])[-1] == "https://system-default-index.example/simple"


def test_uv_indexes_before_pips_and_a_default_from_either_replaces_pypi(tmp_path):
    conf = write(tmp_path / "pip.conf", "[global]\nextra-index-url = https://pip-extra.example/simple\n")
    env = {"UV_INDEX": "https://uv.example/simple"}
    assert index_urls(env, uv_configs=[], pip_configs=[conf]) == ["https://uv.example/simple", "https://pip-extra.example/simple", PYPI]
    env["PIP_INDEX_URL"] = "https://pip-default.example/simple"
    assert index_urls(env, uv_configs=[], pip_configs=[conf]) == [
        "https://uv.example/simple", "https://pip-default.example/simple", "https://pip-extra.example/simple",
    ]  # fmt: skip
    env["UV_DEFAULT_INDEX"] = "https://uv-default.example/simple/"
    env["PIP_EXTRA_INDEX_URL"] = "https://uv-default.example/simple"  # the same index, named twice: tried once
    assert index_urls(env, uv_configs=[], pip_configs=[conf]) == [
        "https://uv.example/simple", "https://uv-default.example/simple/", "https://pip-default.example/simple",
    ]  # fmt: skip


def test_pip_settings_a_later_file_the_install_section_and_the_environment_override(tmp_path):
    system = write(tmp_path / "etc" / "pip.conf", "[global]\nindex-url = https://system.example/simple\nextra-index-url = https://system-extra.example/simple\n")
    user = write(tmp_path / "user" / "pip.conf", "[global]\nindex_url = https://user.example/simple\n")
    assert index_urls({}, uv_configs=[], pip_configs=[system, user]) == ["https://user.example/simple", "https://system-extra.example/simple"]
    write(system, "[install]\nindex-url = https://install.example/simple\n")
    assert index_urls({}, uv_configs=[], pip_configs=[system, user]) == ["https://install.example/simple"]
    env = {"PIP_INDEX_URL": "https://env.example/simple"}
    assert index_urls(env, uv_configs=[], pip_configs=[system, user]) == ["https://env.example/simple"]


def test_local_directories_are_file_indexes(tmp_path):
    conf = write(tmp_path / "conf" / "uv.toml", '[[index]]\nurl = "mirror/simple"\n')
    env = {"UV_INDEX": "/srv/pypi/simple"}
    assert index_urls(env, uv_configs=[conf], pip_configs=[]) == [
        "file:///srv/pypi/simple", (tmp_path / "conf" / "mirror" / "simple").resolve().as_uri(), PYPI,  # relative to its uv.toml
    ]  # fmt: skip


def test_the_config_files_are_found_where_uv_and_pip_look(tmp_path):
    home = tmp_path / "home"
    user_uv = write(home / ".config" / "uv" / "uv.toml", "")
    system_uv = write(tmp_path / "xdg2" / "uv" / "uv.toml", "")
    env = {"HOME": str(home), "XDG_CONFIG_DIRS": f"{tmp_path / 'xdg1'}:{tmp_path / 'xdg2'}"}
    assert uv_config_files(env) == [user_uv, system_uv]
    assert uv_config_files({**env, "XDG_CONFIG_HOME": str(tmp_path / "elsewhere")}) == [system_uv]
    assert uv_config_files({**env, "UV_CONFIG_FILE": str(tmp_path / "only.toml")}) == [tmp_path / "only.toml"]
    assert uv_config_files({**env, "UV_NO_CONFIG": "1"}) == []

    legacy, user_pip = home / ".pip" / "pip.conf", home / ".config" / "pip" / "pip.conf"
    found = pip_config_files(env)
    assert found[-2:] == [legacy, user_pip]
    if sys.platform != "darwin":  # macOS has one global file, in /Library
        assert found[:3] == [tmp_path / "xdg1" / "pip" / "pip.conf", tmp_path / "xdg2" / "pip" / "pip.conf", Path("/etc/pip.conf")]
    chosen = write(tmp_path / "chosen.conf", "")
    assert pip_config_files({**env, "PIP_CONFIG_FILE": str(chosen)})[-1] == chosen
    assert user_pip not in pip_config_files({**env, "PIP_CONFIG_FILE": str(chosen)})  # as pip: an existing one replaces the user's
    assert pip_config_files({**env, "PIP_CONFIG_FILE": os.devnull}) == []


def test_the_settings_found_from_the_environment_are_used(tmp_path):
    home = tmp_path / "home"
    write(home / ".config" / "uv" / "uv.toml", 'extra-index-url = ["https://from-uv-toml.example/simple"]\n')
    write(home / ".config" / "pip" / "pip.conf", "[global]\nextra-index-url = https://from-pip-conf.example/simple\n")
    write(tmp_path / "xdg" / "uv" / "uv.toml", "")
    env = {"HOME": str(home), "XDG_CONFIG_DIRS": str(tmp_path / "xdg")}
    urls = index_urls(env)  # /etc/pip.conf may add its own
    assert urls.index("https://from-uv-toml.example/simple") < urls.index("https://from-pip-conf.example/simple")

