"""The proxy: the single OpenAI-compatible front door (node registry, routing, E -> LLM relay)."""
