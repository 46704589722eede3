"""Media in prompts: user-facing inputs -> processed media, placeholder spans and their embeddings."""
