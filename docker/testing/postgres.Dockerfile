# TEST HARNESS ONLY: a stand-in for the official postgres image on hosts that cannot pull it,
# built on docker/testing/local-base.sh's image (which carries Debian's postgresql 15). It
# honours what compose.yaml uses of the official image: POSTGRES_USER/PASSWORD/DB, *.sql in
# /docker-entrypoint-initdb.d run once on first start, PGDATA in a volume, pg_isready.
ARG BASE_IMAGE=vit-local-base:bookworm
FROM ${BASE_IMAGE}
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
ENV PGDATA=/var/lib/postgresql/data
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
