"""The Ray Serve deployment: the K3Server replica, `k3ray serve` (settings, flags, launch, stop),
HAProxy ingress and request routing by prefix affinity, LLM autoscaling signals and metrics."""
