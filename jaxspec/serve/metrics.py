"""Prometheus metrics of one server, in a registry of its own (several servers may live in one
process, as in the tests). The engine thread writes them; prometheus_client is thread-safe."""
from __future__ import annotations

from typing import List, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (the /metrics content type)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_PER_CYCLE = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(name, doc, labelnames=list(labels), registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(name, doc, labelnames=list(labels), registry=r).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labelnames=list(labels), buckets=buckets,
                             registry=r).labels(**labels)

        self.running = gauge("jaxspec_num_requests_running", "Requests in the engine's slots.")
        self.waiting = gauge("jaxspec_num_requests_waiting",
                             "Requests accepted and not yet in a slot.")
        self.prompt_tokens = counter("jaxspec_prompt_tokens", "Prompt tokens of the requests "
                                                              "accepted.")
        self.generation_tokens = counter("jaxspec_generation_tokens", "Tokens generated.")
        self._finished = Counter("jaxspec_request_success", "Requests finished, by reason "
                                 "(stop, length, abort).", labelnames=[*labels, "finish_reason"],
                                 registry=r)
        self._rejected = Counter("jaxspec_requests_rejected", "Requests refused, by reason "
                                 "(invalid: 4xx, queue_full: 503).",
                                 labelnames=[*labels, "reason"], registry=r)
        self._labels = labels
        self.ttft = histogram("jaxspec_time_to_first_token_seconds",
                              "From the request's arrival to its first token.", _LATENCY)
        self.e2e = histogram("jaxspec_e2e_request_latency_seconds",
                             "From the request's arrival to its end.", _LATENCY)
        self.tpot = histogram("jaxspec_time_per_output_token_seconds",
                              "A request's time after its first token over its other tokens.",
                              _PER_TOKEN)
        self.cycles = counter("jaxspec_spec_decode_cycles", "Speculative cycles run for "
                                                            "requests.")
        self.accepted = counter("jaxspec_spec_decode_accepted_tokens",
                                "Drafted tokens accepted; over cycles: the accept length.")
        self.emitted = counter("jaxspec_spec_decode_emitted_tokens",
                               "Tokens emitted by speculative cycles (accepted + 1 each); "
                               "over cycles: tokens per cycle.")
        self.tokens_per_cycle = histogram("jaxspec_spec_decode_tokens_per_cycle",
                                          "A finished request's tokens per speculative cycle "
                                          "(bonus token included).", _PER_CYCLE)

    def finished(self, reason: str, t_arrival: float, t_first: Optional[float], t_end: float,
                 n_tokens: int, accept_lens: List[int]):
        """One request's end: its reason, latencies (perf_counter times) and accept lengths."""
        self._finished.labels(**self._labels, finish_reason=reason).inc()
        self.e2e.observe(t_end - t_arrival)
        if t_first is not None:
            self.ttft.observe(t_first - t_arrival)
            if n_tokens > 1:
                self.tpot.observe((t_end - t_first) / (n_tokens - 1))
        if accept_lens:
            self.cycles.inc(len(accept_lens))
            self.accepted.inc(sum(accept_lens))
            self.emitted.inc(sum(accept_lens) + len(accept_lens))
            self.tokens_per_cycle.observe(1 + sum(accept_lens) / len(accept_lens))

    def finished_abort(self):
        """A request dropped because its caller left."""
        self._finished.labels(**self._labels, finish_reason="abort").inc()

    def rejected(self, reason: str):
        self._rejected.labels(**self._labels, reason=reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
