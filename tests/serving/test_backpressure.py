"""Load shedding: bounded lanes answer 503 with Retry-After, a deadline per request, plain
predictions and /healthz answered while explanations are queued, the queue depth exported."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor


def _png(image_bytes) -> bytes:
    return image_bytes(seed=3)


def _post(client, data: bytes, **params):
    return client.post("/v1/predict/image", content=data, params=params,
                       headers={"content-type": "image/png"})


def _block(client, seconds: float) -> threading.Event:
    """Hold the one inference thread for ``seconds``: everything admitted queues behind it."""
    started = threading.Event()

    def hold() -> None:
        started.set()
        time.sleep(seconds)

    client.app.state.service.executor.submit(hold)
    assert started.wait(5)
    return started


def test_a_full_explain_lane_sheds_with_503_while_plain_and_health_answer(
        make_client, registry, image_bytes) -> None:
    client = make_client({"local-vit": str(registry.local_bundle)}, max_queued_explain_items=2,
                         explain_batch_size=1, request_timeout_s=30.0)
    data = _png(image_bytes)
    assert _post(client, data, model="local-vit").status_code == 200  # loaded, warm
    _block(client, 1.5)
    with ThreadPoolExecutor(6) as pool:
        explains = [pool.submit(_post, client, data, model="local-vit",
                                attention="relevance", faithfulness="true") for _ in range(5)]
        time.sleep(0.3)  # all five have been admitted or refused by now
        t0 = time.monotonic()
        health = client.get("/healthz")
        assert health.status_code == 200 and time.monotonic() - t0 < 1.0  # not queued
        depth = client.get("/metrics").text
        assert 'vit_service_queue_items{lane="explain"} 2.0' in depth, depth[-2000:]
        plain = pool.submit(_post, client, data, model="local-vit")
        codes = sorted(f.result().status_code for f in explains)
        assert codes == [200, 200, 503, 503, 503], codes
        refused = next(f.result() for f in explains if f.result().status_code == 503)
        assert refused.headers["retry-after"] == "1"
        assert "explain queue is full" in refused.json()["detail"]
        assert plain.result().status_code == 200
    metrics = client.get("/metrics").text
    assert 'vit_service_shed_requests_total{lane="explain",why="full"} 3.0' in metrics
    assert 'vit_service_queue_items{lane="explain"} 0.0' in metrics


def test_a_request_past_its_deadline_is_503_and_its_work_dropped(
        make_client, registry, image_bytes) -> None:
    client = make_client({"local-vit": str(registry.local_bundle)}, request_timeout_s=0.3)
    data = _png(image_bytes)
    assert _post(client, data, model="local-vit").status_code == 200
    before = client.app.state.service.batcher("local-vit").batches
    _block(client, 1.0)
    r = _post(client, data, model="local-vit")
    assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
    time.sleep(1.0)  # the thread is free again: the abandoned job is skipped, not run
    assert client.app.state.service.batcher("local-vit").batches == before
    assert _post(client, data, model="local-vit").status_code == 200


def test_a_request_that_would_wait_too_long_is_shed_before_its_body_is_read(
        make_client, registry, image_bytes) -> None:
    """The lane's measured seconds per input x the inputs ahead of a request is its wait: past
    ``max_queue_wait_s``, 503 at once with a Retry-After of that wait."""
    client = make_client({"local-vit": str(registry.local_bundle)}, max_queue_wait_s=0.5)
    data = _png(image_bytes)
    assert _post(client, data, model="local-vit").status_code == 200
    service = client.app.state.service
    service.per_input_s["plain"] = 0.2  # as if each input had cost 0.2 s
    _block(client, 1.5)
    with ThreadPoolExecutor(4) as pool:
        first = [pool.submit(_post, client, data, model="local-vit") for _ in range(2)]
        time.sleep(0.3)  # both admitted: 2 x 0.2 s <= 0.5 s
        r = _post(client, b"not even an image", model="local-vit")
        assert r.status_code == 503, r.text  # 3 x 0.2 s > 0.5 s: shed, the body never read
        assert r.headers["retry-after"] == "1" and "~0.6s" in r.json()["detail"]
        assert [f.result().status_code for f in first] == [200, 200]
    metrics = client.get("/metrics").text
    assert 'vit_service_shed_requests_total{lane="plain",why="wait"} 1.0' in metrics
    # alone in its lane a request is admitted whatever the estimate (nothing is ahead of it)
    service.per_input_s["plain"] = 10.0
    assert _post(client, data, model="local-vit").status_code == 200
