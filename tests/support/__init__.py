"""What the tests share: fakes, ports, asyncio helpers, the reference pool and the vLLM oracles."""
