"""``/metrics``: vLLM's Prometheus families (and SGLang's with ``--engine sglang``), read from the served engine
at scrape time (nothing on the request path), with vLLM's names and labels; kvgate's clock and lag beside them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvgate.serve.served import ServedEngine

Family = type[GaugeMetricFamily] | type[CounterMetricFamily]


def _one(kind: Family, name: str, doc: str, labels: Mapping[str, str], value: float) -> Metric:
    """A family of one sample with ``labels`` (name -> value)."""
    m = kind(name, doc, labels=list(labels))
    m.add_metric(list(labels.values()), value)
    return m


class EngineCollector:
    """The served engine's families, computed when scraped."""

    def __init__(self, served: ServedEngine) -> None:
        self.served = served

    def describe(self) -> list[Metric]:
        return []  # nothing ahead of a scrape (the registry does not auto-describe)

    def collect(self) -> Iterator[Metric]:
        s = self.served
        eng = s.engine
        lp = s.loop
        lv = {"model_name": s.model, "engine": "0"}
        running, waiting = s.queue_lengths()
        st = eng.stats
        G, C = GaugeMetricFamily, CounterMetricFamily
        yield _one(G, "vllm:num_requests_running", "Number of requests in model execution batches.", lv, running)
        yield _one(G, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", lv, waiting)
        yield _one(G, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lv, eng.usage())
        yield _one(C, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", lv,
                   st.queries)  # fmt: skip
        yield _one(C, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", lv, st.hits)
        yield _one(C, "vllm:num_preemptions", "Cumulative number of preemption from the engine.", lv, st.preemptions)
        yield _one(C, "vllm:prompt_tokens", "Number of prefill tokens processed.", lv, lp.prompt_tokens)
        gen = lp.generation_done + sum(t.req.generated for t in lp.active)
        yield _one(C, "vllm:generation_tokens", "Number of generation tokens processed.", lv, gen)
        yield _one(C, "vllm:request_success", "Count of successfully processed requests.",
                   {**lv, "finished_reason": "length"}, lp.finished)  # fmt: skip
        yield _one(G, "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", {**lv, **s.cache_config},
                   1.0)  # fmt: skip
        if s.cfg.engine == "sglang":
            sl = {"model_name": s.model}
            yield _one(G, "sglang:num_running_reqs", "The number of running requests.", sl, running)
            yield _one(G, "sglang:num_queue_reqs", "The number of requests in the waiting queue.", sl, waiting)
            yield _one(G, "sglang:token_usage", "The token usage.", sl, eng.usage())
            yield _one(G, "sglang:cache_hit_rate", "The prefix cache hit rate.", sl,
                       st.hits / st.queries if st.queries else 0.0)  # fmt: skip
        yield G("kvgate:virtual_time_seconds", "The engine's virtual clock.", value=lp.vt)
        yield G("kvgate:time_scale", "Virtual seconds per real second.", value=lp.scale)
        yield G("kvgate:engine_lag_seconds", "Virtual seconds the engine was behind the clock at its last step "
                "(0 when on time).", value=lp.lag)  # fmt: skip
        yield G("kvgate:engine_lag_max_seconds", "Largest engine lag so far (virtual seconds).", value=lp.lag_max)


class MetricsRoute:
    """``GET /metrics`` over a registry holding :class:`EngineCollector` alone."""

    def __init__(self, served: ServedEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(served))  # type: ignore[arg-type]

    async def metrics(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
