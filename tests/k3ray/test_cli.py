"""The `k3ray` CLI: subcommands come from entry points, only the chosen one is imported."""

import subprocess
import sys

import pytest

from k3ray.cli import build_parser, main, registry

COMMANDS = {"bench", "cluster", "eval", "generate", "info", "plan", "serve", "status"}
BENCHMARKS = {"cluster", "compile", "engine", "kernels", "layer", "model", "serve", "soak"}


def test_registries_list_every_command_and_benchmark():
    assert set(registry("k3ray.commands")) == COMMANDS
    assert set(registry("k3ray.benchmarks")) == BENCHMARKS


def test_top_level_help_lists_commands_without_importing_torch_or_ray(tmp_path):
    code = ("import sys\nfrom k3ray.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("[]")
    for name in COMMANDS:
        assert f"\n    {name} " in done.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("k3ray ")


def test_a_benchmark_gets_its_own_and_the_common_flags():
    args = build_parser(["bench", "model", "--repeats", "2", "--json", "x.json"]).parse_args(
        ["bench", "model", "--repeats", "2", "--json", "x.json"])
    assert (args.command, args.command_1, args.repeats, args.json) == ("bench", "model", 2, "x.json")
    assert args._leaf.__name__ == "k3ray.bench.model"


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["nonsense"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_value_errors_name_the_command(capsys):
    assert main(["plan", "--model", "k3", "--device-type", "h200", "--pipeline", "1", "--expert-parallel", "1"]) == 2
    assert capsys.readouterr().err.startswith("k3ray plan: error: ")
