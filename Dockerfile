# One image for the migration, the worker (with beat) and Flower (docker-compose.yml).
#
# Two stages. The first installs the service into /opt/reaper exactly as uv.lock
# pins it: the service's dependencies alone (no dev extra), every file's hash
# checked, and the project itself (not editable). The second holds that tree and
# nothing else of the build: no uv, no sources. tests/test_image.py builds the
# same tree with the same command (scripts/deps.py service-tree) and runs it as
# this image's user.
FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml uv.lock README.md celeryconfig.py ./
COPY scripts/deps.py ./scripts/
COPY reaper ./reaper
# uv first, as locked (pip checks its hashes), then the tree; uv's cache is a
# BuildKit cache mount, kept out of the image
RUN --mount=type=cache,target=/root/.cache/uv \
    python scripts/deps.py uv-requirement >/tmp/uv-requirement.txt \
    && pip install --require-hashes --no-deps --only-binary :all: -r /tmp/uv-requirement.txt \
    && python scripts/deps.py service-tree /opt/reaper --compile-bytecode

FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PATH=/opt/reaper/bin:$PATH

COPY --from=build /opt/reaper /opt/reaper
# /opt/reaper stays root's (the code is read-only to the service); beat's
# schedule file lives in /var/lib/reaper, the one directory the image's user owns.
RUN useradd --system --uid 10001 --home-dir /var/lib/reaper --no-create-home reaper \
    && install -d -o reaper -g reaper -m 0750 /var/lib/reaper

USER reaper
WORKDIR /var/lib/reaper
# The worker's health (the default command): 503 when no cycle completed or was
# skipped for another runner within three polling intervals (REAPER_METRICS_PORT).
HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('REAPER_METRICS_PORT', '9808'), timeout=5)"]
# Two pool processes whatever the host's CPU count (each holds its own database
# connections); beat's schedule where the image's user can write it. celery
# imports celeryconfig from the installed tree.
CMD ["celery", "-A", "reaper", "worker", "-B", "-l", "INFO", "--concurrency", "2", "-s", "/var/lib/reaper/celerybeat-schedule"]
