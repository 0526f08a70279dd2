import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from serving.batching import MicroBatcher

IMAGE, TEXT = "/v1/predict/image", "/v1/predict/text"


# --- the batcher on its own --------------------------------------------------------------------


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every timeout the batcher waits for more requests with (``asyncio.wait_for``): what it
    decided to wait, read without a wall clock that a loaded machine stretches."""
    real = asyncio.wait_for
    seen: list[float] = []

    async def spy(aw, timeout):
        seen.append(timeout)
        return await real(aw, timeout)

    monkeypatch.setattr(asyncio, "wait_for", spy)
    return seen


def test_batcher_groups_jobs_keeps_order_and_never_splits_a_job() -> None:
    seen: list[list[str]] = []

    def process(jobs: list[str]) -> list[str]:
        seen.append(list(jobs))
        return [j.upper() for j in jobs]

    async def main() -> list[str]:
        with ThreadPoolExecutor(1) as ex:
            b = MicroBatcher("t", process, ex, max_batch_size=4, max_wait_ms=200)
            sizes = {"a": 1, "b": 1, "c": 3, "d": 2, "e": 5}
            tasks = []
            for name, size in sizes.items():
                tasks.append(asyncio.create_task(b.submit(name, size)))
                await asyncio.sleep(0)  # enqueue in this order
            out = await asyncio.gather(*tasks)
            await b.close()
            return out

    assert _run(main()) == ["A", "B", "C", "D", "E"]
    # a+b (2) cannot take c (3 -> 5 > 4): c starts the next batch; e (5 > 4) runs alone
    assert seen == [["a", "b"], ["c"], ["d"], ["e"]]


def test_batcher_errors_are_per_job_and_the_batcher_survives() -> None:
    def process(jobs: list[int]) -> list[object]:
        if -1 in jobs:
            raise RuntimeError("whole batch failed")
        return [ValueError(f"bad {j}") if j < 0 else j * 10 for j in jobs]

    async def main() -> None:
        with ThreadPoolExecutor(1) as ex:
            b = MicroBatcher("t", process, ex, max_batch_size=8, max_wait_ms=50)
            r = await asyncio.gather(b.submit(1, 1), b.submit(-2, 1), b.submit(3, 1),
                                     return_exceptions=True)
            assert r[0] == 10 and isinstance(r[1], ValueError) and r[2] == 30
            with pytest.raises(RuntimeError, match="whole batch"):
                await b.submit(-1, 1)
            assert await b.submit(4, 1) == 40
            await b.close()

    _run(main())


def test_fixed_wait_holds_every_lone_request_for_the_window_and_no_longer(
        waits: list[float]) -> None:
    async def main() -> tuple[float, float, list[float]]:
        with ThreadPoolExecutor(1) as ex:
            b = MicroBatcher("t", lambda jobs: jobs, ex, max_batch_size=8, max_wait_ms=120,
                             adaptive=False)
            start = time.perf_counter()
            await b.submit(0, 1)
            first = time.perf_counter() - start
            windows = [b.last_window_s]
            await asyncio.sleep(0.3)  # one request at a time: the fixed window still applies
            start = time.perf_counter()
            await b.submit(1, 1)
            spaced = time.perf_counter() - start
            windows.append(b.last_window_s)
            await b.close()
            return first, spaced, windows

    first, spaced, windows = _run(main())
    assert windows == [0.12, 0.12]
    assert 0.1 < first and 0.1 < spaced  # waited the window: a bound no load can break
    assert waits and all(0 < t <= 0.12 for t in waits), waits  # and never asked for more


def test_adaptive_wait_sends_a_lone_request_at_once_and_still_batches_a_dense_stream(
        waits: list[float]) -> None:
    seen: list[int] = []

    def process(jobs: list[int]) -> list[int]:
        seen.append(len(jobs))
        return jobs

    async def main() -> tuple[int, list[float], list[float]]:
        with ThreadPoolExecutor(1) as ex:
            b = MicroBatcher("t", process, ex, max_batch_size=64, max_wait_ms=200,
                             adaptive=True)
            await b.submit(0, 1)  # nothing came before it: no reason to wait
            used = [b.last_window_s]
            await asyncio.sleep(0.4)
            await b.submit(1, 1)  # one request at a time, 0.4 s apart: still no wait
            used.append(b.last_window_s)
            waited = len(waits)
            # a dense stream (a submission every ~2 ms): the window opens and batches fill
            tasks = []
            for i in range(30):
                tasks.append(asyncio.create_task(b.submit(10 + i, 1)))
                await asyncio.sleep(0.002)
            assert await asyncio.gather(*tasks) == list(range(10, 40))
            windows = [b.wait_window_s()]
            for i in range(4):  # the stream thins out: the window closes again
                await asyncio.sleep(0.4)
                await b.submit(100 + i, 1)
            windows.append(b.wait_window_s())
            await b.close()
            return waited, used, windows

    waited, used, windows = _run(main())
    assert used == [0.0, 0.0]  # neither opened the window
    assert waited == 0  # so each was sent at once (the fixed window would wait 0.2 s for each)
    assert seen[:2] == [1, 1]
    stream = seen[2:-4]
    assert sum(stream) == 30 and len(stream) <= 5, seen  # shared batches, not 30 forwards
    assert windows == [0.2, 0.0]


# --- through the app: concurrent requests share a forward pass, results unchanged ---------------


def _fire(fns):
    """Call every function at (nearly) the same moment from its own thread."""
    barrier = threading.Barrier(len(fns))

    def go(fn):
        barrier.wait()
        return fn()

    with ThreadPoolExecutor(len(fns)) as ex:
        return list(ex.map(go, fns))


def _assert_same(batched: dict, single: dict) -> None:
    assert batched["model"]["version"] == single["model"]["version"]
    for b, s in zip(batched["results"], single["results"], strict=True):
        assert [p["index"] for p in b["predictions"]] == [p["index"] for p in s["predictions"]]
        np.testing.assert_allclose([p["probability"] for p in b["predictions"]],
                                   [p["probability"] for p in s["predictions"]], atol=1e-5)
        assert (b["attention"] is None) == (s["attention"] is None)
        if b["attention"] is not None:
            for key in ("rollout", "layers", "heads"):
                if s["attention"][key] is None:
                    assert b["attention"][key] is None
                else:
                    np.testing.assert_allclose(b["attention"][key], s["attention"][key],
                                               atol=1e-5)
        assert b.get("tokens") == s.get("tokens")


def test_concurrent_image_requests_are_batched_and_equal_single_requests(
    make_client, client, image_bytes
) -> None:
    batched = make_client({"cifar10-vit": "models:/cifar10-vit@champion"}, max_wait_ms=400,
                          max_batch_size=64)
    requests = []
    for i in range(8):
        params = {"attention": ["rollout", "heads", "none"][i % 3], "top_k": 3}
        if i % 4 == 3:  # a multipart request with two images
            files = [("file", (f"{i}a.png", image_bytes((30 + i, 20), seed=i), "image/png")),
                     ("file", (f"{i}b.png", image_bytes((20, 50), seed=100 + i), "image/png"))]
            requests.append({"files": files, "params": params})
        else:
            requests.append({"content": image_bytes((32, 32), seed=i), "params": params,
                             "headers": {"content-type": "image/png"}})

    responses = _fire([lambda kw=kw: batched.post(IMAGE, **kw) for kw in requests])
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    service = batched.app.state.service
    # 8 requests arriving together within max_wait share a batch (typically exactly one)
    assert service.batcher("cifar10-vit").batches <= 2
    metrics = batched.get("/metrics").text
    assert 'vit_service_batch_size_sum{model="cifar10-vit"} 10.0' in metrics  # 6 + 2*2 images

    for kw, r in zip(requests, responses, strict=True):
        single = client.post(IMAGE, **kw)  # the module app, one request at a time
        _assert_same(r.json(), single.json())


def test_concurrent_text_requests_are_batched_and_equal_single_requests(
    make_client, client
) -> None:
    batched = make_client({"imdb-sentiment": "models:/imdb-sentiment@champion"},
                          max_wait_ms=400)
    payloads = [
        {"text": "dull"},
        {"text": ["the plot was dull and the acting was terrible", "loved it"],
         "attention": "heads"},
        {"text": " ".join(["great"] * 40)},
        {"text": "an instant classic", "attention": "none"},
        {"text": "i fell asleep", "top_k": 1},
    ]
    responses = _fire([lambda p=p: batched.post(TEXT, json=p) for p in payloads])
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert batched.app.state.service.batcher("imdb-sentiment").batches <= 2
    for p, r in zip(payloads, responses, strict=True):
        _assert_same(r.json(), client.post(TEXT, json=p).json())


def test_server_keeps_working_under_concurrent_mixed_load(client, image_bytes) -> None:
    good, bad = image_bytes(), b"\x89PNG\r\n\x1a\nbroken"
    png = {"content-type": "image/png"}

    def call(i: int) -> int:
        kind = i % 5
        if kind == 0:
            return client.post(IMAGE, content=bad, headers=png).status_code
        if kind == 1:
            return client.post(TEXT, json={"text": ""}).status_code
        if kind == 2:
            return client.post(IMAGE, content=good, params={"model": "x"},
                               headers={"content-type": "image/png"}).status_code
        if kind == 3:
            return client.post(TEXT, json={"text": "fine film"}).status_code
        return client.post(IMAGE, content=good, headers={"content-type": "image/png"}).status_code

    with ThreadPoolExecutor(8) as ex:
        codes = list(ex.map(call, range(40)))
    assert codes == [[400, 422, 404, 200, 200][i % 5] for i in range(40)]
    assert client.get("/readyz").status_code == 200
