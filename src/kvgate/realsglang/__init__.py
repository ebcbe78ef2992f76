"""A real SGLang (0.5.23, CPU) in the loop: its venv, a managed server on kvgate's tiny model, its experiment page.

SGLang's pins conflict with the vLLM in kvgate's own environment, so SGLang lives in a venv of its own
(``.ci/install-sglang.sh``) and kvgate runs it as a subprocess:

* :mod:`kvgate.realsglang.env` finds that venv and says why SGLang is unusable when it is;
* :mod:`kvgate.realsglang.server` starts and stops ``python -m sglang.launch_server`` on 127.0.0.1 (CPU engine,
  torch-native attention) with a KV pool given in tokens, on the tiny model of :mod:`kvgate.realvllm.model`;
* ``standin/sgl_kernel`` is kvgate's pure-torch stand-in for the few ``sgl_kernel`` helpers SGLang's CPU engine
  imports (its docstring says what it replaces and what not); the install script copies it into the venv.

Nothing here imports SGLang, torch or transformers: kvgate imports without them.
"""
