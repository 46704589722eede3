"""k3ray's lm-eval task module: k3ray_niah counts tokens with the tokenizer of the checkpoint that
`pretrained` names, a shipped name or the default tiny K3's included."""

import importlib.util
from importlib import resources

from k3ray import default_model
from k3ray.checkpoints import shipped_checkpoint_dir


def _tasks_module():
    path = resources.files("k3ray.evals") / "lm_eval_tasks" / "k3ray_tasks.py"
    spec = importlib.util.spec_from_file_location("k3ray_tasks", str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_niah_counts_with_the_tokenizer_of_a_named_checkpoint(monkeypatch):
    tasks = _tasks_module()
    assert tasks.counting_target(pretrained="k3-tiny-niah").name == shipped_checkpoint_dir("k3-tiny-niah")
    niah = shipped_checkpoint_dir("k3-tiny-niah")  # stands in for the default, which is written on first use
    monkeypatch.setattr(default_model, "default_checkpoint_dir", lambda: niah)
    assert tasks.counting_target(pretrained=default_model.DEFAULT_NAME).name == niah
    assert tasks.counting_target().name == niah
