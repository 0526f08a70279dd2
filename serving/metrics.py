"""Prometheus metrics, in a per-app ``CollectorRegistry`` (tests build many apps).

* ``vit_service_http_requests_total{method,route,status}`` and
  ``vit_service_http_request_duration_seconds{method,route,status}`` (histogram); ``route`` is
  the route template (``/v1/models/{name}/reload``), ``unmatched`` for unknown paths.
* ``vit_service_batch_size{model}`` (inputs per forward pass) and
  ``vit_service_batch_duration_seconds{model}``.
* ``vit_service_stage_seconds{model,stage}``: where the time goes (decode, queue, preprocess,
  forward, maps, relevance, faithfulness, results, serialise).
* ``vit_service_model_load_seconds{model}`` (last load), ``vit_service_model_loads_total{model,
  outcome}``, ``vit_service_model_loaded{model}`` (0/1).
"""

from __future__ import annotations

import re
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.routing import Route, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["method", "route", "status"]
        self.requests = Counter(
            "vit_service_http_requests", "HTTP requests", labels, registry=r
        )
        self.latency = Histogram(
            "vit_service_http_request_duration_seconds", "HTTP request latency", labels,
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "vit_service_http_requests_in_flight", "requests being handled", registry=r,
            multiprocess_mode="livesum",
        )
        self.batch_size = Histogram(
            "vit_service_batch_size", "inputs per forward pass", ["model"],
            buckets=BATCH_BUCKETS, registry=r,
        )
        self.batch_seconds = Histogram(
            "vit_service_batch_duration_seconds", "preprocess + forward + maps per batch",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.stage_seconds = Histogram(
            "vit_service_stage_seconds",
            "where a prediction's time goes: decode (per request), queue (wait per request), "
            "preprocess / forward / maps / relevance / faithfulness / results (per batch "
            "group), serialise (per response)",
            ["model", "stage"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_items = Gauge(
            "vit_service_queue_items", "inputs admitted and not yet answered, per lane (plain "
            "predictions / explanations): the signal to autoscale on", ["lane"], registry=r,
            multiprocess_mode="livesum",
        )
        self.shed = Counter(
            "vit_service_shed_requests", "requests answered 503 for a full queue or a missed "
            "deadline", ["lane", "why"], registry=r,
        )
        self.model_load_seconds = Gauge(
            "vit_service_model_load_seconds", "duration of the last model load", ["model"],
            registry=r, multiprocess_mode="max",
        )
        self.model_loads = Counter(
            "vit_service_model_loads", "model load attempts", ["model", "outcome"], registry=r
        )
        self.model_loaded = Gauge(
            "vit_service_model_loaded", "1 if a version of the model is being served (with "
            "several workers: by every live one)", ["model"], registry=r,
            multiprocess_mode="livemin",
        )


class RouteLabeler:
    """Request path -> route template, for low-cardinality labels.

    Built from the OpenAPI paths (full paths, prefixes included) plus plain routes such as
    ``/docs``; FastAPI's ``scope["route"]`` is not used because an included router's route
    does not carry the include prefix.
    """

    def __init__(self) -> None:
        self._routes: list[tuple[re.Pattern[str], str]] | None = None

    def _build(self, app: Any) -> list[tuple[re.Pattern[str], str]]:
        templates = list(app.openapi().get("paths", {})) if hasattr(app, "openapi") else []
        templates += [r.path for r in getattr(app, "routes", []) if isinstance(r, Route)]
        return [(compile_path(t)[0], t) for t in dict.fromkeys(templates)]

    def __call__(self, scope: Scope) -> str:
        if self._routes is None:
            app = scope.get("app")
            if app is None:
                return "unmatched"
            self._routes = self._build(app)
        path = scope.get("path", "")
        for regex, template in self._routes:
            if regex.match(path):
                return template
        return "unmatched"


class MetricsMiddleware:
    """Pure ASGI middleware counting every HTTP request (errors included) and its latency."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self.route_label = RouteLabeler()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.in_flight.dec()
            route = self.route_label(scope)
            labels = (scope["method"], route, str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(time.perf_counter() - start)
