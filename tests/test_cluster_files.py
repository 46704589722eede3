"""The launch files in cluster/ parse, and their names and resources agree with the code."""

import pathlib
import re
import shlex

import pytest
import ray
import yaml

from k3ray.capacity import PlanRequest, build_plan, problems
from k3ray.cli import build_parser
from k3ray.config import k3_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def serve_app(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def test_every_yaml_parses():
    files = sorted(CLUSTER.rglob("*.yaml"))
    assert {f.name for f in files} >= {"ray-cluster.yaml", "serve-config.yaml", "rayservice.yaml", "rayjob-eval.yaml"}
    for f in files:
        assert yaml.safe_load(f.read_text()), f


def test_serve_configs_name_the_real_app_and_valid_args():
    from k3ray.actors.serve.app import build_app
    from k3ray.actors.serve.config import ServeArgs

    service = yaml.safe_load(load("kuberay/rayservice.yaml")["spec"]["serveConfigV2"])
    for config in (load("serve-config.yaml"), service):
        app = serve_app(config)
        module, attr = app["import_path"].split(":")
        assert module == "k3ray.actors.serve.app" and attr == "build_app" and callable(build_app)
        ServeArgs.model_validate(app["args"])  # unknown or bad keys raise
    assert load("serve-config.yaml")["http_options"]["host"] == "127.0.0.1"  # local default: loopback only


def documented_command(config: str) -> list[str]:
    """The `k3ray serve ... --print-config` a generated Serve config names in its header."""
    lines = config.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#   k3ray serve "))
    words = []
    for line in lines[start:]:
        words += shlex.split(line.removeprefix("#").removesuffix("\\"))
        if not line.endswith("\\"):
            break
    assert words[:2] == ["k3ray", "serve"] and words[-1] == "--print-config", words
    return words[1:]


@pytest.mark.parametrize("source", ["serve-config.yaml", "kuberay/rayservice.yaml"])
def test_serve_configs_are_what_their_command_prints(source, capsys, monkeypatch):
    """Neither file drifts from the settings: each is the output of the command it names."""
    monkeypatch.setenv("K3RAY_API_KEY", "never-printed")
    text = (CLUSTER / source).read_text()
    if source.endswith("rayservice.yaml"):
        text = yaml.safe_load(text)["spec"]["serveConfigV2"]
    argv = documented_command(text)
    args = build_parser(argv).parse_args(argv)
    assert args._module.main(args) == 0
    assert capsys.readouterr().out == text


def test_rayservice_gpus_fit_the_planned_layout():
    from k3ray.actors.pipeline.executor import actor_bundles
    from k3ray.actors.serve.config import ServeArgs

    spec = load("kuberay/rayservice.yaml")["spec"]
    args = ServeArgs.model_validate(serve_app(yaml.safe_load(spec["serveConfigV2"]))["args"])
    bundles, roles = actor_bundles(k3_config(), args.parallel_config())
    needed = sum(b.get("GPU", 0) for b in bundles) * args.autoscaling.max_replicas
    groups = spec["rayClusterConfig"]["workerGroupSpecs"]
    per_pod = [int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) for g in groups]
    available = sum(n * g["minReplicas"] for n, g in zip(per_pod, groups))
    assert needed == 15 and needed <= available
    assert all(b.get("GPU", 0) <= max(per_pod) for b in bundles)
    plan = build_plan(PlanRequest(k3_config(), "H200", args.engine.max_model_len, args.engine.max_num_seqs),
                      args.parallel.pipeline, args.parallel.expert_parallel)
    assert not problems(plan), problems(plan)
    assert plan.num_devices == needed


def test_images_versions_and_wheel_install_agree():
    docker = (CLUSTER / "Dockerfile").read_text()
    base = re.search(r"^FROM rayproject/ray:([\d.]+)-", docker, re.M).group(1)
    assert base == ray.__version__
    assert re.search(r"pip install .*k3ray-\*\.whl", docker) and not re.search(r"^COPY \. ", docker, re.M)
    # every node of an image-built cluster starts Serve with k3ray serve's default ingress
    from k3ray.actors.serve.config import DEFAULT_INGRESS

    assert DEFAULT_INGRESS == "haproxy"
    images = set()
    for name in ("kuberay/rayservice.yaml", "kuberay/rayjob-eval.yaml"):
        text = (CLUSTER / name).read_text()
        images |= set(re.findall(r"image: (\S+)", text))
        assert re.search(r'rayVersion: "([\d.]+)"', text).group(1) == ray.__version__
    images.add(load("ray-cluster.yaml")["docker"]["image"])
    assert images == {f"k3ray:{VERSION}"}
    for f in CLUSTER.rglob("*"):
        if f.is_file():
            assert not re.search(r"^\s*working_dir\s*:", f.read_text(), re.M), f"{f} sets a working_dir"


def dockerfile_environment() -> dict[str, str]:
    """NAME -> value of the Dockerfile's ENV instructions (continued lines joined)."""
    text = (CLUSTER / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        env |= dict(word.split("=", 1) for word in shlex.split(line))
    return env


def test_the_image_sets_the_node_settings_k3ray_cluster_env_prints():
    """One source: the image's node environment is node_environment()'s, the wrapper's path where the
    image installs it; no other Serve variable is set there."""
    from k3ray.actors.cluster.node_environment import HAPROXY_BINARY, node_environment

    image = {name: value for name, value in dockerfile_environment().items() if name.startswith("RAY_")}
    source = node_environment("haproxy", environ={})
    assert image.keys() == source.keys()
    assert {n: v for n, v in image.items() if n != HAPROXY_BINARY} == \
        {n: v for n, v in source.items() if n != HAPROXY_BINARY}
    # the Ray image's Python, where the wheel's console scripts go; the build checks it is executable
    assert image[HAPROXY_BINARY] == "/home/ray/anaconda3/bin/k3ray-haproxy"
    assert re.search(r'^RUN test -x "\$RAY_SERVE_HAPROXY_BINARY_PATH"', (CLUSTER / "Dockerfile").read_text(), re.M)


def test_cluster_files_take_the_node_settings_from_the_image():
    """Every node of ray-cluster.yaml and the KubeRay manifests runs the k3ray image (checked above)
    and sets no Serve variable of its own (`ray start` env, a container's env), which could differ."""
    for f in [CLUSTER / "ray-cluster.yaml", *sorted((CLUSTER / "kuberay").glob("*.yaml"))]:
        text = f.read_text()
        assigned = re.findall(r"\b(RAY_SERVE_\w+)=", text) + re.findall(r"name: (RAY_SERVE_\w+)", text)
        assert not assigned, f"{f.name} sets {assigned}: the image holds the node settings (k3ray cluster env)"


def test_ray_cluster_yaml_has_room_for_the_documented_layout():
    c = load("ray-cluster.yaml")
    gpu_nodes = [t for t in c["available_node_types"].values() if t["resources"].get("GPU")]
    assert sum(t["resources"]["GPU"] * t["min_workers"] for t in gpu_nodes) >= 15
    assert c["head_node_type"] in c["available_node_types"]


@pytest.mark.parametrize("source", ["kuberay/rayjob-eval.yaml"])
def test_job_entrypoint_parses_with_the_cli(source):
    argv = shlex.split(load(source)["spec"]["entrypoint"])
    assert argv[0] == "k3ray"
    args = build_parser(argv[1:]).parse_args(argv[1:])
    assert args.command == "eval"
