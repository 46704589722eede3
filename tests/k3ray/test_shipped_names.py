"""A shipped checkpoint's name loads the packaged checkpoint unless a checkpoint of that name is here:
a folder of the same name without a config.json (training/k3-tiny-niah holds the training log) is
not one."""

import os

from k3ray.checkpoints import resolve_shipped, shipped_checkpoint_dir


def test_a_folder_named_like_a_shipped_checkpoint_is_not_taken_for_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "k3-tiny-niah").mkdir()
    (tmp_path / "k3-tiny-niah" / "train_log.jsonl").write_text("{}\n")
    assert resolve_shipped("k3-tiny-niah") == shipped_checkpoint_dir("k3-tiny-niah")
    (tmp_path / "k3-tiny-niah" / "config.json").write_text("{}")
    assert resolve_shipped("k3-tiny-niah") == "k3-tiny-niah"  # a checkpoint here: the user's own
    assert resolve_shipped(os.fspath(tmp_path)) == os.fspath(tmp_path)
