"""The engines' own prefix caches, as their KV-cache events tell them — the truth beside routing's model.

- ``subscriber``: one rank's ZMQ event stream, decoded in order, with what was missed replayed;
- ``blocks``: one engine's cached blocks as counted from its events (:class:`~.blocks.EngineBlocks`);
- ``subscriptions``: one subscription per ready engine and rank, kept in step with the registry;
- ``block_keys``: the block keys an engine will compute for a request (its tokenizer, its chat template);
- ``keying_process``: keying long prompts in a process of their own, so the event loop never waits.

The router reads it only through :class:`~.blocks.EngineCacheSource`; vLLM's formats come from
:mod:`routerd.vllm_wire`.
"""
