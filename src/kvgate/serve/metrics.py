"""``/metrics``: vLLM's Prometheus families (and SGLang's with ``--engine sglang``), read from the served engine
at scrape time (nothing on the request path), with vLLM's names and labels; kvgate's clock and lag beside them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvgate.serve.served import ServedEngine

# NOTE: the gateway's collector has the same skeleton; http/prometheus (ScrapeCollector, gauge, counter,
# new_registry, exposition) is its shared form, which this module uses once it is on main.


def _family(kind: type[Metric], name: str, doc: str, value: float, labels: Mapping[str, str] | None) -> Metric:
    """A family of one sample, with ``labels`` (name -> value) if given."""
    if not labels:
        return kind(name, doc, value=value)  # type: ignore[call-arg]
    m = kind(name, doc, labels=list(labels))  # type: ignore[call-arg]
    m.add_metric(list(labels.values()), value)  # type: ignore[attr-defined]
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
        vl = {"model_name": s.model, "engine": "0"}
        running, waiting = s.queue_lengths()
        st = eng.stats
        G, C = GaugeMetricFamily, CounterMetricFamily
        yield _family(G, "vllm:num_requests_running", "Number of requests in model execution batches.", running, vl)
        yield _family(G, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting, vl)
        yield _family(G, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.usage(), vl)
        yield _family(C, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      st.queries, vl)  # fmt: skip
        yield _family(C, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", st.hits,
                      vl)  # fmt: skip
        yield _family(C, "vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.preemptions,
                      vl)  # fmt: skip
        yield _family(C, "vllm:prompt_tokens", "Number of prefill tokens processed.", lp.prompt_tokens, vl)
        gen = lp.generation_done + sum(t.req.generated for t in lp.active)
        yield _family(C, "vllm:generation_tokens", "Number of generation tokens processed.", gen, vl)
        yield _family(C, "vllm:request_success", "Count of successfully processed requests.", lp.finished,
                      {**vl, "finished_reason": "length"})  # fmt: skip
        yield _family(G, "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0,
                      {**vl, **s.cache_config})  # fmt: skip
        if s.cfg.engine == "sglang":
            sl = {"model_name": s.model}
            yield _family(G, "sglang:num_running_reqs", "The number of running requests.", running, sl)
            yield _family(G, "sglang:num_queue_reqs", "The number of requests in the waiting queue.", waiting, sl)
            yield _family(G, "sglang:token_usage", "The token usage.", eng.usage(), sl)
            yield _family(G, "sglang:cache_hit_rate", "The prefix cache hit rate.",
                          st.hits / st.queries if st.queries else 0.0, sl)  # fmt: skip
        yield _family(G, "kvgate:virtual_time_seconds", "The engine's virtual clock.", lp.vt, None)
        yield _family(G, "kvgate:time_scale", "Virtual seconds per real second.", lp.scale, None)
        yield _family(G, "kvgate:engine_lag_seconds", "Virtual seconds the engine was behind the clock at its last "
                      "step (0 when on time).", lp.lag, None)  # fmt: skip
        yield _family(G, "kvgate:engine_lag_max_seconds", "Largest engine lag so far (virtual seconds).", lp.lag_max,
                      None)  # fmt: skip


class MetricsRoute:
    """``GET /metrics`` over a registry holding :class:`EngineCollector` alone."""

    def __init__(self, served: ServedEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(served))  # type: ignore[arg-type]

    async def metrics(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
