"""The cluster and serving benchmarks: `k3ray bench cluster` (the pipeline's actors decoded on a Ray
cluster, static and rebalanced) here, `k3ray bench serve` and `soak` (a Serve app under load) in serve/."""
