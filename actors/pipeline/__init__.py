"""The model on Ray actors: pipeline stages, expert shards, the MoE router that sends latent rows to
them, the vision encoder, the wire format between them, and the runner that drives one replica's
actors step by step and recovers them after a fault."""
