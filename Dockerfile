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
# celery -A reaper ... imports celeryconfig from the working directory
WORKDIR /app
CMD ["celery", "-A", "reaper", "worker", "-B", "-l", "INFO"]
