"""Real servers for the jobs tests, one per test session, shared: a Ray head for the tests that
run on Ray, a PostgreSQL server (a fresh database per test) for those on PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.serving.jobs.postgres_server import (
    PostgresServer,
    PostgresUnavailable,
    start_postgres,
)
from tests.serving.jobs.ray_head import RayHead, start_ray_head


@pytest.fixture(scope="session")
def ray_head() -> Iterator[RayHead]:
    head = start_ray_head(num_cpus=2)
    yield head
    head.stop()


def _require_postgres() -> bool:
    """CI must run the PostgreSQL tests: there a missing server fails them, elsewhere skips."""
    return bool(os.environ.get("CI") or os.environ.get("VIT_SERVICE_REQUIRE_POSTGRES"))


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A private PostgreSQL server for the session (tests/serving/jobs/postgres_server.py)."""
    try:
        server = start_postgres()
    except PostgresUnavailable as e:
        if _require_postgres():
            pytest.fail(f"PostgreSQL is required here (CI): {e}")
        pytest.skip(f"PostgreSQL not available: {e}")
    yield server
    server.stop()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> Iterator[str]:
    """The SQLAlchemy URL of a fresh database of its own for one test, dropped after it."""
    name = postgres.create_database()
    yield postgres.url(name)
    postgres.drop_database(name)
