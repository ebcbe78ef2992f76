"""A real vLLM (the CPU build) in the loop: a tiny local model and a managed OpenAI server, for tests and runs.

* :mod:`kvgate.realvllm.model` builds a tiny random-weight Llama and a word-level ChatML tokenizer locally
  (seeded, no model hub) into a cache directory and reports its KV bytes per token.
* :mod:`kvgate.realvllm.server` starts and stops ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1
  with a KV pool given in tokens.
* :mod:`kvgate.realvllm.command` is ``kvgate real-vllm build-model | serve``.

Nothing here imports vLLM, torch or transformers at import time: kvgate imports without them.
"""
