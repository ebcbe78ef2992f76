import os

os.environ.setdefault("MPLBACKEND", "Agg")

from support.real_vllm import real_vllm_model, real_vllm_server  # noqa: E402, F401  (session fixtures of the real-vLLM tests)
from support.sglang_server import real_sglang_model, real_sglang_server  # noqa: E402, F401  (the real-SGLang tests')
