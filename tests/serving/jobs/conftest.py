"""A real Ray head for the jobs tests that run on Ray: one per test session, shared."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serving.jobs.ray_head import RayHead, start_ray_head


@pytest.fixture(scope="session")
def ray_head() -> Iterator[RayHead]:
    head = start_ray_head(num_cpus=2)
    yield head
    head.stop()
