"""What vLLM speaks, read and written exactly as vLLM 0.32 does — no routing decision lives here.

- ``block_hash``: the prefix-cache block keys vLLM computes from a request's tokens;
- ``kv_events``: the KV-cache event wire (ZMQ frames, the msgpack batch, tolerant decoding);
- ``metrics_text``: an engine's Prometheus ``/metrics`` page → :class:`~routerd.snapshot.LoadSnapshot`.

Routing, the simulated engine and the launcher plugins all import these from here, so the simulator
speaks the very format routerd reads.
"""
