"""The package-dir mapping (kernels/ -> k3ray.kernels, ...) survives a real wheel build."""

import os
import pathlib
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAPPED = {"k3ray": "k3ray", "k3ray.kernels": "kernels", "k3ray.actors": "actors", "k3ray.evals": "evals"}


def declared() -> tuple[list[str], dict[str, str]]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return tool["packages"], tool["package-dir"]


def test_package_dir_mapping_is_declared():
    _, package_dir = declared()
    assert package_dir == {k: v for k, v in MAPPED.items() if k != "k3ray"}


def test_every_package_folder_is_listed():
    packages, _ = declared()
    found = set()
    for name, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts or (name == "k3ray" and rel.parts and rel.parts[0] in ("kernels", "actors", "evals")):
                continue  # reached through the source-tree links
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert sorted(found) == sorted(packages)


def test_source_tree_links_resolve_to_the_mapped_folders():
    """k3ray/kernels -> ../kernels (and actors, evals): a process whose sys.path starts at the
    repository root (python -c, Ray workers, which get the driver's cwd) still finds k3ray.kernels."""
    for mapped in ("kernels", "actors", "evals"):
        link = ROOT / "k3ray" / mapped
        assert link.is_symlink() and link.resolve() == (ROOT / mapped).resolve()


def test_repo_root_on_sys_path_imports_the_same_files():
    script = (
        "import k3ray.kernels.kda.naive as n, k3ray.actors, k3ray.evals\n"
        "print(n.__file__)\n"
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert pathlib.Path(res.stdout.split()[-1]).resolve() == (ROOT / "kernels" / "kda" / "naive.py").resolve()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True, timeout=300, cwd=out,
    )
    (whl,) = out.glob("k3ray-*.whl")
    return whl


def test_wheel_holds_mapped_packages(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for path in ("k3ray/kernels/kda/naive.py", "k3ray/kernels/moe/mxfp4.py", "k3ray/actors/__init__.py",
                 "k3ray/evals/__init__.py", "k3ray/models/k3.py", "k3ray/config.py"):
        assert path in names, path
    assert not any(n.startswith(("kernels/", "actors/", "evals/", "tests/")) for n in names)


def test_every_module_imports_from_the_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    script = (
        "import importlib, pkgutil, sys, k3ray\n"
        f"assert k3ray.__file__.startswith({str(target)!r}), k3ray.__file__\n"
        "mods = [m.name for m in pkgutil.walk_packages(k3ray.__path__, 'k3ray.')]\n"
        "for m in mods: importlib.import_module(m)\n"
        "import k3ray.kernels.kda.naive as n\n"
        f"assert n.__file__.startswith({str(target)!r})\n"
        "assert 'kernels' not in sys.modules\n"
        "print(len(mods))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert int(res.stdout.split()[-1]) > 20
