# One image for the migration, the worker (with beat) and Flower (docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md celeryconfig.py ./
COPY reaper ./reaper
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /app reaper

USER reaper
# The worker's health (the default command): 503 when no cycle completed or was
# skipped for another runner within three polling intervals (REAPER_METRICS_PORT).
HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('REAPER_METRICS_PORT', '9808'), timeout=5)"]
# celery -A reaper ... imports celeryconfig from the working directory
WORKDIR /app
CMD ["celery", "-A", "reaper", "worker", "-B", "-l", "INFO"]
