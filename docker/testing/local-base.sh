#!/usr/bin/env bash
# TEST HARNESS ONLY, for hosts that reach Debian's mirror and PyPI but no container registry:
# build a Debian bookworm base image with debootstrap + `docker import`. It carries python3
# (+venv) for docker/Dockerfile's BASE_IMAGE, and postgresql for the stand-in of the official
# postgres image (docker/testing/postgres.Dockerfile). It also trusts this host's extra CA
# certificates (/usr/local/share/ca-certificates) and points pip at them (PIP_CERT), so pip in
# the build passes a TLS-intercepting egress proxy. None of this belongs in, or reaches, the
# users' images.
#   docker/testing/local-base.sh [TAG]
set -euo pipefail
tag=${1:-vit-local-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d /tmp/vit-local-base.XXXXXX)
trap 'rm -rf "$root"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror"
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"  # no services start in the chroot
chmod +x "$root/usr/sbin/policy-rc.d"
chroot "$root" apt-get install -y --no-install-recommends postgresql >/dev/null
# the package's default cluster is not used: the stand-in entrypoint makes its own
chroot "$root" pg_dropcluster --stop 15 main 2>/dev/null || true
rm -f "$root/usr/sbin/policy-rc.d"
cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$root" update-ca-certificates >/dev/null
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin

changes=(--change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt'
         --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
         --change 'ENV LANG=C.UTF-8')
tar -C "$root" -c . | docker import "${changes[@]}" - "$tag" >/dev/null
echo "$tag: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
