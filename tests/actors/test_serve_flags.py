"""`k3ray serve` flags and the Serve config YAML, both generated from the settings
(actors/serve/config.py): one flag per field with its description and default, a flag given lands
in its nested field, no flag gives the defaults, and the YAML holds every setting and reads back
the same. (The committed cluster/ configs against their commands: tests/test_cluster_files.py.)"""

import argparse
import re
import subprocess
import sys
import typing

import pytest
import yaml
from pydantic import ValidationError

from k3ray.actors.serve import cli as serve_cli
from k3ray.actors.serve.config import LaunchSettings, ServeArgs
from k3ray.actors.serve.flags import (
    LAUNCH_GROUP,
    command_flags,
    fields,
    flag,
    given,
    launch_settings,
    scalar,
    serve_args,
)
from k3ray.actors.serve.yaml_config import serve_config_yaml

# the flags `k3ray serve` had before they were generated (README, tests and scripts use them)
FLAGS = {
    "--host", "--port", "--address", "--ingress", "--proxy-location", "--num-cpus", "--stop-grace-s", "--api-key",
    "--max-body-bytes",
    "--served-model-name", "--model", "--dtype", "--tokenizer", "--pipeline", "--expert-parallel", "--replica-cpus",
    "--stage-cpus", "--shard-cpus", "--router-cpus", "--stage-gpus", "--shard-gpus", "--replica-gpus",
    "--vision-cpus", "--vision-gpus", "--allow-remote-media-urls", "--max-media-bytes", "--max-media-per-prompt",
    "--media-fetch-timeout-s", "--allowed-local-media-path", "--placement-strategy", "--moe-dispatch", "--threads", "--engine-process",
    "--min-replicas", "--max-replicas", "--initial-replicas", "--target-ongoing-requests", "--upscale-delay-s",
    "--downscale-delay-s", "--metrics-interval-s", "--look-back-period-s", "--max-ongoing-requests",
    "--max-queued-requests", "--retry-after-s", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
    "--block-size", "--cache-memory-mb", "--enable-prefix-caching", "--speculative-ngram", "--seed",
    "--max-queued-tokens", "--max-queue-wait-s", "--max-request-pixels", "--device", "--enforce-eager",
    "--redundant-experts", "--rebalance-steps", "--autoscale-policy", "--autoscale-ttft-ms", "--autoscale-queued-tokens",
    "--request-router", "--affinity-max-imbalance", "--routing-stats-period-s", "--stage-transport", "--handoff-transport",
    "--long-prefill-token-threshold", "--long-context-reserve",
    "--prefill-replicas", "--prefill-max-replicas", "--handoff-attempts", "--autoscale-itl-ms",
    "--max-schema-bytes", "--grammar-compile-timeout-s", "--grammar-compile-memory-mb", "--grammar-cache-mb",
    "--grammar-compile-workers",
}
GROUPS = [LAUNCH_GROUP, "server", "model", "parallel", "engine", "autoscaling", "routing", "media", "disaggregation"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser.parse_args(argv)


def other_value(name: str) -> tuple[list[str], object]:
    """argv giving field `name` a valid value other than its default, and that value."""
    _, info = fields()[name]
    kind = info.annotation
    if typing.get_origin(kind) in (typing.Union, type(int | None)):
        (kind,) = [k for k in typing.get_args(kind) if k is not type(None)]
    if kind is bool:
        return [flag(name) if not info.default else f"--no-{flag(name)[2:]}"], not info.default
    if typing.get_origin(kind) is typing.Literal:
        value = next(choice for choice in reversed(typing.get_args(kind)) if choice != info.default)
    else:
        value = {int: 3, float: 3.5, str: "x"}[kind]
    return [flag(name), str(value)], value


def test_every_field_has_exactly_one_flag_with_its_description_and_default():
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    table = fields()
    assert {flag(name) for name in table} == FLAGS
    actions = [a for a in parser._actions if a.dest in table]
    assert sorted(a.dest for a in actions) == sorted(table)  # one action per field
    for action in actions:
        _, info = table[action.dest]
        assert action.option_strings[0] == flag(action.dest) and action.default is None
        if info.default is not None:
            assert action.help == f"{info.description} (default: {scalar(info.default)})".replace("%", "%%")
        else:  # an unset default shows what it means, the description's "null = X"
            meaning = re.search(r"null = ([^;]*)", info.description).group(1)
            assert action.help.endswith(f"(default: {meaning})".replace("%", "%%")) and "null" not in action.help
    sections = [g.title for g in parser._action_groups if any(a.dest in table for a in g._group_actions)]
    assert sections == GROUPS
    for group in sections:
        section = next(g for g in parser._action_groups if g.title == group)
        assert {table[a.dest][0] for a in section._group_actions} == {group}


@pytest.mark.parametrize("name", sorted(fields()))
def test_a_flag_given_lands_in_its_nested_field(name):
    argv, value = other_value(name)
    group, _ = fields()[name]
    args = parse(argv)
    assert given(args) == {group: {name: value}}
    assert command_flags(args) == [" ".join(argv)]


def test_all_flags_at_once_validate_into_their_groups():
    chosen = {name: other_value(name) for name in fields() if name != "address"}  # address excludes ingress
    args = parse([word for argv, _ in chosen.values() for word in argv])
    settings, launch = ServeArgs.model_validate(serve_args(args)), launch_settings(args)
    for name, (_, value) in chosen.items():
        group, _ = fields()[name]
        holder = launch if group == LAUNCH_GROUP else getattr(settings, group)
        assert getattr(holder, name) == value, name


def test_no_flags_give_the_defaults():
    args = parse([])
    assert given(args) == {} and serve_args(args) == {} and command_flags(args) == []
    assert ServeArgs.model_validate(serve_args(args)) == ServeArgs()
    assert launch_settings(args) == LaunchSettings()


def test_unknown_or_flat_keys_are_rejected():
    with pytest.raises(ValidationError, match="max_num_seq"):
        ServeArgs.model_validate({"engine": {"max_num_seq": 8}})
    with pytest.raises(ValidationError, match="max_num_seqs"):
        ServeArgs.model_validate({"max_num_seqs": 8})  # the flat form of before: a field belongs to its group
    with pytest.raises(ValidationError):
        ServeArgs.model_validate({"model": "/a/checkpoint"})
    with pytest.raises(ValidationError):
        ServeArgs().engine.max_num_seqs = 8  # frozen


def test_bad_values_fail_like_before():
    with pytest.raises(ValidationError, match="min_replicas=3 exceeds max_replicas=1"):
        ServeArgs.model_validate({"autoscaling": {"min_replicas": 3}})
    with pytest.raises(ValidationError, match="initial_replicas"):
        ServeArgs.model_validate({"autoscaling": {"max_replicas": 2, "initial_replicas": 3}})
    with pytest.raises(ValueError, match="ingress applies to the local Ray"):
        serve_cli.main(parse(["--address", "127.0.0.1:1", "--ingress", "proxy"]))


def test_the_yaml_holds_every_setting_and_reads_back_the_same():
    args = parse(["--max-num-seqs", "8", "--model", "/ckpt", "--no-enable-prefix-caching", "--host", "0.0.0.0"])
    settings, launch = ServeArgs.model_validate(serve_args(args)), launch_settings(args)
    text = serve_config_yaml(settings, launch, command_flags(args))
    config = yaml.safe_load(text)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    (app,) = config["applications"]
    assert app["args"] == settings.model_dump()  # every group, every field, defaults included
    assert ServeArgs.model_validate(app["args"]) == settings
    command = "--host 0.0.0.0 --model /ckpt --max-num-seqs 8 --no-enable-prefix-caching --print-config"
    assert f"#   k3ray serve {command}\n" in text
    for name, (group, info) in fields().items():
        if group != LAUNCH_GROUP or name in ("host", "port"):  # the rest of launch is not in a Serve config
            assert " ".join(info.description.split()[:4]) in text  # each setting's description as its comment


def test_print_config_prints_the_given_flags_only_and_starts_nothing(tmp_path):
    """$K3RAY_API_KEY stays out of the printed file; building the flags and printing imports no
    ray, torch or fastapi (`k3ray serve --help` stays fast)."""
    code = ("import argparse, sys; from k3ray.actors.serve import cli as serve_cli; p = argparse.ArgumentParser(); "
            "serve_cli.add_arguments(p); rc = serve_cli.main(p.parse_args(['--seed', '5', '--print-config'])); "
            "heavy = {'ray', 'torch', 'fastapi'} & set(sys.modules); assert rc == 0 and not heavy, heavy")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"K3RAY_API_KEY": "secret", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert "secret" not in run.stdout
    args = ServeArgs.model_validate(yaml.safe_load(run.stdout)["applications"][0]["args"])
    assert args.engine.seed == 5 and args.server.api_key is None


def test_host_and_proxies_are_decided_for_the_nodes():
    """A local instance and nodes sharing one loopback address keep 127.0.0.1; a joined cluster
    elsewhere binds every interface (HAProxy reaches replicas on other nodes at their address) and
    refuses a narrower host once nodes sit at several addresses; nodes sharing an address share one
    HAProxy (HeadOnly), which --proxy-location EveryNode cannot change."""
    local = LaunchSettings().on_nodes(["127.0.0.1"])
    assert (local.host, local.proxy_location) == ("127.0.0.1", "EveryNode")
    joined = LaunchSettings(address="auto")
    shared = joined.on_nodes(["127.0.0.1"] * 3)
    assert (shared.host, shared.proxy_location) == ("127.0.0.1", "HeadOnly")
    spread = joined.on_nodes(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    assert (spread.host, spread.proxy_location) == ("0.0.0.0", "EveryNode")
    assert joined.on_nodes(["10.0.0.1"]).host == "0.0.0.0"  # workers may join later
    assert LaunchSettings(address="auto", host="127.0.0.1").on_nodes(["10.0.0.1"]).host == "127.0.0.1"
    assert LaunchSettings(address="auto", proxy_location="HeadOnly").on_nodes(["10.0.0.1", "10.0.0.2"]) \
        .proxy_location == "HeadOnly"
    with pytest.raises(ValueError, match="--host 127.0.0.1 on a cluster of nodes at 2 addresses"):
        LaunchSettings(address="auto", host="127.0.0.1").on_nodes(["10.0.0.1", "10.0.0.2"])
    with pytest.raises(ValueError, match="3 nodes share 1 address"):
        LaunchSettings(address="auto", proxy_location="EveryNode").on_nodes(["127.0.0.1"] * 3)
