# The cohort image: cohort-operator, cohort-sidecar, cohortctl and the
# example trainers (as cohort-example-NAME) in /usr/local/bin, on Debian 12
# with only the shared libraries they link. One image serves the operator
# Deployment and every trainer pod's sidecar.
#
# `make image` (scripts/image.sh) builds it with podman from the checkout
# and passes VERSION, REVISION and CREATED; by hand:
#
#   podman build --build-arg VERSION=$(cat VERSION) \
#       --build-arg REVISION=$(git rev-parse HEAD) -t localhost/cohort:dev .
#
# Build arguments:
#   BUILDER_BASE  where the binaries are compiled (default debian:bookworm-slim)
#   RUNTIME_BASE  where they run (default debian:bookworm-slim)
#   VERSION, REVISION, CREATED, SOURCE   the OCI labels below
#
# A CUDA runtime base: the runtime stage installs the packages that own the
# libraries the binaries link, as the builder found them
# (scripts/runtime-packages.sh), pinned to the builder's versions. So the
# two bases must be the same distribution release with apt, e.g.
#
#   --build-arg BUILDER_BASE=nvidia/cuda:12.6.3-devel-ubuntu24.04 \
#   --build-arg RUNTIME_BASE=nvidia/cuda:12.6.3-runtime-ubuntu24.04
#
# Untested: no registry is reachable from the machines this was made on,
# and the C binaries here use no CUDA themselves (a trainer in the image
# that does would need its own libraries).

ARG BUILDER_BASE=debian:bookworm-slim
ARG RUNTIME_BASE=debian:bookworm-slim

# ---- builder ----------------------------------------------------------------
FROM ${BUILDER_BASE} AS build

# The C build's packages only (scripts/install-deps.sh less the test, Python
# and fuzzing ones); a layer of its own, so that it stays cached while the
# sources change.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        gcc libc6-dev binutils make pkg-config protobuf-c-compiler \
        libgrpc-dev libprotobuf-c-dev libcjson-dev libcurl4-openssl-dev libyaml-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*

# The context is only what the release binaries are built from
# (.dockerignore names it), so one COPY brings it in and a change to the
# tests, the docs or the chart leaves this layer and the next cached.
WORKDIR /src
COPY . .
RUN make -j"$(nproc)" install DESTDIR=/out PREFIX=/usr/local \
 && scripts/runtime-packages.sh /out/usr/local/bin/* > /out/runtime-packages \
 && cat /out/runtime-packages

# ---- runtime ----------------------------------------------------------------
FROM ${RUNTIME_BASE}

# The same list gives the same layer, so this one stays cached too.
COPY --from=build /out/runtime-packages /usr/share/cohort/runtime-packages

# Documentation, manual pages and translations are left out, as Debian's
# slim images do. The user has a passwd entry for tools that look one up;
# it is written rather than made with useradd, which stamps the date.
RUN printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-exclude /usr/share/man/*' \
        'path-exclude /usr/share/info/*' 'path-exclude /usr/share/locale/*' \
        'path-exclude /usr/share/lintian/*' > /etc/dpkg/dpkg.cfg.d/cohort-slim \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        $(cat /usr/share/cohort/runtime-packages) \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
        /var/cache/ldconfig/aux-cache /var/lib/dpkg/*-old /var/cache/debconf/*-old \
 && echo 'cohort:x:65532:65532:cohort:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'cohort:x:65532:' >> /etc/group

COPY --from=build /out/usr/local/bin/ /usr/local/bin/

# Numeric, so that Kubernetes can check runAsNonRoot without a passwd file.
USER 65532:65532
CMD ["cohort-operator"]

# Last: they change with every commit and cost no layer.
ARG RUNTIME_BASE
ARG VERSION=unknown
ARG REVISION=unknown
ARG CREATED=
ARG SOURCE=https://github.com/cohort-dev/cohort
LABEL org.opencontainers.image.title="cohort" \
      org.opencontainers.image.description="Elastic data-parallel training on Kubernetes: operator, broker, sidecar, cohortctl and example trainers" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.base.name="${RUNTIME_BASE}"
