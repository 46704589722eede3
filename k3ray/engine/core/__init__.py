"""The scheduler and its caches: sequences, paged latent blocks, recurrent-state slots, the prefix cache."""
