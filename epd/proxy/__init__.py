"""The proxy: the single OpenAI-compatible front door.

Modules: `config` (ProxyConfig, roles, strategies, modes), `registry` (nodes, health),
`routing` (per-role strategies), `orchestrator` (E stage: images -> encoder_result, lease
release), `relay` (forward to a node, SSE relay, failure mapping), `pd` (P -> D: prefill
only, then decode with the migration_request), `metrics`, `server` (the app, `epd proxy`).

Paths: text -> llm; image -> E -> llm; PD mode: text -> P -> D; image -> E -> P -> D.
"""
