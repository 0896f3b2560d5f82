# One image for the migration, the worker (with beat) and Flower (docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md celeryconfig.py ./
COPY reaper ./reaper
# /app stays root's (the code is read-only to the service); beat's schedule file
# lives in /var/lib/reaper, the one directory the image's user owns.
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /var/lib/reaper --no-create-home reaper \
    && install -d -o reaper -g reaper -m 0750 /var/lib/reaper

USER reaper
# The worker's health (the default command): 503 when no cycle completed or was
# skipped for another runner within three polling intervals (REAPER_METRICS_PORT).
HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('REAPER_METRICS_PORT', '9808'), timeout=5)"]
# celery -A reaper ... imports celeryconfig from the working directory.
WORKDIR /app
# Two pool processes whatever the host's CPU count (each holds its own database
# connections); beat's schedule where the image's user can write it.
CMD ["celery", "-A", "reaper", "worker", "-B", "-l", "INFO", "--concurrency", "2", "-s", "/var/lib/reaper/celerybeat-schedule"]
