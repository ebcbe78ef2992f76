"""``kvgate epp``: kvgate's policy core as the endpoint picker of an Envoy (Gateway API Inference Extension's
protocol, over ext_proc). See :mod:`kvgate.epp.picker` and docs/envoy.md."""
