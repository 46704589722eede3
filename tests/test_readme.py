"""The README runs as written: its bash and python blocks, in order, from a scratch folder with the
venv's commands on PATH (what `source .venv/bin/activate` gives), against a `k3ray serve` started
where the README starts it and stopped with Ctrl-C at the end.

Documented tables bend it to a test machine: `smaller` shrinks the one hour-long run and moves the
server off port 8000 (another server may hold it), SERVER_LIMITS gives that server a test-sized
replica; SKIPPED names what cannot run here (the install this test runs inside, the suite it is
part of, a GPU cluster); SLOW lists the benchmarks that take minutes each, run by `pytest -m slow`."""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SERVER = "k3ray serve"  # the README's own server: started in the background, stopped at the end
SERVER_LIMITS = "--num-cpus 4 --max-model-len 8192 --cache-memory-mb 128"  # a test-sized replica
SKIPPED = {  # the start of a command -> why it does not run here
    "python3 -m venv": "the install itself: this test runs inside it",
    "pytest": "the whole test suite, which this test is part of",
    "k3ray serve --address auto": "needs a GPU cluster holding the published checkpoint",
    'eval "$(k3ray cluster env)" && ray start': "starts a cluster node; tests/actors/test_cluster_nodes.py starts such nodes",
    "k3ray cluster check --address auto": "joins the cluster of this machine; tests/actors/test_cluster_nodes.py runs it",
    "k3ray status --address auto": "reads the cluster of this machine; tests/actors/test_cluster_nodes.py runs it",
    "k3ray bench compile": "needs TRITON_INTERPRET unset, which this suite sets; tests/kernels/test_offline_compile.py runs it",
}
SLOW = ("k3ray bench kernels", "k3ray bench engine", "k3ray bench cluster", "k3ray bench serve")


def smaller(port: int) -> dict[str, str]:
    """README text -> what runs here."""
    return {
        "127.0.0.1:8000": f"127.0.0.1:{port}",
        # the 1,048,576-token cell takes an hour on 2 cores: the same command at 1k
        "--lengths 1m --depths 50 --reserve-generation --max-model-len 1048576":
            "--lengths 1k --depths 50 --reserve-generation --max-model-len 2048",
        # the trained checkpoint's table: 90 prompts a task; here 6 (test_the_eval_commands_reproduce_their_tables
        # holds the commands as written to the table)
        "--lengths 1k,2k,4k --depths 0,50,100 --samples 10": "--lengths 1k,2k --depths 0,50,100 --samples 1",
        # k3-tiny-vl's table: 108 prompts; here one depth and sample a length
        "--depths 0,50,100 --samples 4": "--depths 50 --samples 1",
        "--depths 0,50,100 \\\n  --samples 4": "--depths 50 --samples 1",
    }


def blocks() -> list[tuple[str, str]]:
    """(language, code) of every bash and python block, in README order."""
    return re.findall(r"^```(bash|python)\n(.*?)^```", README.read_text(), re.S | re.M)


def commands(code: str) -> list[str]:
    """The bash block's commands, a backslash-continued command as one."""
    return [c.strip() for c in re.split(r"(?<!\\)\n", code) if c.strip() and not c.strip().startswith("#")]


def test_the_readme_has_no_placeholders():
    text = README.read_text()
    for _, code in blocks():
        assert "..." not in code and "path/to" not in code and " DIR " not in code, code
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
                  "/tokenizer_info", "/metrics", "/health"):
        assert f"`{route}`" in text or f"{route}`" in text, f"route {route} is not documented"
    assert (ROOT / "docs" / "design.md").is_file() and "(docs/design.md)" in text


def test_every_shrinking_finds_its_readme_text():
    """A rewrapped README command would otherwise run at full size (the 1M cell: an hour)."""
    text = README.read_text()
    assert all(original in text for original in smaller(0)), [o for o in smaller(0) if o not in text]


def test_the_eval_commands_reproduce_their_tables():
    """A results table's heading names its depths, samples and seed, its columns the lengths: the
    `k3ray eval` commands of the bash block before it ask for exactly those."""
    from k3ray.cli import build_parser
    from k3ray.evals.cli import parse_depths, parse_lengths

    text = README.read_text()
    tables = list(re.finditer(r"^\| exact match, (\d+) depths x (\d+) samples, seed (\d+) \|(.*)\|$", text, re.M))
    assert tables, "the README's results table is gone"
    for table in tables:
        depths, samples, seed = (int(table.group(i)) for i in (1, 2, 3))
        lengths = {int(c.strip()[:-1]) * 1024 for c in table.group(4).split("|")}
        code = blocks_before(text, table.start())[-1]
        evals = [c for c in commands(code) if c.startswith("k3ray eval")]
        assert evals, f"no k3ray eval command before the table {table.group(0)!r}"
        for command in evals:
            argv = command.replace("\\\n", " ").split()[1:]
            args = build_parser(argv).parse_args(argv)
            assert (len(parse_depths(args.depths)), args.samples, args.seed) == (depths, samples, seed), command
            assert set(parse_lengths(args.lengths)) == lengths, command


def blocks_before(text: str, end: int) -> list[str]:
    return [code for _, code in re.findall(r"^```(bash|python)\n(.*?)^```", text[:end], re.S | re.M)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    """Runs the README's commands in `workdir` (where `.venv` points at the venv running this test)."""

    def __init__(self, workdir: Path, port: int):
        self.workdir, self.port = workdir, port
        venv = Path(sys.prefix)  # the checkout's .venv in CI; any venv k3ray is installed in elsewhere
        (workdir / ".venv").symlink_to(venv)
        self.env = {**os.environ, "PATH": str(venv / "bin") + os.pathsep + os.environ["PATH"],
                    "VIRTUAL_ENV": str(venv)}
        self.env.pop("PYTHONPATH", None)
        self.server: subprocess.Popen | None = None
        self.ran: list[str] = []

    def bash(self, command: str, timeout: float = 600) -> str:
        run = subprocess.run(["bash", "-c", f"set -eo pipefail\n{command}"], cwd=self.workdir, env=self.env,
                             capture_output=True, text=True, timeout=timeout)
        assert run.returncode == 0, f"{command}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        if command.startswith("curl"):
            assert run.stdout.strip() and '"error"' not in run.stdout, f"{command}\n{run.stdout[:2000]}"
        self.ran.append(command)
        return run.stdout

    def python(self, code: str) -> str:
        script = self.workdir / f"snippet_{len(self.ran)}.py"
        script.write_text(code)
        run = subprocess.run([sys.executable, str(script)], cwd=self.workdir, env=self.env, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, f"{code}\n{run.stderr[-3000:]}"
        self.ran.append(code)
        return run.stdout

    def start_server(self, wait_until_serving) -> None:
        log = open(self.workdir / "serve.log", "w")
        self.server = subprocess.Popen(["bash", "-c", f"exec {SERVER} --port {self.port} {SERVER_LIMITS}"],
                                       cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        wait_until_serving(self.server, f"http://127.0.0.1:{self.port}", self.workdir / "serve.log", timeout_s=420)
        self.ran.append(SERVER)

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGINT)  # the README's Ctrl-C
            try:
                assert self.server.wait(timeout=180) == 0, (self.workdir / "serve.log").read_text()[-3000:]
            finally:
                if self.server.poll() is None:
                    self.server.kill()


def run_readme(runner: Runner, slow: bool, wait_until_serving=None) -> None:
    table = smaller(runner.port)
    for language, code in blocks():
        for text, replacement in table.items():
            code = code.replace(text, replacement)
        if language == "python":
            if not slow:
                runner.python(code)
            continue
        for command in commands(code):
            if any(command.startswith(start) for start in SKIPPED):
                continue
            if command.startswith(SLOW) != slow:
                continue
            if command == SERVER:
                runner.start_server(wait_until_serving)
            else:
                runner.bash(command)


@pytest.mark.timeout(900)
def test_every_readme_command_runs(tmp_path, wait_until_serving):
    """The setup's second command, the server, its routes, the in-process commands, the evals against
    the server and in process, the Python snippets: each exits 0 as written (after SMALLER)."""
    runner = Runner(tmp_path, free_port())
    try:
        run_readme(runner, slow=False, wait_until_serving=wait_until_serving)
    finally:
        runner.stop_server()
    assert SERVER in runner.ran and any(c.startswith("k3ray eval mm") for c in runner.ran)
    assert (tmp_path / "runs" / "niah" / "summary.json").is_file()
    assert (tmp_path / "out" / "layer.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_readme_benchmarks_run(tmp_path):
    runner = Runner(tmp_path, free_port())
    run_readme(runner, slow=True)
    assert len(runner.ran) == len(SLOW)
