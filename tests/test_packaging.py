"""The package-dir mapping (kernels/ -> k3ray.kernels, ...) survives a real wheel build, and the\nentry points the CLI finds its subcommands through name modules that exist."""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib

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
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert sorted(found) == sorted(packages)


def test_no_links_stand_in_for_the_mapping():
    """package-dir is the one mechanism: a link inside k3ray/ would load kernels twice under two names."""
    for mapped in ("kernels", "actors", "evals"):
        assert not (ROOT / "k3ray" / mapped).exists(), f"k3ray/{mapped} exists beside the package-dir mapping"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """Built from a copy of the files git sees (tracked and not ignored): the checkout's own build/ may
    hold modules that moved since, which setuptools would ship again."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True, timeout=300, cwd=out,
    )
    (whl,) = out.glob("k3ray-*.whl")
    return whl


def test_wheel_holds_mapped_packages(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for path in ("k3ray/kernels/kda/naive.py", "k3ray/kernels/moe/mxfp4.py", "k3ray/actors/__init__.py",
                 "k3ray/evals/__init__.py", "k3ray/models/k3.py", "k3ray/config.py"):
        assert path in names, path
    assert not any(n.startswith(("kernels/", "actors/", "evals/", "tests/", "training/")) for n in names)


def test_wheel_ships_no_training_code_or_log(wheel):
    """The training program stays in the checkout (training/); the shipped checkpoint is what loading it needs."""
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "k3ray_training" in n or "/fixture/" in n or n.startswith("k3ray/checkpoints/")
                and n.endswith(".jsonl")]
    files = ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json"]
    for name, extra in (("k3-tiny-niah", []), ("k3-tiny-vl", ["preprocessor_config.json"])):
        shipped = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith(f"k3ray/checkpoints/{name}/"))
        assert shipped == sorted(files + extra), name


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


def test_every_entry_point_names_a_command_module():
    from importlib.metadata import entry_points

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert set(project) == {"k3ray.commands", "k3ray.benchmarks", "k3ray.cluster"}
    for group, declared_points in project.items():
        installed = {ep.name: ep.value for ep in entry_points(group=group)}
        assert installed == declared_points, f"{group}: reinstall k3ray (pip install -e .) after editing pyproject"
        for ep in entry_points(group=group):
            module = ep.load()
            assert isinstance(module.HELP, str), ep
            assert callable(getattr(module, "add_arguments", None)) or module.SUBCOMMANDS in project, ep
            assert callable(getattr(module, "run" if group == "k3ray.benchmarks" else "main")), ep
