"""Engine integrations of lmcache-mp.

`connector_core` holds the engine-agnostic connector logic (no engine imports);
`lmcache_mp.integration.vllm` adapts it to vLLM's V1 KV-connector interface and is the only
module here that imports vLLM.
"""
