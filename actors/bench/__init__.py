"""`k3ray bench cluster`: the pipeline's actors decoded on a Ray cluster, static and rebalanced."""
