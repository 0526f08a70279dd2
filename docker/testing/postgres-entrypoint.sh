#!/bin/sh
# TEST HARNESS ONLY: see postgres.Dockerfile.
set -eu
bin=/usr/lib/postgresql/15/bin
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}"
mkdir -p "$PGDATA" /var/run/postgresql
chown -R postgres:postgres "$PGDATA" /var/run/postgresql
chmod 0700 "$PGDATA"
as_pg() { su postgres -s /bin/sh -c "$*"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pw=$(mktemp) && printf '%s\n' "$POSTGRES_PASSWORD" >"$pw" && chown postgres "$pw"
    as_pg "$bin/initdb -D '$PGDATA' -U '$POSTGRES_USER' --pwfile='$pw' -A scram-sha-256 --auth-local=trust" >/dev/null
    rm -f "$pw"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    as_pg "$bin/pg_ctl -D '$PGDATA' -o '-c listen_addresses=' -w start" >/dev/null
    [ "$POSTGRES_DB" = postgres ] || psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d postgres \
        -c "CREATE DATABASE \"$POSTGRES_DB\""
    for f in /docker-entrypoint-initdb.d/*.sql; do
        [ -e "$f" ] && psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d "$POSTGRES_DB" -f "$f"
    done
    as_pg "$bin/pg_ctl -D '$PGDATA' -m fast -w stop" >/dev/null
fi
exec su postgres -s /bin/sh -c "exec $bin/postgres -D '$PGDATA' -c listen_addresses='*'"
