"""The engine process ends with the process that started it (a replica), even while it builds the
engine or runs a step and so does not read its socket: a killed replica leaves no engine behind."""

import subprocess
import sys
import time

import psutil

PARENT = """
import functools, threading, time
from k3ray.engine.process.engine_client import EngineClient
# the factory sleeps: the engine process is busy 'building', never reading its socket
threading.Thread(target=EngineClient.start, args=(functools.partial(time.sleep, 600),), daemon=True).start()
time.sleep(600)
"""


def test_the_engine_process_exits_after_its_parents_death(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=tmp_path)
    engines: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while not (engines := [c for c in psutil.Process(parent.pid).children()
                               if "engine_core_proc" in " ".join(c.cmdline())]):
            assert time.monotonic() < deadline and parent.poll() is None, "no engine process started"
            time.sleep(0.1)
        time.sleep(1.0)  # the engine process is inside its factory
        parent.kill()
        parent.wait(timeout=30)
        _, alive = psutil.wait_procs(engines, timeout=60)  # generous: that it exits, not how fast
        assert not alive, "the engine process outlived its parent"
    finally:
        parent.kill()
        for engine in engines:
            if engine.is_running():
                engine.kill()
