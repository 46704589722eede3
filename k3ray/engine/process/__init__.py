"""The engine in a process of its own (EngineCore) and its client in the server's event loop."""
