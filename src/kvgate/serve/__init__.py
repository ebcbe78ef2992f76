"""``kvgate engine``: the simulated engine served over HTTP in scaled real time, with vLLM's API surface.

Theory of operation. One asyncio task (:class:`~kvgate.serve.loop.EngineLoop`) owns the simulated engine (the
same :class:`~kvgate.engine.vllm.VllmEngine` or :class:`~kvgate.engine.sglang.SglangEngine` the in-process
simulator drives) and keeps its virtual clock at ``time_scale`` times the real one::

    HTTP handler ──parse, tokenize──▶ ContentBridge ──SeqKey──▶ Request ──eng.add──▶ ┐
         ▲                                                                          │ engine loop:
         │ first token, progress, finish: set the turn's event                      │  step(now, now + slice)
         └────────────────────────────────────────────────────────────────────────── │  sleep duration / scale
                                                                                    ┘  deliver what happened

The package, by responsibility:

* :mod:`~kvgate.serve.config`: :class:`ServerConfig` (the engine's :class:`~kvgate.engine.factory.EngineConfig`
  plus what serving adds) and the engine it builds;
* :mod:`~kvgate.serve.bridge`: the content bridge, token sequences onto the engines' SeqKeys;
* :mod:`~kvgate.serve.loop`: the engine loop on the scaled clock (:class:`kvgate.http.clock.Clock`);
* :mod:`~kvgate.serve.served`: one served engine, its pool as vLLM reports it, the bridge, the loop;
* :mod:`~kvgate.serve.parse`, :mod:`~kvgate.serve.generate`: the OpenAI routes (completions and chat, streamed
  through :mod:`~kvgate.serve.sse`); :mod:`~kvgate.serve.tokens`: tokenize and detokenize
  (:mod:`~kvgate.serve.tokenizer`);
* :mod:`~kvgate.serve.admin`: reset and flush, server and model info, stats, health, version, models;
* :mod:`~kvgate.serve.metrics`: vLLM's (and SGLang's) Prometheus families, read at scrape time;
* :mod:`~kvgate.serve.kvevents`: ``--kv-events-config``, the pool's KV cache events on ZMQ as vLLM publishes them
  (the pool's observer; ``/kvgate/kv_blocks`` shows the pool by the same hashes);
* :mod:`~kvgate.serve.app`: :class:`EngineServer`, the aiohttp application; :mod:`~kvgate.serve.command`: the
  ``kvgate engine`` command.
"""
