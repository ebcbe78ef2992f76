"""A STAND-IN for ``sgl_kernel``, SGLang's compiled kernel package, for running SGLang's CPU engine without it.

This is not SGLang's code and not sgl-kernel: it is kvgate's pure-torch replacement for the few helpers that
SGLang 0.5.23 imports from ``sgl_kernel`` at load time when ``SGLANG_USE_CPU_ENGINE=1`` (PyPI has no CPU build of
sgl-kernel: ``sgl-kernel`` 0.3.21 is a CUDA-only wheel). ``.ci/install-sglang.sh`` copies this directory into
SGLang's venv as the top-level package ``sgl_kernel``, only where no real ``sgl_kernel`` is installed.

What it replaces (the semantics of SGLang's own Triton kernels of the same purpose, written again in torch):

* ``assign_req_to_token_pool_cpu``: writes each request's newly allocated KV slots into its row of the
  request-to-token table (``mem_cache/allocation.py``).

What it does not replace: every other op of ``torch.ops.sgl_kernel`` (the AMX GEMMs, fused MoE, rmsnorm, rotary,
the shared-memory all-reduce, ...). They are absent, and SGLang then takes its plain-torch ``forward_native``
paths (it checks ``torch.ops.sgl_kernel.convert_weight_packed``), so the model math is SGLang's reference torch
code, not its CPU kernels: timings are not those of a Xeon deployment. The cache, the scheduler, retraction and
the API are SGLang's own code. The helpers of speculative decoding and of moving KV between slots
(``copy_all_layer_kv_cache_cpu``, ``build_tree_kernel_efficient_cpu``, ...) are present so that the imports
succeed, and raise if called.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KVGATE_STANDIN = True
"""Marks this package as kvgate's stand-in (the install script and the server launcher look for it)."""

__version__ = "0.0.0+kvgate.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = `` the i-th run of ``out_cache_loc``.

    The runs of ``out_cache_loc`` are consecutive, one per request in batch order, each ``end - start`` long."""
    del pool_len  # the row length; torch indexing knows it
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += max(n, 0)


def _not_replaced(name: str, used_by: str) -> Callable[..., None]:
    def helper(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"kvgate's sgl_kernel stand-in does not implement {name} ({used_by})")

    helper.__name__ = helper.__qualname__ = name
    helper.__doc__ = f"Not replaced: imported by SGLang at load on CPU, used only by {used_by}; raises if called."
    return helper


# Imported at load by SGLang's CPU paths, never called when serving without speculative decoding:
copy_all_layer_kv_cache_cpu = _not_replaced("copy_all_layer_kv_cache_cpu", "KV slot moves (speculative decoding)")
build_tree_kernel_efficient_cpu = _not_replaced("build_tree_kernel_efficient_cpu", "speculative decoding")
verify_tree_greedy_cpu = _not_replaced("verify_tree_greedy_cpu", "speculative decoding")
fill_accept_out_cache_loc_cpu = _not_replaced("fill_accept_out_cache_loc_cpu", "speculative decoding")
fill_bonus_tokens_cpu = _not_replaced("fill_bonus_tokens_cpu", "speculative decoding")
rotate_input_ids_cpu = _not_replaced("rotate_input_ids_cpu", "multi-layer EAGLE")
build_draft_decode_metadata_cpu = _not_replaced("build_draft_decode_metadata_cpu", "the AMX attention backend")
assign_draft_cache_locs_contiguous_cpu = _not_replaced("assign_draft_cache_locs_contiguous_cpu", "speculative decoding")
assign_extend_cache_locs_cpu = _not_replaced("assign_extend_cache_locs_cpu", "speculative decoding")
