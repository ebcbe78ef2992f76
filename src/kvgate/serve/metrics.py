"""``/metrics``: vLLM's Prometheus families (and SGLang's with ``--engine sglang``; their names are the dialects',
:mod:`kvgate.http.dialect`), read from the served engine at scrape time (nothing on the request path), with vLLM's
labels; kvgate's clock and lag beside them."""

from __future__ import annotations

from collections.abc import Iterator

from aiohttp import web
from prometheus_client.core import Metric

from kvgate.http.dialect import SGLANG, VLLM
from kvgate.http.prometheus import ScrapeCollector, counter, exposition, gauge, new_registry
from kvgate.serve.served import ServedEngine


class EngineCollector(ScrapeCollector):
    """The served engine's families, computed when scraped."""

    def __init__(self, served: ServedEngine) -> None:
        self.served = served

    def collect(self) -> Iterator[Metric]:
        s = self.served
        eng = s.engine
        lp = s.loop
        vl = {"model_name": s.model, "engine": "0"}
        running, waiting = s.queue_lengths()
        st = eng.stats
        vm, sm = VLLM.metrics, SGLANG.metrics
        yield gauge(vm.running, "Number of requests in model execution batches.", running, vl)
        yield gauge(vm.waiting, "Number of requests waiting to be processed.", waiting, vl)
        yield gauge(vm.kv_usage[0], "KV-cache usage. 1 means 100 percent usage.", eng.usage(), vl)
        yield counter(vm.prefix_queries, "Prefix cache queries, in terms of number of queried tokens.", st.queries, vl)
        yield counter(vm.prefix_hits, "Prefix cache hits, in terms of number of cached tokens.", st.hits, vl)
        yield counter(vm.preemptions, "Cumulative number of preemption from the engine.", st.preemptions, vl)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lp.prompt_tokens, vl)
        gen = lp.generation_done + sum(t.req.generated for t in lp.active)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", gen, vl)
        yield counter("vllm:request_success", "Count of successfully processed requests.", lp.finished,
                      {**vl, "finished_reason": "length"})
        yield gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0,
                    {**vl, **s.cache_config})
        if s.cfg.engine == "sglang":
            sl = {"model_name": s.model}
            yield gauge(sm.running, "The number of running requests.", running, sl)
            yield gauge(sm.waiting, "The number of requests in the waiting queue.", waiting, sl)
            yield gauge(sm.kv_usage[0], "The token usage.", eng.usage(), sl)
            yield gauge(sm.hit_rate, "The prefix cache hit rate.", st.hits / st.queries if st.queries else 0.0, sl)
        yield gauge("kvgate:virtual_time_seconds", "The engine's virtual clock.", lp.vt)
        yield gauge("kvgate:time_scale", "Virtual seconds per real second.", lp.scale)
        yield gauge("kvgate:engine_lag_seconds", "Virtual seconds the engine was behind the clock at its last "
                    "step (0 when on time).", lp.lag)
        yield gauge("kvgate:engine_lag_max_seconds", "Largest engine lag so far (virtual seconds).", lp.lag_max)


class MetricsRoute:
    """``GET /metrics`` over a registry holding :class:`EngineCollector` alone."""

    def __init__(self, served: ServedEngine) -> None:
        self.registry = new_registry(EngineCollector(served))

    async def metrics(self, _request: web.Request) -> web.StreamResponse:
        body, content_type = exposition(self.registry)
        return web.Response(body=body, headers={"Content-Type": content_type})
