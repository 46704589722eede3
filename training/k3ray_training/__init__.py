"""The retrieval-trained fixture model `k3-tiny-niah`: its config, a differentiable training
forward over k3ray's own modules, generated RULER-format training data, the training loop and
the export to K3's checkpoint format (`python -m k3ray_training.train`)."""
