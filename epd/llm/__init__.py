"""LLM engine: KV block manager, scheduler, model runner, sampler, server."""
