"""The wheel ships the Lua scripts inside the package, and the installed package finds them."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = out.glob("felix_redis-*.whl")
    target = out / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def test_wheel_contains_every_script(unpacked_wheel: Path) -> None:
    shipped = {p.name for p in (unpacked_wheel / "felix_redis" / "lua").glob("*.lua")}
    source = {p.name for p in (ROOT / "lua").glob("*.lua")}
    assert shipped == source
    assert (unpacked_wheel / "felix_redis" / "lua" / "includes" / "prelude.lua").is_file()
    assert (unpacked_wheel / "felix_redis" / "py.typed").is_file()


def test_installed_package_loads_its_own_scripts(unpacked_wheel: Path) -> None:
    code = (
        "import felix_redis, felix_redis.scripts as s; "
        f"assert felix_redis.__file__.startswith({str(unpacked_wheel)!r}), felix_redis.__file__; "
        "print(s.lua_dir()); print(len(s.load_all()))"
    )
    env = {**os.environ, "PYTHONPATH": str(unpacked_wheel)}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=unpacked_wheel, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lua_dir, count = result.stdout.split()
    assert lua_dir == str(unpacked_wheel / "felix_redis" / "lua")
    assert int(count) == len(list((ROOT / "lua").glob("*.lua")))


def test_wheel_ships_every_dashboard_asset(unpacked_wheel: Path) -> None:
    """The dashboard works offline: its templates, script and style sheet are in the
    wheel, and the pages load nothing from another host."""
    source = ROOT / "felix_redis" / "dashboard"
    for folder in ("templates", "static"):
        shipped = {p.name for p in (unpacked_wheel / "felix_redis" / "dashboard" / folder).iterdir()}
        assert shipped == {p.name for p in (source / folder).iterdir()}, folder
        assert shipped
    for page in (source / "templates").iterdir():
        text = page.read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, page.name
