"""The training program (training/k3ray_training) is not installed: its tests import it from the
checkout's training/ folder, which goes on sys.path here (only that folder: the repo root on the
path would let the checkout's folders shadow the installed k3ray)."""

import pathlib
import sys

TRAINING = pathlib.Path(__file__).resolve().parents[2] / "training"
if str(TRAINING) not in sys.path:
    sys.path.insert(0, str(TRAINING))
