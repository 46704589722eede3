"""`k3ray bench serve`: load generation, SSE latency measurement and vLLM-style serving metrics
against an OpenAI-compatible server, next to the same requests on the in-process engine."""
